"""bf16 compute: fp32 master state stays authoritative, the streamed copy is its bf16 rounding."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from mtc.store import state_array_name

from mtc.config import TrainConfig
from mtc.data import write_token_file
from mtc.runtime.trainer import train


def test_bf16_compute_copy_tracks_master():
    tokens = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)
    cfg = TrainConfig(steps=3, micro_batch_size=2, seq_len=16, compute_dtype="bfloat16", model_overrides={"n_layers": 2})
    tf = write_token_file(Path(tempfile.mkdtemp()) / "t.bin", tokens, vocab_size=256, tokenizer="byte")
    res = train(cfg, None, tf)
    try:
        assert all(np.isfinite(res.losses))
        g = res.generation
        for layer in range(res.program.n_layers):
            master = res.store.read(state_array_name(layer, "master", g))
            compute = res.store.read(state_array_name(layer, "compute", g))
            assert master.dtype == torch.float32 and compute.dtype == torch.bfloat16
            assert torch.equal(compute, master.to(torch.bfloat16))
            before = res.store.read(state_array_name(layer, "master", 1 - g))
            assert not torch.equal(master, before), "the step must have updated the master weights"
    finally:
        res.store.close()
