"""A user's own decoder, importable as tests.mtc.custom_models:build (for the API and CLI tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


class Block(nn.Module):
    """Pre-norm block: causal self-attention (one head) and a GELU MLP with biases."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has a zero gradient (softmax shift): pure rounding noise under Adam
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)  # (B, T, d) each
        att = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=True).squeeze(1)
        x = x + self.proj(att)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """Embedding, learned positions, blocks in an nn.ModuleList, final norm, untied head."""

    def __init__(self, d: int = 16, n_layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class PoisonedLM(TinyLM):
    """TinyLM whose logits are NaN wherever the input is ``POISON``: a batch holding it makes its
    step's loss non-finite, so the step is skipped (the tests place it)."""

    POISON = VOCAB - 1

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = super().forward(ids)
        return torch.where((ids == self.POISON)[..., None], torch.full_like(logits, float("nan")), logits)


def build() -> TinyLM:
    """The factory `mtc compile --model tests.mtc.custom_models:build` imports."""
    return TinyLM()


class GradPoisonedLM(PoisonedLM):
    """PoisonedLM that also has an infinite gradient, with a finite loss, wherever the input is
    ``GRAD_POISON``: a 0-dim ``gate`` (zero, and kept so: its gradient is zero elsewhere) scales a
    term that adds nothing to the logits but 1e40 times their gradient to the gate's."""

    GRAD_POISON = VOCAB - 2

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = super().forward(ids)
        ramp = torch.arange(VOCAB, dtype=logits.dtype, device=logits.device)  # (a plain sum of CE's gradient is 0)
        hit = (ids == self.GRAD_POISON)[..., None].to(logits.dtype)
        return logits + hit * ramp * (self.gate * 1e30) * 1e10  # two factors: 1e40 is inf in fp32


def poisoned() -> GradPoisonedLM:
    """A factory of GradPoisonedLM, for runs of it from a plan directory (the data-parallel skip test)."""
    return GradPoisonedLM()


def broken() -> TinyLM:
    """A factory that fails, for the error test."""
    raise RuntimeError("weights file missing")


NOT_CALLABLE = 3
