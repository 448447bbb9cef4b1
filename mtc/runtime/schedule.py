"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr`` at the last step."""

from __future__ import annotations

import math

from mtc.config import OptimConfig

__all__ = ["lr_at"]


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    Warmup ramps (step + 1) / warmup_steps so the first update is not zero; decay runs over the
    remaining steps and reaches ``min_lr`` on the last one.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - 1 - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * frac))
