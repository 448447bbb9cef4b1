"""mtc's own graph-level ops, registered with torch.library so tracing keeps them whole.

``mtc::attention`` stands for causal / non-causal scaled dot-product attention in layer
templates. The tracer substitutes it for ``aten.scaled_dot_product_attention`` so that lowering a
template to core ATen (make_fx, meta tensors) keeps attention as one anchor node, forward and
backward, instead of decomposing it into a T x T softmax. The implementations here call torch's
SDPA (bit-identical to eager); compiled plans swap in the Triton flash-attention kernels
(kernels/swaps.py). The ops are registered without ``device_types`` so CPU tests can run them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten

__all__ = ["attention", "attention_backward"]


@torch.library.custom_op("mtc::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v for (B, H, T, D) tensors (k, v may have fewer heads)."""
    gqa = k.shape[1] != q.shape[1]
    # contiguous, as the fake says: CUDA's SDPA backends return a (B, T, H, D)-strided view, and
    # compiled graphs traced against the fake apply views that need the fake's layout
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa).contiguous()


def _layout_of(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``x`` with ``torch.empty_like(ref)``'s strides (the fake's), copying only if they differ."""
    if x.stride() == ref.stride() or x.numel() <= 1:
        return x
    return torch.empty_like(ref).copy_(x)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("mtc::attention_backward", mutates_args=())
def attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `attention` for q, k, v, recomputing the probabilities (as flash attention does).

    Reference math in fp32 with the full (T, T) matrix: right on every device, memory-heavy at
    long context; the compiled plan replaces it with the flash-attention kernel on CUDA.
    """
    rep = q.shape[1] // k.shape[1]
    fused = v.shape[-1] == q.shape[-1]  # torch's fused kernels need one head dim for q, k and v
    if q.device.type == "cpu" and rep == 1 and fused:
        # the same fused CPU kernels eager SDPA uses, so the unfused and compiled paths agree bitwise
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, is_causal, scale=scale
        )
    elif q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and fused:
        dq, dk, dv = _flash_backward_cuda(grad, q, k, v, is_causal, scale, rep)
    else:
        dq, dk, dv = _math_backward(grad, q, k, v, is_causal, scale, rep)
    # the fake's layouts (empty_like of each input): graphs traced against it view them so
    return _layout_of(dq, q), _layout_of(dk, k), _layout_of(dv, v)


def _math_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float, rep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 reference backward with the full (T, S) probability matrix, any device and dtype."""
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    qf, g = q.float(), grad.float()
    s = (qf @ kf.transpose(-1, -2)) * scale  # (B, H, T, S)
    if is_causal:
        T, S = s.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=s.device).tril(diagonal=S - T)
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    dv = p.transpose(-1, -2) @ g
    dp = g @ vf.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf) * scale
    if rep > 1:  # each KV head's gradient sums over its group of query heads
        B, H, S, D = dk.shape
        dk = dk.view(B, H // rep, rep, S, D).sum(2)
        dv = dv.view(B, H // rep, rep, S, dv.shape[-1]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flash_backward_cuda(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float, rep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA, half precision: torch's flash-attention forward (for out and logsumexp) and backward,
    so memory stays O(T) at long context. Grouped KV heads are expanded, then summed back."""
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out, lse, cq, ck, mq, mk, rng, unused, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cq, ck, mq, mk, 0.0, is_causal, rng, unused, scale=scale
    )
    if rep > 1:
        B, H, S, D = dk.shape
        dk = dk.view(B, H // rep, rep, S, D).sum(2)
        dv = dv.view(B, H // rep, rep, S, dv.shape[-1]).sum(2)
    return dq, dk, dv


@attention_backward.register_fake
def _(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad, q, k, v, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


attention.register_autograd(_backward, setup_context=_setup)
