"""kernels/__init__.py's adjustments to Triton's interpreter (CPU only): one language patch per launch."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

import mtc.kernels  # noqa: F401  (its interpreter adjustments)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's path only")


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _helper_loop_kernel(x_ptr, out_ptr, N: tl.constexpr, REPS: tl.constexpr):
    offs = tl.arange(0, N)
    acc = tl.load(x_ptr + offs)
    for _ in range(REPS):
        acc = _twice(acc) * 0.5 + 1.0  # a @triton.jit helper called inside the loop
    tl.store(out_ptr + offs, acc)


def test_helpers_called_inside_a_kernel_do_not_patch_the_language_again(monkeypatch):
    # The interpreter re-patched tl at every helper call (~3 ms each, a third of a compiled
    # parity run); a launch now patches once, its helpers reuse it, and the result is unchanged.
    from triton.runtime import interpreter

    calls = []
    real = interpreter._patch_lang_core  # called once per language module a patch covers

    def counting(lang, scope):
        calls.append(lang.__name__)
        return real(lang, scope)

    monkeypatch.setattr(interpreter, "_patch_lang_core", counting)
    arange = tl.arange
    x = torch.randn(16)
    out = torch.empty_like(x)
    _helper_loop_kernel[(2,)](x, out, N=16, REPS=20)
    assert calls == ["triton.language"], f"the language was patched {len(calls)} times in one launch"
    torch.testing.assert_close(out, x + 20.0)
    # the launch's scope restored tl: a second launch patches (once) again and computes the same
    _helper_loop_kernel[(1,)](x, out, N=16, REPS=3)
    assert calls == ["triton.language"] * 2
    torch.testing.assert_close(out, x + 3.0)
    assert tl.arange is arange, "tl stayed patched after the launch"


@triton.jit
def _int_math_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)  # int32: each op below is a 32-bit integer op
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, (x + offs) * 3 - offs)


def test_integer_ops_skip_the_overflow_check_that_is_dropped_without_debug(monkeypatch):
    # Without debug the overflow check's assert is dropped (device_assert returns first), yet the
    # interpreter built the check anyway: casts, the op in int64 and two compares per int op.
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    assert not builder.options.debug and not builder.options.sanitize_overflow
    compares = []
    real = type(builder).create_icmpSLE

    def counting(self, *args):  # noqa: ANN001, ANN002, ANN202
        compares.append(1)
        return real(self, *args)

    monkeypatch.setattr(type(builder), "create_icmpSLE", counting)
    x = torch.arange(8, dtype=torch.int32)
    out = torch.empty_like(x)
    _int_math_kernel[(1,)](x, out, N=8)
    assert torch.equal(out, (x + torch.arange(8, dtype=torch.int32)) * 3 - torch.arange(8, dtype=torch.int32))
    assert compares == [], f"{len(compares)} overflow compares built for asserts that are dropped"


def test_numpy_dtypes_are_the_interpreters_own_remembered():
    from triton.runtime import interpreter

    get = interpreter._get_np_dtype
    assert getattr(get, "cached", False), "the interpreter rebuilds its dtype table at every op"
    types = [tl.int1, tl.int8, tl.int32, tl.int64, tl.uint32, tl.float16, tl.bfloat16, tl.float32, tl.float64,
             tl.pointer_type(tl.float32), tl.block_type(tl.float32, [4]), tl.block_type(tl.bfloat16, [2, 8]),
             tl.block_type(tl.pointer_type(tl.int32), [4])]
    original = get.original
    for t in types * 2:  # the second pass answers from memory
        assert get(t) == original(t), t
