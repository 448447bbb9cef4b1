"""Shared set-up of the engine tests: token data and a small parity config."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mtc.config import OptimConfig, TrainConfig
from mtc.data import TokenFile, write_token_file


def skewed_tokens(path: Path, n: int = 40_000) -> TokenFile:
    """Text-like bytes (skewed frequencies) so the loss moves within a few steps."""
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(256, 0.1))
    return write_token_file(path, rng.choice(256, size=n, p=probs).astype(np.uint16), vocab_size=256, tokenizer="byte")


def small_config(**kw: object) -> TrainConfig:
    """`tiny` with two blocks (program layers: embed, 2 blocks, head), clipping and grad_accum 2."""
    base = dict(
        model="tiny", model_overrides={"n_layers": 2}, steps=6, micro_batch_size=2, seq_len=16, grad_accum=2, seed=5,
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.1, clip_norm=0.5),
    )
    base.update(kw)
    return TrainConfig(**base)
