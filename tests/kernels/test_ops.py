"""mtc::attention and its backward agree with torch's SDPA and autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mtc.graphs.ops import attention


@pytest.mark.parametrize("shape,kv_heads,causal", [((1, 2, 7, 8), 2, True), ((2, 4, 9, 16), 2, True), ((2, 4, 5, 8), 1, False)])
def test_attention_matches_sdpa(shape, kv_heads, causal):
    B, H, T, D = shape
    q = torch.randn(B, H, T, D, requires_grad=True)
    k = torch.randn(B, kv_heads, T, D, requires_grad=True)
    v = torch.randn(B, kv_heads, T, D, requires_grad=True)
    scale = 0.3
    out = attention(q, k, v, causal, scale)
    rep = H // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal, scale=scale)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("causal", [True, False])
def test_attention_with_a_value_head_dim_of_its_own(causal):
    # values narrower than queries and keys (SDPA allows it): the backward took torch's fused CPU
    # kernel, which needs one head dim for q, k and v, and a compiled block with such attention
    # failed inside that kernel ("Q/K/V should have the same head size")
    q, k = torch.randn(2, 2, 7, 6, requires_grad=True), torch.randn(2, 2, 7, 6, requires_grad=True)
    v = torch.randn(2, 2, 7, 5, requires_grad=True)
    out = attention(q, k, v, causal, 0.4)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.4)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

@pytest.mark.gpu
def test_attention_backward_bf16_cuda_long_context():
    B, H, KV, T, D = 1, 32, 8, 4096, 128
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = attention(q, k, v, True, D**-0.5)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf.repeat_interleave(4, 1), vf.repeat_interleave(4, 1), is_causal=True)
    want = torch.autograd.grad(ref, (qf, kf, vf), g.float())
    for a, b in zip(got, want, strict=True):
        assert ((a.float() - b).norm() / b.norm()).item() < 2e-2
