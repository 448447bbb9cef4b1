"""Blocks that keep their activations between visits, on CUDA: the flash-attention split (its
output and log-sum-exp saved), the replayed backward from saved values, no host sync, and training
that matches the recomputing schedule."""

from __future__ import annotations

import pytest
import torch

from mtc.runtime.state import read_params
from mtc.train import open_run, train
from tests.runtime.engine_util import hand_built_engine, plan_for, skewed_tokens, small_config, steps_without_host_sync

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "tok.bin")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_saving_blocks_train_as_recomputing_ones(tokens, tmp_path, dtype):
    def cfg(save: str):
        return small_config(steps=4, device="cuda", compute_dtype=dtype, allow_tf32=False, kernels="fused",
                            placement="gpu:0,ram:1-2,disk:3", save_activations=save)

    plan = plan_for(cfg("auto"), tmp_path / "plan")  # one tuning of the kernels for both runs
    a = train(cfg("auto"), None, tokens, run=open_run(cfg("auto"), None, plan=plan))
    b = train(cfg("off"), None, tokens, run=open_run(cfg("off"), None, plan=plan))
    try:
        assert a.saves == [1, 2] and a.saved_bytes > 0 and b.saves == []  # auto: a small model's blocks all fit
        # the backward graph's kernels group the work otherwise than the joint graph's: not bit for bit
        tol = 1e-5 if dtype == "float32" else 2e-2
        torch.testing.assert_close(torch.tensor(a.losses), torch.tensor(b.losses), rtol=tol, atol=0)
        wa, wb = read_params(a.program, a.store, a.generation), read_params(b.program, b.store, b.generation)
        for k in wa:
            rel = ((wa[k] - wb[k]).norm() / wb[k].norm()).item()
            assert rel < (1e-5 if dtype == "float32" else 1e-2), f"{k}: {rel:.2e}"
        assert any("backward:" in line for line in a.graph_report), a.graph_report
    finally:
        a.store.close()
        b.store.close()


def test_no_host_sync_with_saved_activations_and_the_backward_replays(tokens, tmp_path):
    cfg = small_config(device="cuda", kernels="fused", placement="gpu:0-1,ram:2,disk:3", durability="none")
    hb = hand_built_engine(cfg, tmp_path / "kernels", saves=(1, 2))
    try:
        steps_without_host_sync(hb, cfg, tokens, 4, strict_from=2)  # warm from step 2: the ring's slots alternate
        block = next(r for r in hb.runners.values() if r.template.kind == "block")
        st = block.stats
        # replayed, unless its replay (copies of the saved values in) measured slower than eager
        assert st["backward"].fallback is None, st["backward"].fallback
        assert (st["backward"].captured and st["backward"].replays) or st["backward"].skipped
        assert st["save"].skipped and st["joint"].replays == 0
        # the flash-attention forward's output and log-sum-exp are among the saved values
        ct = hb.compiled[block.template.id]
        assert any(d == torch.float32 and len(s) == 3 for s, d in ct.saved), ct.saved
    finally:
        hb.close()
