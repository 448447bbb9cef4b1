"""The flash-attention kernels against the fp32 reference: output, logsumexp, dq, dk, dv.

Without CUDA these run in Triton's interpreter (tiny shapes, 16- and 32-row tiles); on a GPU the
same small cases run on CUDA with its tiles and the `gpu` tests add bf16 at Llama-8B shapes.
"""

from __future__ import annotations

import math

import mtc.kernels.flash_attention as fa
import pytest
import torch
import torch.nn.functional as F
from mtc.kernels.flash_attention import flash_attention, flash_attention_ref

from mtc.errors import KernelInputError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (atol, rtol) against the fp32 reference, for the dtype of the inputs. The half entries cover
# rounding the outputs and, on CUDA, the P / dS operands of the tensor-core matmuls at T = 2048
# (measured by emulating that rounding in torch: bf16 needs atol 0.011 at rtol 0.016).
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


def _inputs(B, H, H_KV, T, D, dtype, device=DEVICE, bthd=False):
    """Fresh q, k, v (leaves) and an upstream gradient dO; bthd=True gives views with four different
    layouts: q a transpose of (B, T, H, D), k a slice of a fused (B, T, 2, Hkv, D) buffer, v and dO
    transposes of (B, H, D, T) (stride 1 along T)."""
    if bthd:
        q = torch.randn(B, T, H, D, device=device, dtype=dtype).transpose(1, 2)
        k = torch.randn(B, T, 2, H_KV, D, device=device, dtype=dtype)[:, :, 0].transpose(1, 2)
        v = torch.randn(B, H_KV, D, T, device=device, dtype=dtype).transpose(2, 3)
        do = torch.randn(B, H, D, T, device=device, dtype=dtype).transpose(2, 3)
    else:
        q = torch.randn(B, H, T, D, device=device, dtype=dtype)
        k = torch.randn(B, H_KV, T, D, device=device, dtype=dtype)
        v = torch.randn(B, H_KV, T, D, device=device, dtype=dtype)
        do = torch.randn(B, H, T, D, device=device, dtype=dtype)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _check(B, H, H_KV, T, D, causal, dtype, scale=None, bthd=False, device=DEVICE):
    q, k, v, do = _inputs(B, H, H_KV, T, D, dtype, device, bthd)
    out = flash_attention(q, k, v, causal=causal, scale=scale)
    assert out.shape == (B, H, T, D) and out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), do)

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = flash_attention_ref(q32, k32, v32, causal=causal, scale=scale)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), do.float())

    atol, rtol = TOL[dtype]
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


# (B, Hq, Hkv, T, D): ragged T over two and three blocks, T inside one block, T == 1,
# groups of 1, 2 and 4 query heads per KV head, D padded (24 -> 32) and D == 128.
SHAPES = [
    (1, 2, 1, 19, 16),
    (2, 4, 2, 33, 32),
    (1, 4, 1, 16, 64),
    (1, 1, 1, 5, 128),
    (1, 2, 2, 21, 24),
    (1, 2, 1, 1, 16),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_matches_reference(shape, causal):
    _check(*shape, causal=causal, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_half_matches_reference(dtype, causal):
    _check(2, 4, 2, 33, 32, causal=causal, dtype=dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_strided_views_and_scale(causal):
    """q, k, v and dO as non-contiguous views, each with its own strides."""
    _check(2, 4, 2, 19, 32, causal=causal, dtype=torch.float32, scale=0.3, bthd=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the fp16 tests run this path directly")
def test_half_tensor_core_path_in_interpreter(monkeypatch):
    """fp16 operands straight into tl.dot with P and dS rounded to fp16, the CUDA path for half
    inputs (the interpreter gets fp16 right, unlike bf16)."""
    from mtc.kernels.tuning import Tuner

    config = fa._config
    monkeypatch.setattr(fa, "_config", lambda q, kernel, key, launch, extra=(): {**config(q, kernel, key, launch, extra), "HALF_DOT": True})
    monkeypatch.setattr(fa, "_TUNER", Tuner("test"))  # nothing recalled from other tests' shapes: every launch asks _config
    _check(2, 4, 2, 33, 32, causal=True, dtype=torch.float16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the interpreter's tiles")
def test_tuner_times_candidates_and_keeps_the_fastest(monkeypatch):
    """Several tile candidates per kernel: each is launched and timed (a clock that says the last
    is fastest, and a first candidate that fails to launch), the fastest is kept, results stay right."""
    from mtc.kernels.tuning import Tuner

    tiles = {"fwd": [(32, 16, 1, 1), (16, 16, 1, 1), (64, 32, 1, 1)], "dq": [(32, 16, 1, 1), (16, 16, 1, 1), (32, 32, 1, 1)],
             "dkdv": [(16, 32, 1, 1), (16, 16, 1, 1), (32, 64, 1, 1)]}
    calls = []

    def clock(fn):
        calls.append(fn)
        if len(calls) % 3 == 1:
            raise RuntimeError("out of shared memory")  # the first candidate of each kernel "fails"
        fn()
        return 10.0 - len(calls) % 3

    monkeypatch.setitem(fa._TILES, "interpreter", tiles)
    monkeypatch.setattr(fa, "_TUNER", Tuner("test", bench=clock))
    _check(1, 4, 2, 37, 16, causal=True, dtype=torch.float32)
    assert len(calls) == 9  # three kernels, three candidates each, timed once
    best = {key[0]: (cfg["BLOCK_M"], cfg["BLOCK_N"]) for key, cfg in fa._TUNER.best.items() if isinstance(cfg, dict)}
    assert best == {"fwd": (16, 16), "dq": (16, 16), "dkdv": (16, 16)}  # 9.0 beats 10.0; the failure is skipped
    _check(1, 4, 2, 37, 16, causal=True, dtype=torch.float32)
    assert len(calls) == 9, "a known shape must not be timed again"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_saved_logsumexp(causal):
    B, H, H_KV, T, D = 1, 4, 2, 21, 32
    q, k, v, _ = _inputs(B, H, H_KV, T, D, torch.float32)
    out, lse = fa._flash_attn_fwd(q, k, v, causal, 0.5)
    s = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.5
    if causal:
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    assert lse.shape == (B, H, T) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v.repeat_interleave(2, dim=1), atol=1e-5, rtol=1e-5)


def test_reference_matches_sdpa():
    q, k, v, _ = _inputs(2, 4, 2, 9, 8, torch.float32)
    for causal in (True, False):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(flash_attention_ref(q, k, v, causal=causal), want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(flash_attention_ref(q, k, v, causal=causal, scale=1 / math.sqrt(8)), want, atol=1e-6, rtol=1e-5)


def _t(*shape, dtype=torch.float32, device=DEVICE):
    return torch.zeros(shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "args,match",
    [
        ((_t(1, 2, 8, 16), _t(1, 1, 8, 16, device="meta"), _t(1, 1, 8, 16)), "one device"),
        ((_t(1, 2, 8, 16, dtype=torch.float64),) * 3, "dtype"),
        ((_t(1, 2, 8, 16), _t(1, 1, 8, 16, dtype=torch.float16), _t(1, 1, 8, 16)), "dtype"),
        ((_t(2, 8, 16), _t(2, 8, 16), _t(2, 8, 16)), "4-D"),
        ((_t(1, 2, 8, 16), _t(1, 1, 9, 16), _t(1, 1, 9, 16)), r"k, v \(B, Hkv, T, D\)"),
        ((_t(1, 2, 8, 16), _t(1, 1, 8, 16), _t(1, 1, 8, 32)), r"k, v \(B, Hkv, T, D\)"),
        ((_t(1, 3, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16)), "multiple of KV heads"),
        ((_t(1, 2, 8, 160), _t(1, 1, 8, 160), _t(1, 1, 8, 160)), "head dim"),
    ],
    ids=["device", "float64", "mixed", "3d", "seq", "vdim", "groups", "headdim"],
)
def test_launcher_errors(args, match):
    with pytest.raises(KernelInputError, match=match):
        flash_attention(*args)


def test_the_compiled_graphs_op_checks_its_inputs_too():
    # compiled graphs call mtc::flash_attention_fwd / _bwd directly, not `flash_attention`
    q, kv = _t(2, 32768, 1, 16), _t(2, 1, 1, 16)  # batch x heads past the kernels' grid limit of 65535
    with pytest.raises(KernelInputError, match="over the kernels' limit of 65535"):
        torch.ops.mtc.flash_attention_fwd(q, kv, kv, True, 0.25)
    with pytest.raises(KernelInputError, match="multiple of KV heads"):
        torch.ops.mtc.flash_attention_bwd(_t(1, 3, 8, 16), _t(1, 3, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16),
                                          _t(1, 3, 8, 16), _t(1, 3, 8), True, 0.25)


def test_launcher_rejects_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(fa, "_INTERPRETED", False)
    with pytest.raises(KernelInputError, match="CUDA device"):
        flash_attention(_t(1, 2, 8, 16, device="cpu"), _t(1, 1, 8, 16, device="cpu"), _t(1, 1, 8, 16, device="cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_bf16_llama8b_shape(causal):
    _check(2, 32, 8, 2048, 128, causal=causal, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gpu_ragged_long(dtype):
    _check(1, 8, 2, 1031, 64, causal=True, dtype=dtype, device="cuda", bthd=True)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_int64_offsets():
    """q and o hold more than 2**31 elements: batch/head offsets must not wrap in int32."""
    B, H, H_KV, T, D = 8200, 2, 1, 1024, 128
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, H_KV, T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, H_KV, T, D, device="cuda", dtype=torch.bfloat16)
    assert q.numel() > 2**31
    out = flash_attention(q, k, v)
    atol, rtol = TOL[torch.bfloat16]
    for b in (0, B - 1):
        want = flash_attention_ref(q[b : b + 1].float(), k[b : b + 1].float(), v[b : b + 1].float())
        torch.testing.assert_close(out[b : b + 1].float(), want, atol=atol, rtol=rtol)
