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


def _ref_fwd(q, k, v, causal, scale, *, grouped=False):
    rep = q.shape[1] // k.shape[1]
    s = (q.float() @ k.float().repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return flash_attention_ref(q, k, v, causal, scale), torch.logsumexp(s, -1)


def _ref_bwd(do, q, k, v, o, lse, causal, scale, *, grouped=False):
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
    return ((ds @ kf) * scale, ((ds.transpose(-1, -2) @ q.float()) * scale).unflatten(1, (k.shape[1], rep)).sum(2),
            (p.transpose(-1, -2) @ g).unflatten(1, (k.shape[1], rep)).sum(2))


def _wrong_bwd(do, q, k, v, o, lse, causal, scale, *, grouped=False):
    dq, dk, dv = _ref_bwd(do, q, k, v, o, lse, causal, scale)
    return dq, dk * 2.0, dv


def _wrong_when_grouped(fn):
    """A cuDNN whose grouped way computes something else (say it mapped query heads to KV heads
    differently) while its expanded way is right."""
    def f(*a, grouped=False):
        out = fn(*a)
        return (out[0] * 1.5, *out[1:]) if grouped else out
    return f


def _raise(*args, grouped=False):
    raise RuntimeError("cuDNN: no engine for this graph")


@pytest.fixture
def cudnn_stand_in(monkeypatch):
    """Make cuDNN a candidate everywhere; its launches are 'faster' (the fake clock says 1 vs 2, and
    0.5 for its grouped way). The stand-ins return their own tensors, as cuDNN does."""
    if DEVICE == "cuda":
        pytest.skip("the real cuDNN is tested on the GPU")
    last: list[float] = []
    returned: list[tuple] = []

    def bench(fn):
        last.clear()
        fn()
        return min(last) if last else 2.0

    def mark(f):
        def g(*a, grouped=False):
            last.append(0.5 if grouped else 1.0)
            out = f(*a, grouped=grouped)
            returned.append(out)
            return out
        return g

    monkeypatch.setattr(fa, "_cudnn_candidate", lambda q: True)
    monkeypatch.setattr(fa, "_TUNER", Tuner("flash_attention", bench=bench))

    def install(fwd, bwd):
        monkeypatch.setattr(cudnn_attention, "forward", mark(fwd))
        monkeypatch.setattr(cudnn_attention, "backward", mark(bwd))
        return returned
    return install


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
    choices = _run(H=2, H_KV=2)  # no grouping: one cuDNN way
    assert any(k.startswith("fwd/") and v == {"BACKEND": "cudnn"} for k, v in choices.items()), choices
    assert any(k.startswith("bwd_backend/") and v == "cudnn" for k, v in choices.items()), choices


def test_grouped_kv_heads_go_to_cudnn_as_they_are_when_faster(cudnn_stand_in):
    cudnn_stand_in(_ref_fwd, _ref_bwd)
    choices = _run(H=4, H_KV=2)
    assert any(k.startswith("fwd/") and v == {"BACKEND": "cudnn", "GQA": True} for k, v in choices.items()), choices
    assert any(k.startswith("bwd_backend/") and v == "cudnn_gqa" for k, v in choices.items()), choices


def test_a_disagreeing_grouped_way_never_competes(cudnn_stand_in):
    cudnn_stand_in(_wrong_when_grouped(_ref_fwd), _wrong_when_grouped(_ref_bwd))
    with pytest.warns(UserWarning, match=r"grouped KV heads\) disagrees"):
        choices = _run(H=4, H_KV=2)
    # the expanded way agrees and is faster than Triton: it is taken
    assert any(k.startswith("fwd/") and v == {"BACKEND": "cudnn"} for k, v in choices.items()), choices
    assert any(k.startswith("bwd_backend/") and v == "cudnn" for k, v in choices.items()), choices


def test_cudnn_outputs_are_returned_not_copied(cudnn_stand_in):
    returned = cudnn_stand_in(_ref_fwd, _ref_bwd)
    _run(H=4, H_KV=2)  # tunes
    returned.clear()
    q, k, v = (torch.randn(1, h, 24, 16, requires_grad=True) for h in (4, 2, 2))
    out = flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    (o, _), (dq, dk, dv) = returned
    assert out.data_ptr() == o.data_ptr()
    assert [g.data_ptr() for g in grads] == [t.data_ptr() for t in (dq, dk, dv)]


def test_cudnn_candidates_are_timed_as_they_run_without_copies(cudnn_stand_in, monkeypatch):
    # a call that chose cuDNN returns its buffers as they are: timing it with a copy into mtc's own
    # buffers (o, lse; dq, dk, dv) charged it for work its calls never do
    returned = cudnn_stand_in(_ref_fwd, _ref_bwd)
    timing = [False]
    copied: list[int] = []
    real_copy = torch.Tensor.copy_

    def spy(self, src, *a, **kw):
        if timing[0] and any(src is t for out in returned for t in out):
            copied.append(1)
        return real_copy(self, src, *a, **kw)

    bench = fa._TUNER.bench

    def timed(fn):
        timing[0] = True
        try:
            return bench(fn)
        finally:
            timing[0] = False

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    monkeypatch.setattr(fa._TUNER, "bench", timed)
    choices = _run(H=4, H_KV=2)
    assert any(k.startswith("bwd_backend/") and v == "cudnn_gqa" for k, v in choices.items()), choices
    assert returned and not copied


def test_disagreeing_cudnn_is_never_a_candidate(cudnn_stand_in):
    cudnn_stand_in(_ref_fwd, _wrong_bwd)
    with pytest.warns(UserWarning, match="backward disagrees"):
        choices = _run()
    assert any(k.startswith("bwd_backend/") and v == "triton" for k, v in choices.items()), choices


def test_raising_cudnn_leaves_triton(cudnn_stand_in):
    cudnn_stand_in(_raise, _raise)
    with pytest.warns(UserWarning, match="unavailable here"):
        choices = _run()
    assert all(not (isinstance(v, dict) and v.get("BACKEND")) and v not in ("cudnn", "cudnn_gqa")
               for v in choices.values()), choices


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


@pytest.mark.gpu
def test_gpu_cudnn_takes_grouped_kv_heads_as_they_are():
    """Both cuDNN ways at a Llama-8B shape (32 query heads, 8 KV heads) compute the same attention
    and gradients; the grouped one's outputs are cuDNN's own buffers in the promised layouts."""
    B, H, H_KV, T, D = 1, 32, 8, 1024, 128
    q, k, v = (torch.randn(B, h, T, D, device="cuda", dtype=torch.bfloat16) for h in (H, H_KV, H_KV))
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    scale = D ** -0.5
    o, lse = cudnn_attention.forward(q, k, v, True, scale)
    try:
        og, lseg = cudnn_attention.forward(q, k, v, True, scale, grouped=True)
        grads_g = cudnn_attention.backward(do, q, k, v, og, lseg, True, scale, grouped=True)
    except RuntimeError as e:  # this torch's cuDNN path refuses grouped heads: mtc keeps the expanded way
        pytest.skip(f"cuDNN attention does not take grouped KV heads here: {e}")
    grads = cudnn_attention.backward(do, q, k, v, o, lse, True, scale)
    assert og.is_contiguous() and lseg.shape == (B, H, T) and lseg.is_contiguous()
    for a, b in zip((og, lseg, *grads_g), (o, lse, *grads), strict=True):
        assert a.shape == b.shape and a.stride() == b.stride()
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
def test_gpu_cudnn_on_heads_viewed_from_the_projection_layout(grouped, monkeypatch):
    """q, k, v and dO as compiled graphs hand them over ("attention layouts" pass): (B, H, T, D)
    views of (B, T, H, D) buffers. cuDNN's output comes back laid out like q and is kept as it is,
    dO in that layout goes in as it is (no copy either way), and the results match the reference."""
    B, H, H_KV, T, D = 2, 32, 8, 512, 128

    def heads(h: int) -> torch.Tensor:
        return torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    q, k, v, do = heads(H), heads(H_KV), heads(H_KV), heads(H)
    copied: list[bool] = []
    real = cudnn_attention._as_allocated

    def watched(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        out = real(t, like)
        copied.append(out is not t)
        return out

    monkeypatch.setattr(cudnn_attention, "_as_allocated", watched)
    scale = D ** -0.5
    try:
        o, lse = cudnn_attention.forward(q, k, v, True, scale, grouped=grouped)
        dq, dk, dv = cudnn_attention.backward(do, q, k, v, o, lse, True, scale, grouped=grouped)
    except RuntimeError as e:  # the grouped way may be refused by this torch (mtc then keeps the expanded way)
        if not grouped:
            raise
        pytest.skip(f"cuDNN attention does not take grouped KV heads here: {e}")
    assert o.stride() == q.stride() and (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())
    # (o, dO, dq, dk, dv): cuDNN's own buffers, in the layouts promised; the expanded way's dk and dv
    # are sums over each KV head's query group, written straight in k's and v's layouts
    # (kernels/kv_groups.py): nothing is copied either way
    assert not any(copied), copied
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = flash_attention_ref(q32, k32, v32, True, scale)
    want = torch.autograd.grad(ref, (q32, k32, v32), do.float())
    for got, exp in zip((o, dq, dk, dv), (ref, *want), strict=True):
        err = ((got.float() - exp).norm() / exp.norm()).item()
        assert err < 2e-2 and math.isfinite(err), err
