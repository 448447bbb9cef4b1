"""torch.optim.AdamW's update in plain torch: the reference of `mtc.kernels.adamw`'s Triton kernel,
and the math the host optimizer runs (`mtc.runtime.host_adamw`).

It sits apart from the kernel's module, which imports triton, so that a run whose host optimizer
is all it uses of kernels/ (a resumed CPU run, an unfused one) does not import triton: ~80 MiB
of RSS (15 MiB anonymous, the rest its shared library's pages) on the CPU.
"""

from __future__ import annotations

import torch

__all__ = ["adamw_step_ref"]


def adamw_step_ref(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int, decay_numel: int,
    grad_scale: torch.Tensor | float | None = 1.0,
    denom: torch.Tensor | None = None,
    compute_copy: torch.Tensor | None = None,
) -> None:
    """torch.optim.AdamW's single-tensor update (``foreach=False, fused=False``), op for op, in place.

    This is mtc's one statement of the AdamW math: the host optimizer calls it per chunk on slices
    of a layer's flat state, so its fp32 results match PyTorch bit for bit. An fp32 ``grad`` is
    scaled in place by ``grad_scale`` (a 0-dim tensor or a float), as ``clip_grad_norm_`` scales
    ``.grad``; any other grad dtype is first copied to fp32. ``denom``, if given, is fp32 scratch of
    at least ``param.numel()`` elements, so the update allocates nothing; ``compute_copy`` receives
    ``param.to(compute_copy.dtype)`` after the update.
    """
    n = param.numel()
    if grad.dtype != torch.float32:
        grad = grad.float()  # a copy: the caller's low-precision gradient is left as it is
    if isinstance(grad_scale, torch.Tensor) or (grad_scale is not None and grad_scale != 1.0):
        grad.mul_(grad_scale)  # x * 1.0 == x bit for bit, so a float 1.0 is skipped, not approximated
    if weight_decay != 0 and decay_numel > 0:  # torch skips the multiply when weight_decay == 0
        param[:decay_numel].mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if denom is None:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    else:  # the same three kernels as the line above, written into the caller's scratch
        denom = torch.sqrt(exp_avg_sq, out=denom[:n]).div_(bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if compute_copy is not None:
        compute_copy.copy_(param)  # the same rounding as param.to(compute_copy.dtype)
