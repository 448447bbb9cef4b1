"""The fused matmul (norm prologue, bias / activation / residual epilogue) against its torch
reference, fp32 in the interpreter: odd shapes, transposed operands, every prologue and epilogue."""

from __future__ import annotations

import pytest
import torch
from mtc.kernels.fused_matmul import fused_mm, fused_mm_pre, fused_mm_pre_ref, fused_mm_ref

from mtc.errors import KernelInputError

TOL = {torch.float32: (1e-5, 1e-5)}  # (rtol, atol): fp32 tl.dot in the interpreter is exact fp32


def _norm_args(x: torch.Tensor, kind: str) -> dict:
    K = x.shape[1]
    if kind == "none":
        return {}
    if kind == "rms":
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return {"rstd": rstd, "norm_w": torch.randn(K)}
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + 1e-5)
    return {"mean": mean, "rstd": rstd, "norm_w": torch.randn(K), "norm_b": torch.randn(K)}


@pytest.mark.parametrize("M,K,N", [(5, 7, 3), (37, 45, 33), (64, 32, 96)])
@pytest.mark.parametrize("norm,act,bias,res", [
    ("none", "none", False, False), ("none", "gelu", True, False), ("none", "gelu_tanh", True, True),
    ("none", "silu", False, True), ("none", "relu", True, False), ("rms", "none", False, False),
    ("layer", "gelu_tanh", True, False), ("layer", "none", True, True),
])
def test_fused_mm_matches_reference(M, K, N, norm, act, bias, res):
    a, b = torch.randn(M, K), torch.randn(K, N) / K**0.5
    kw = _norm_args(a, norm)
    kw["bias"] = torch.randn(N) if bias else None
    kw["residual"] = torch.randn(M, N) if res else None
    got = fused_mm(a, b, act=act, **kw)
    want = fused_mm_ref(a, b, act=act, **kw)
    torch.testing.assert_close(got, want, rtol=TOL[torch.float32][0], atol=TOL[torch.float32][1])


def test_transposed_operands_and_strided_stats():
    # b as a weight's transpose (what linear lowers to), a as a view of (B, T, K), stats (B, T, 1)
    x, w = torch.randn(2, 9, 40), torch.randn(24, 40)
    a, b = x.view(18, 40), w.t()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    nw = torch.randn(40)
    got = fused_mm(a, b, rstd=rstd, norm_w=nw, round_norm=True, residual=torch.zeros(18, 24).t().contiguous().t())
    want = fused_mm_ref(a, b, rstd=rstd, norm_w=nw, round_norm=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_prologue_on_b_for_the_weight_gradient(norm):
    # dW = dy^T @ norm(x): the normalised operand is b, (tokens, features), read through a view
    x, dy = torch.randn(37, 24), torch.randn(37, 19)
    kw = _norm_args(x, norm)
    got = fused_mm(dy.t(), x, norm_on_b=True, round_norm=norm == "rms", **kw)
    want = fused_mm_ref(dy.t(), x, norm_on_b=True, round_norm=norm == "rms", **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(KernelInputError, match="rstd has shape"):
        fused_mm(dy.t(), x, rstd=torch.ones(19), norm_on_b=True)


def test_op_is_registered_and_checks_inputs():
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    out = torch.ops.mtc.fused_mm(a, b, None, None, None, None, None, None, "relu", False, False)
    torch.testing.assert_close(out, torch.relu(a @ b), rtol=1e-5, atol=1e-5)
    with pytest.raises(KernelInputError, match="act must be"):
        fused_mm(a, b, act="tanh")
    with pytest.raises(KernelInputError, match="expected a"):
        fused_mm(a, torch.randn(5, 5))
    with pytest.raises(KernelInputError, match="residual has shape"):
        fused_mm(a, b, residual=torch.randn(5, 4))
    with pytest.raises(KernelInputError, match="needs rstd"):
        fused_mm(a, b, norm_w=torch.randn(6))


@pytest.mark.parametrize("M,K,N", [(5, 7, 3), (37, 45, 33)])
@pytest.mark.parametrize("norm,act,bias,res", [
    ("none", "gelu", True, False), ("none", "gelu_tanh", False, True), ("none", "silu", False, False),
    ("none", "relu", True, True), ("none", "none", True, True), ("rms", "silu", False, False),
    ("layer", "gelu_tanh", True, False),
])
def test_fused_mm_pre_writes_the_product_and_the_activation(M, K, N, norm, act, bias, res):
    a, b = torch.randn(M, K), torch.randn(K, N) / K**0.5
    kw = _norm_args(a, norm)
    kw["bias"] = torch.randn(N) if bias else None
    kw["residual"] = torch.randn(M, N) if res else None
    pre, post = fused_mm_pre(a, b, act=act, round_norm=norm == "rms", **kw)
    want_pre, want_post = fused_mm_pre_ref(a, b, act=act, round_norm=norm == "rms", **kw)
    torch.testing.assert_close(pre, want_pre, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post, want_post, rtol=1e-5, atol=1e-5)
    # post is what fused_mm computes: the second output changes nothing about the first
    torch.testing.assert_close(post, fused_mm(a, b, act=act, round_norm=norm == "rms", **kw), rtol=0, atol=0)


def test_fused_mm_pre_op_on_b_prologue_and_checks():
    # the weight-gradient layout (b normalised, a transposed), through the registered op
    x, dy = torch.randn(37, 24), torch.randn(37, 19)
    kw = _norm_args(x, "layer")
    pre, post = torch.ops.mtc.fused_mm_pre(dy.t(), x, None, None, kw["mean"], kw["rstd"], kw["norm_w"], kw["norm_b"],
                                           "gelu", False, True)
    want = fused_mm_pre_ref(dy.t(), x, act="gelu", norm_on_b=True, **kw)
    torch.testing.assert_close(pre, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post, want[1], rtol=1e-5, atol=1e-5)
    with torch.device("meta"):  # the fake registration: shapes and dtype without running
        fp, fq = torch.ops.mtc.fused_mm_pre(torch.empty(3, 4), torch.empty(4, 6, dtype=torch.bfloat16),
                                            None, None, None, None, None, None, "silu", False, False)
    assert fp.shape == fq.shape == (3, 6) and fp.dtype == fq.dtype == torch.bfloat16
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    with pytest.raises(KernelInputError, match="call fused_mm instead"):
        fused_mm_pre(a, b, act="none")
    with pytest.raises(KernelInputError, match="act must be"):
        fused_mm_pre(a, b, act="tanh")
    with pytest.raises(KernelInputError, match="bias has shape"):
        fused_mm_pre(a, b, bias=torch.randn(6))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm,act,res,on_b", [("rms", "none", False, False), ("layer", "gelu_tanh", False, False),
                                               ("none", "silu", True, False), ("rms", "none", False, True)])
def test_half_precision_on_gpu(dtype, norm, act, res, on_b):
    # Llama-ish shapes, ragged at the edges; bf16 is only right on the GPU (the interpreter's bf16 is not)
    M, K, N = 1000, 1024, 1500
    x = torch.randn(K if on_b else M, N if on_b else K, device="cuda")
    kw = {k: v.cuda().to(dtype) if k.startswith("norm") else v.cuda() for k, v in _norm_args(x, norm).items()}
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype) / K**0.5
    if norm != "none":
        if on_b:
            b = x.to(dtype)
        else:
            a = x.to(dtype)
    kw["residual"] = torch.randn(M, N, device="cuda", dtype=dtype) if res else None
    got = fused_mm(a, b, act=act, norm_on_b=on_b, round_norm=norm == "rms", **kw).float()
    want = fused_mm_ref(a, b, act=act, norm_on_b=on_b, round_norm=norm == "rms", **kw).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norm,act,bias,res", [("none", "gelu_tanh", True, False), ("rms", "silu", False, False),
                                               ("layer", "gelu", True, True)])
def test_fused_mm_pre_half_precision_on_gpu(dtype, norm, act, bias, res):
    # GPT-2 / Llama MLP-like shapes, ragged edges: pre and post against the separate ops in each dtype
    M, K, N = 1000, 768, 3000
    x = torch.randn(M, K, device="cuda")
    kw = {k: v.cuda().to(dtype) if k.startswith("norm") else v.cuda() for k, v in _norm_args(x, norm).items()}
    a, b = x.to(dtype), (torch.randn(K, N, device="cuda") / K**0.5).to(dtype)
    kw["bias"] = torch.randn(N, device="cuda", dtype=dtype) if bias else None
    kw["residual"] = torch.randn(M, N, device="cuda", dtype=dtype) if res else None
    got = fused_mm_pre(a, b, act=act, round_norm=norm == "rms", **kw)
    want = fused_mm_pre_ref(a, b, act=act, round_norm=norm == "rms", **kw)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        assert ((g.float() - w.float()).norm() / w.float().norm()).item() < 1e-2
