"""Learning-rate schedule: linear warmup from 0, then cosine decay towards ``min_lr``.

The convention is transformers' ``get_cosine_with_min_lr_schedule_with_warmup`` (and, with
``min_lr = 0``, ``get_cosine_schedule_with_warmup``) as a ``LambdaLR`` steps it, value for value:
step ``s`` (0-based) of ``steps`` uses ``lr * s / warmup_steps`` during warmup (so step 0 of a run
with warmup updates with lr 0, as under the transformers Trainer), then
``lr * (f * (1 - min_lr / lr) + min_lr / lr)`` with ``f = 0.5 * (1 + cos(pi * p))`` and
``p = (s - warmup_steps) / (steps - warmup_steps)``. The decay reaches ``min_lr`` at ``s = steps``,
one past the last update: the last update uses a little more than ``min_lr``. Users porting a
transformers run get the same learning rate at every step.
"""

from __future__ import annotations

import math

from mtc.config import OptimConfig

__all__ = ["lr_at"]


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of a run of ``total_steps`` steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (float(step) / float(max(1, cfg.warmup_steps)))
    progress = float(step - cfg.warmup_steps) / float(max(1, total_steps - cfg.warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    rate = cfg.min_lr / cfg.lr  # transformers' min_lr_rate; computed the same way for identical values
    return cfg.lr * max(0.0, factor * (1.0 - rate) + rate)
