"""Write-behind keeps each commit's state intact while the disk lags behind training.

A gpu-tier layer's state is copied into pinned host staging buffers at a commit step, and the store
writes them behind, in place, while training goes on. If the disk is slower than a step, the next
commit must not refill the staging buffers before the store has finished reading them, or the
older commit's generation would hold a mix of two steps' state (with valid checksums: the CRC is
taken of the bytes written).
"""

from __future__ import annotations

import time

import pytest
import torch

from mtc.runtime.state import read_params
from mtc.store import TensorStore
from mtc.train import train
from tests.runtime.engine_util import skewed_tokens, small_config


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "tok.bin")


# (ids without the word "gpu": tests/conftest.py skips items with that keyword on the CPU)
@pytest.mark.parametrize("placement", ["gpu", "gpu:0-1,ram:2-3"], ids=["resident", "mixed"])
def test_a_slow_disk_does_not_mix_two_steps_into_one_commit(tokens, monkeypatch, placement):
    cfg = small_config(steps=3, placement=placement, commit_every=1, durability="full")
    want = train(small_config(steps=2, placement=placement, commit_every=1, durability="full"), None, tokens)
    want_w = read_params(want.program, want.store, want.generation)
    want.store.close()

    write_async = TensorStore.write_async

    def slow_write_async(self, name, src, **kw):  # the store reads the source a step or more later
        time.sleep(0.2)
        return write_async(self, name, src, **kw)

    monkeypatch.setattr(TensorStore, "write_async", slow_write_async)
    res = train(cfg, None, tokens)
    try:
        assert res.records[-1].step == 3
        # step 2's commit is in the generation step 3 did not write
        got = read_params(res.program, res.store, 1 - res.generation)
        bad = [k for k in want_w if not torch.equal(got[k], want_w[k])]
        assert not bad, f"step 2's committed state differs from a run stopped at step 2 in {bad}"
    finally:
        res.store.close()
