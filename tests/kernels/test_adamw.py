"""The fused AdamW kernel against torch.optim.AdamW and its pure-torch reference."""

from __future__ import annotations

import pytest
import torch
from mtc.kernels.adamw import adamw_step_, adamw_step_ref

from mtc.errors import KernelInputError

HP = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("n,decay", [(1, 1), (300, 120), (1037, 0)])
def test_matches_reference_over_steps(n, decay):
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    for step in (1, 2, 3):
        g = torch.randn(n)
        adamw_step_(p, g, m, v, step=step, decay_numel=decay, grad_scale=0.7, **HP)
        adamw_step_ref(p2, g, m2, v2, step=step, decay_numel=decay, grad_scale=0.7, **HP)
    torch.testing.assert_close(p, p2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, m2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, v2, rtol=1e-6, atol=1e-9)


def test_matches_torch_adamw_and_writes_compute_copy():
    w = torch.nn.Parameter(torch.randn(77))
    opt = torch.optim.AdamW([w], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    p, m, v = w.detach().clone(), torch.zeros(77), torch.zeros(77)
    copy = torch.empty(77, dtype=torch.float16)
    for step in (1, 2):
        g = torch.randn(77)
        w.grad = g.clone()
        opt.step()
        adamw_step_(p, g, m, v, step=step, decay_numel=77, compute_copy=copy, **HP)
    torch.testing.assert_close(p, w.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(copy, p.half())


def test_launcher_errors():
    with pytest.raises(KernelInputError, match="float32"):
        adamw_step_(torch.zeros(4, dtype=torch.float16), torch.zeros(4), torch.zeros(4), torch.zeros(4), step=1, decay_numel=0, **HP)
    with pytest.raises(KernelInputError, match="1-D"):
        adamw_step_(torch.zeros(4), torch.zeros(5), torch.zeros(4), torch.zeros(4), step=1, decay_numel=0, **HP)
    with pytest.raises(KernelInputError, match="step"):
        adamw_step_(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), step=0, decay_numel=0, **HP)


@pytest.mark.gpu
def test_gpu_large():
    n = 50_000_001
    p, g, m, v = (torch.randn(n, device="cuda") for _ in range(4))
    v = v.abs()
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    copy = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    adamw_step_(p, g, m, v, step=5, decay_numel=n // 2, compute_copy=copy, **HP)
    adamw_step_ref(p2, g, m2, v2, step=5, decay_numel=n // 2, **HP)
    torch.testing.assert_close(p, p2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(copy, p2.bfloat16())
