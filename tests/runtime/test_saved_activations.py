"""Blocks that keep their activations between visits: the executor runs a block's saving forward
and its backward from the saved values instead of the recomputing joint graph, and
`mtc.train.plan_saves` chooses which blocks (graphs/split.py cuts the graphs; the parity test
with ``save_activations="all"`` checks the training itself against PyTorch)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch

from mtc.data import BatchSampler
from mtc.errors import ConfigError, PlanError
from mtc.runtime.placement import SAVE_MARGIN_BYTES
from mtc.runtime.schedule import lr_at
from mtc.train import plan_saves, train
from tests.runtime.engine_util import hand_built_engine, skewed_tokens, small_config


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "tok.bin")


class Counting:
    """A runner whose callables count their calls (per template and callable)."""

    def __init__(self, inner: Any, tid: str, calls: Counter) -> None:
        self.inner, self.tid, self.calls = inner, tid, calls
        self.diff, self.n_out, self.saves = inner.diff, inner.n_out, inner.saves

    def _count(self, which: str, device: torch.device) -> Any:
        fn = getattr(self.inner, which)(device)

        def call(*a: Any) -> Any:
            self.calls[(self.tid, which)] += 1
            return fn(*a)

        return call

    def forward(self, device: torch.device) -> Any:
        return self._count("forward", device)

    def joint(self, device: torch.device) -> Any:
        return self._count("joint", device)

    def save(self, device: torch.device) -> Any:
        return self._count("save", device)

    def backward(self, device: torch.device) -> Any:
        return self._count("backward", device)


def _steps(hb, cfg, tokens, n: int) -> list[float]:
    sampler = BatchSampler(tokens, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    losses = []
    for step in range(n):
        hb.engine.optimizer.begin_step(step, lr_at(step, cfg.steps, cfg.optim))
        mbs = [sampler.batch(step * cfg.grad_accum + j) for j in range(cfg.grad_accum)]
        out = hb.engine.executor.run_step(mbs, hb.engine.optimizer)
        losses.append(hb.engine.optimizer.finish_step(out.loss).loss)
    hb.engine.optimizer.wait()
    return losses


def test_a_saving_block_runs_its_backward_from_saved_values(tokens, tmp_path):
    # block 2 keeps its activations, block 1 (same template) recomputes: per step and micro-batch
    # block 2 runs the saving forward and the backward from it, block 1 the forward and the joint
    cfg = small_config(kernels="fused", seq_len=8, durability="none")
    calls: Counter = Counter()
    hb = hand_built_engine(cfg, tmp_path / "k", saves=(2,),
                           wrap=lambda rs: {tid: Counting(r, tid, calls) for tid, r in rs.items()})
    try:
        block = hb.run.program.layers[1].template
        assert hb.run.program.layers[2].template == block and hb.compiled[block].saved_bytes() > 0
        losses = _steps(hb, cfg, tokens, 2)
    finally:
        hb.close()
    n = 2 * cfg.grad_accum  # steps x micro-batches
    assert {w: c for (t, w), c in calls.items() if t == block} == {"forward": n, "save": n, "joint": n, "backward": n}
    # and the losses are those of a run where both blocks recompute (its third step's loss differs
    # if any gradient of the first two did)
    ref = hand_built_engine(cfg, tmp_path / "k")
    try:
        want = _steps(ref, cfg, tokens, 2)
    finally:
        ref.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=0)


def test_only_blocks_with_split_graphs_can_save(tokens):
    cfg = small_config(kernels="unfused", durability="none")
    with pytest.raises(PlanError, match="layer 1 cannot keep its activations"):
        hand_built_engine(cfg, saves=(1,)).close()
    with pytest.raises(ConfigError, match="2 of 2 blocks cannot keep their activations.*unfused"):
        train(small_config(kernels="unfused", save_activations="all", steps=1, durability="none"), None, tokens)


@dataclasses.dataclass
class _Compiled:
    template_id: str
    nbytes: int
    save_graph: object = True
    split_note: str = ""

    def saved_bytes(self) -> int:
        return self.nbytes


def test_plan_saves_takes_the_last_blocks_that_fit(tokens, monkeypatch):
    import importlib

    from mtc.train import open_run

    tr = importlib.import_module("mtc.train")  # (the package's `train` attribute is the function)

    run = open_run(small_config(model_overrides={"n_layers": 4}), None)
    run.store.close()
    prog = run.program
    block = prog.layers[1].template
    compiled = {tid: _Compiled(tid, 100 << 20 if tid == block else 0) for tid in prog.templates}
    blocks = [1, 2, 3, 4]

    def saves(spec: str, left: int = 0, **kw: Any) -> list[int]:
        monkeypatch.setattr(tr, "_gpu_left", lambda *a: left)
        cfg = small_config(model_overrides={"n_layers": 4}, save_activations=spec, **kw)
        return plan_saves(cfg, prog, compiled, ["ram"] * prog.n_layers, set())

    assert saves("off") == [] and saves("all") == blocks and saves("3") == [2, 3, 4] and saves("0") == []
    assert saves("auto") == []  # on the CPU: nothing is kept
    # on CUDA: 2 micro-batches x 100 MiB per block, plus one copy of a block's values for the
    # replayed backward's input buffers, within what is left less the margin
    margin = SAVE_MARGIN_BYTES
    assert saves("auto", margin + 300 * 2**20 - 1, device="cuda") == []
    assert saves("auto", margin + 300 * 2**20, device="cuda") == [4]
    assert saves("auto", margin + 500 * 2**20, device="cuda") == [3, 4]
    assert saves("auto", margin + 500 * 2**20, device="cuda", cuda_graphs="off") == [3, 4]  # 400 MiB for two
    assert saves("auto", margin + 800 * 2**20, device="cuda", cuda_graphs="off") == blocks
    assert saves("auto", 10 * margin, device="cuda", activation_budget_gb=1.0) == []  # a fixed activation budget
    with pytest.raises(ConfigError, match="at most 4"):
        saves("5")
    compiled[block].save_graph, compiled[block].split_note = None, "not split: no reason"
    assert saves("auto", 10 * margin, device="cuda") == []
    with pytest.raises(ConfigError, match="not split: no reason"):
        saves("all")


def test_replayed_backward_from_saved_values_matches_eager(tokens, tmp_path):
    # graph replay (emulated on the CPU: fixed input buffers, output buffers overwritten at every
    # replay): the backward from saved values replays as the joint does, the saving forward runs
    # eagerly (its saved values would be held per graph), and the steps are those of eager calls
    from mtc.runtime.graph_replay import EmulatedCapture, GraphRunner, graph_report

    cfg = small_config(kernels="fused", seq_len=8, durability="none")
    wrapped: dict = {}

    def wrap(rs):
        wrapped.update({tid: GraphRunner(r, hb_prog.templates[tid], EmulatedCapture()) for tid, r in rs.items()})
        return wrapped

    from mtc.train import open_run

    run = open_run(cfg, None)
    hb_prog = run.program
    run.store.close()
    hb = hand_built_engine(cfg, tmp_path / "k", saves=(1, 2), wrap=wrap)
    try:
        losses = _steps(hb, cfg, tokens, 3)
        weights = torch.cat([hb.tiers[i].master.clone() for i in range(hb.run.program.n_layers)])
    finally:
        hb.close()
    eager = hand_built_engine(cfg, tmp_path / "k", saves=(1, 2))
    try:
        want = _steps(eager, cfg, tokens, 3)
        want_weights = torch.cat([eager.tiers[i].master.clone() for i in range(eager.run.program.n_layers)])
    finally:
        eager.close()
    assert losses == want and torch.equal(weights, want_weights)
    block = next(r for r in wrapped.values() if r.template.kind == "block")
    assert block.stats["backward"].replays == 3 * 2 * cfg.grad_accum and block.stats["joint"].replays == 0
    assert block.stats["save"].skipped and block.stats["save"].captured == 0
    assert any("block" in line and "save: not replayed" in line for line in graph_report(wrapped))
