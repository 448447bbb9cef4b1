"""Sampling text from a trained model (a plain forward per token; the demo's models are tiny)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["generate"]


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    *,
    max_new_tokens: int,
    context: int,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> list[int]:
    """Continue ``prompt`` by ``max_new_tokens`` sampled tokens; the window is cropped to ``context``."""
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = [int(t) for t in prompt]
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        x = torch.tensor([ids[-context:]], dtype=torch.long, device=device)
        out = model(x)
        logits = getattr(out, "logits", out)[0, -1].float().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        ids.append(nxt)
    model.train(was_training)
    return ids[len(prompt):]
