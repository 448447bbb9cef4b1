"""The cuDNN backend of the flash-attention ops: it competes only where it agrees with the Triton
kernels, loses to them when slower, and anything it raises leaves the Triton kernels in charge.

On the CPU the cuDNN calls are stood in for by torch math (right, wrong, or raising) and the
clock is a fake, so the selection logic runs in Triton's interpreter; the gpu test runs the real
cuDNN kernels at a Llama shape.
"""

from __future__ import annotations

import math

import mtc.kernels.cudnn_attention as cudnn_attention
import mtc.kernels.flash_attention as fa
import pytest
import torch
from mtc.kernels.flash_attention import flash_attention, flash_attention_ref
from mtc.kernels.tuning import Tuner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ref_fwd(q, k, v, causal, scale, o, lse):
    rep = q.shape[1] // k.shape[1]
    s = (q.float() @ k.float().repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    o.copy_(flash_attention_ref(q, k, v, causal, scale))
    lse.copy_(torch.logsumexp(s, -1))


def _ref_bwd(do, q, k, v, o, lse, causal, scale, dq, dk, dv):
    # plain fp32 math (the ops run below autograd, so no autograd.grad here)
    rep = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    p = torch.softmax(s, -1)
    g = do.float()
    dp = g @ vf.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq.copy_((ds @ kf) * scale)
    dk.copy_(((ds.transpose(-1, -2) @ q.float()) * scale).unflatten(1, (k.shape[1], rep)).sum(2))
    dv.copy_((p.transpose(-1, -2) @ g).unflatten(1, (k.shape[1], rep)).sum(2))


def _wrong_bwd(do, q, k, v, o, lse, causal, scale, dq, dk, dv):
    _ref_bwd(do, q, k, v, o, lse, causal, scale, dq, dk, dv)
    dk.mul_(2.0)


def _raise(*args):
    raise RuntimeError("cuDNN: no engine for this graph")


@pytest.fixture
def cudnn_stand_in(monkeypatch):
    """Make cuDNN a candidate everywhere; its launches are 'faster' (the fake clock says 1 vs 2)."""
    if DEVICE == "cuda":
        pytest.skip("the real cuDNN is tested on the GPU")
    last = []

    def bench(fn):
        last.clear()
        fn()
        return 1.0 if last else 2.0

    def mark(f):
        def g(*a):
            last.append(True)
            return f(*a)
        return g

    monkeypatch.setattr(fa, "_cudnn_candidate", lambda q: True)
    monkeypatch.setattr(fa, "_TUNER", Tuner("flash_attention", bench=bench))
    return lambda fwd, bwd: (monkeypatch.setattr(cudnn_attention, "forward", mark(fwd)),
                             monkeypatch.setattr(cudnn_attention, "backward", mark(bwd)))


def _run(B=1, H=2, H_KV=1, T=24, D=16):
    q, k, v = (torch.randn(B, h, T, D, requires_grad=True) for h in (H, H_KV, H_KV))
    do = torch.randn(B, H, T, D)
    out = flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q32, k32, v32 = (t.detach().requires_grad_() for t in (q, k, v))
    ref = flash_attention_ref(q32, k32, v32, True)
    want = torch.autograd.grad(ref, (q32, k32, v32), do)
    for got, exp in zip((out, *grads), (ref, *want), strict=True):
        torch.testing.assert_close(got, exp, atol=1e-4, rtol=1e-4)
    return fa.tuning_choices()


def test_agreeing_faster_cudnn_is_chosen(cudnn_stand_in):
    cudnn_stand_in(_ref_fwd, _ref_bwd)
    choices = _run()
    assert any(k.startswith("fwd/") and v == {"BACKEND": "cudnn"} for k, v in choices.items()), choices
    assert any(k.startswith("bwd_backend/") and v == "cudnn" for k, v in choices.items()), choices


def test_disagreeing_cudnn_is_never_a_candidate(cudnn_stand_in):
    cudnn_stand_in(_ref_fwd, _wrong_bwd)
    with pytest.warns(UserWarning, match="backward disagrees"):
        choices = _run()
    assert any(k.startswith("bwd_backend/") and v == "triton" for k, v in choices.items()), choices


def test_raising_cudnn_leaves_triton(cudnn_stand_in):
    cudnn_stand_in(_raise, _raise)
    with pytest.warns(UserWarning, match="unavailable here"):
        choices = _run()
    assert all(v != {"BACKEND": "cudnn"} and v != "cudnn" for v in choices.values()), choices


def test_agree_tolerances():
    a = torch.randn(64, dtype=torch.bfloat16)
    lse = torch.randn(8)
    assert cudnn_attention.agree("x", (a, lse), (a.clone(), lse + 1e-6))
    with pytest.warns(UserWarning, match="disagrees"):
        assert not cudnn_attention.agree("x", (a, lse), (a, lse + 0.1))
    with pytest.warns(UserWarning, match="disagrees"):
        assert not cudnn_attention.agree("x", (a, lse), (a * 1.1, lse))


@pytest.mark.gpu
def test_gpu_llama_shape_with_cudnn_candidate():
    # the real cuDNN kernels compete at an 8B shape; whichever wins, results match the reference
    B, H, H_KV, T, D = 1, 32, 8, 2048, 128
    q, k, v = (torch.randn(B, h, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (H, H_KV, H_KV))
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    out = flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = flash_attention_ref(q32, k32, v32, True)
    want = torch.autograd.grad(ref, (q32, k32, v32), do.float())
    for got, exp in zip((out, *grads), (ref, *want), strict=True):
        err = ((got.float() - exp).norm() / exp.norm()).item()
        assert err < 2e-2 and math.isfinite(err)
    print(fa.tuning_choices())
