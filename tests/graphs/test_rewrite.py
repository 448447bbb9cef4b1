"""graphs/rewrite.py: which linear + cross-entropy chains become the fused kernel, and which stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtc.graphs.rewrite import use_linear_cross_entropy


class Head(nn.Module):
    """linear -> logits -> cross-entropy, with the variations the rewrite must tell apart."""

    def __init__(self, upcast=True, bias=False, **ce) -> None:
        super().__init__()
        self.upcast, self.bias, self.ce = upcast, bias, ce

    def forward(self, x, w, b, t):
        logits = F.linear(x, w, b if self.bias else None)
        if self.upcast:
            logits = logits.float()
        return F.cross_entropy(logits.reshape(-1, w.shape[0]), t.reshape(-1), **self.ce)


def _graph(head, dtype=torch.float32):
    x = torch.randn(2, 5, 8, dtype=dtype)
    w = torch.randn(11, 8, dtype=dtype)
    b = torch.randn(11, dtype=dtype)
    t = torch.randint(0, 11, (2, 5))
    t[0, 1] = -100
    gm = torch.export.export(head, (x, w, b, t)).module()
    return gm, (x, w, b, t)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_when_the_loss_is_a_plain_mean(bias):
    head = Head(bias=bias)
    gm, args = _graph(head)
    want = head(*args)
    assert use_linear_cross_entropy(gm) == 1
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("cross_entropy_loss" in s or "linear.default" in s for s in targets), targets
    torch.testing.assert_close(gm(*args), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [{"label_smoothing": 0.1}, {"reduction": "sum"}, {"weight": torch.ones(11)}],
    ids=["smoothing", "sum", "weight"],
)
def test_other_losses_stay_unfused(kwargs):
    gm, args = _graph(Head(**kwargs))
    assert use_linear_cross_entropy(gm) == 0


def test_half_logits_without_upcast_stay_unfused():
    """The fused loss computes in fp32; a model whose loss runs in half precision keeps its own."""
    gm, _ = _graph(Head(upcast=False), dtype=torch.float16)
    assert use_linear_cross_entropy(gm) == 0


def test_logits_used_elsewhere_stay_unfused():
    class TwoUses(Head):
        def forward(self, x, w, b, t):
            logits = F.linear(x, w)
            return F.cross_entropy(logits.float().reshape(-1, 11), t.reshape(-1)) + logits.mean()

    gm, args = _graph(TwoUses())
    assert use_linear_cross_entropy(gm) == 0
