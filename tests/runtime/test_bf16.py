"""bf16 compute: fp32 master state stays authoritative, the streamed copy is its bf16 rounding."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mtc.config import TrainConfig
from mtc.data import write_token_file
from mtc.runtime.state import read_params
from mtc.train import train


@pytest.mark.parametrize("placement", ["ram", "disk", "gpu:0-1,ram:2,disk:3"])
def test_bf16_compute_copy_tracks_master(placement):
    tokens = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)
    cfg = TrainConfig(steps=3, micro_batch_size=2, seq_len=16, compute_dtype="bfloat16", placement=placement,
                      model_overrides={"n_layers": 2})
    tf = write_token_file(Path(tempfile.mkdtemp()) / "t.bin", tokens, vocab_size=256, tokenizer="byte")
    res = train(cfg, None, tf)
    try:
        assert all(np.isfinite(res.losses))
        committed = read_params(res.program, res.store, res.generation)
        before = read_params(res.program, res.store, 1 - res.generation)
        for layer, s in enumerate(res.tiers.layers):
            assert s.compute.dtype == torch.bfloat16
            keys = [p.key for p in res.program.layer_params(layer)]
            flat = torch.cat([committed[k].reshape(-1) for k in keys])
            assert torch.equal(s.compute, flat.to(torch.bfloat16)), f"layer {layer}: compute copy is not the master's rounding"
            if s.master is not None:
                assert torch.equal(s.master, flat)
            assert not all(torch.equal(committed[k], before[k]) for k in keys), "the step must have updated the weights"
    finally:
        res.store.close()


def test_a_new_bf16_runs_master_state_starts_from_the_fp32_initialisation():
    # the model is traced in bf16, but the fp32 master is the initialisation itself, not its rounding
    from mtc.train import build_model, open_run

    cfg = TrainConfig(model="tiny", model_overrides={"n_layers": 1}, compute_dtype="bfloat16", seq_len=16, micro_batch_size=2)
    run = open_run(cfg, None)
    try:
        assert run.program.meta["param_dtype"] == "bfloat16"
        want = dict(build_model(cfg, dtype="float32").named_parameters())
        assert run.params.keys() == want.keys()
        assert all(v.dtype == torch.float32 and torch.equal(v, want[k]) for k, v in run.params.items())
        assert any(not torch.equal(v, v.bfloat16().float()) for v in run.params.values())  # not rounded to bf16
    finally:
        run.store.close()
