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
