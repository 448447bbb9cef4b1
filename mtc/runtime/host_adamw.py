"""Placeholder until the threaded host AdamW lands: the kernels' reference math, chunked."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["adamw_flat_"]


def adamw_flat_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int, decay_numel: int,
                grad_scale: torch.Tensor | float | None = None, compute_out: torch.Tensor | None = None,
                pool: ThreadPoolExecutor | None = None, chunk_numel: int = 1 << 20) -> None:
    """torch.optim.AdamW's single-tensor math over flat fp32 state, in place."""
    if grad_scale is not None:
        grad.mul_(grad_scale)
    param[:decay_numel].mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if compute_out is not None:
        compute_out.copy_(param)
