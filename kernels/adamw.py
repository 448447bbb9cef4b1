"""Fused AdamW over a layer's flat fp32 state, for updating part of the model on the GPU.

One pass reads param, grad, m, v and writes param, m, v (and optionally a bf16 compute copy of
the new param): 16-20 bytes per parameter instead of the several passes of an op-by-op update.
The math is torch.optim.AdamW's (decoupled weight decay on a prefix of the flat state, bias
correction), with the global-norm clip coefficient folded into the gradient read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtc.errors import KernelInputError
from mtc.kernels.adamw_ref import adamw_step_ref  # in a module without triton: the host optimizer's math (see there)

__all__ = ["adamw_step_", "adamw_step_ref"]


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, c_ptr,
    n, decay_n, lr, wd_factor, beta1, beta2, eps, step_size, inv_bc2_sqrt, grad_scale,
    WRITE_COPY: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.where(offs < decay_n, p * wd_factor, p)  # decoupled weight decay on the decayed prefix
    m = m + (g - m) * (1.0 - beta1)  # lerp, as torch's exp_avg.lerp_
    v = v * beta2 + g * g * (1.0 - beta2)
    denom = tl.sqrt(v) * inv_bc2_sqrt + eps
    p = p - step_size * (m / denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if WRITE_COPY:
        tl.store(c_ptr + offs, p.to(c_ptr.dtype.element_ty), mask=mask)


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decay_numel: int,
    grad_scale: float = 1.0,
    compute_copy: torch.Tensor | None = None,
) -> None:
    """Update flat fp32 ``param``, ``exp_avg``, ``exp_avg_sq`` in place (``step`` counts from 1)."""
    ts = [param, grad, exp_avg, exp_avg_sq] + ([compute_copy] if compute_copy is not None else [])
    n = param.numel()
    for name, t in zip(("param", "grad", "exp_avg", "exp_avg_sq", "compute_copy"), ts):
        if t.dim() != 1 or t.numel() != n or not t.is_contiguous():
            raise KernelInputError(f"adamw: {name} must be a contiguous 1-D tensor of {n} elements, got {tuple(t.shape)}")
        if t.device != param.device:
            raise KernelInputError(f"adamw: {name} is on {t.device}, param on {param.device}")
    for name, t in zip(("param", "exp_avg", "exp_avg_sq"), (param, exp_avg, exp_avg_sq)):
        if t.dtype != torch.float32:
            raise KernelInputError(f"adamw: {name} must be float32 (the master state), got {t.dtype}")
    if step < 1 or not 0 <= decay_numel <= n:
        raise KernelInputError(f"adamw: step must be >= 1 and 0 <= decay_numel <= {n}, got {step}, {decay_numel}")
    # Triton's interpreter (CPU) pays ~25 ms per program whatever its size: at most a few programs
    # (a block edge and a masked tail stay tested; 200k elements: 4.9 s with 256-element programs -> 0.14 s)
    block = 1024 if param.is_cuda else min(1 << 16, max(256, triton.next_power_of_2(triton.cdiv(n, 2))))
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, compute_copy if compute_copy is not None else param,
        n, decay_numel, lr, 1.0 - lr * weight_decay, beta1, beta2, eps,
        lr / (1.0 - beta1**step), 1.0 / (1.0 - beta2**step) ** 0.5, grad_scale,
        WRITE_COPY=compute_copy is not None, BLOCK=block,
    )
