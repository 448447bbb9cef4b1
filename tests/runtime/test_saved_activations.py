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


def _run(hb, cfg, tokens, n: int) -> tuple[list[float], torch.Tensor]:
    """``n`` steps of the hand-built engine ``hb`` (closed after): the losses and every layer's master."""
    try:
        losses = _steps(hb, cfg, tokens, n)
        return losses, torch.cat([hb.tiers[i].master.clone() for i in range(hb.run.program.n_layers)])
    finally:
        hb.close()


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


def test_only_blocks_can_save(tokens):
    cfg = small_config(kernels="unfused", durability="none")
    for layer in (0, 3, 4):  # the embed stage, the head, no layer
        with pytest.raises(PlanError, match=f"layer {layer} cannot keep its activations"):
            hand_built_engine(cfg, saves=(layer,)).close()


@pytest.mark.parametrize("placement", ["ram", "gpu:0-1,ram:2-3"])  # streamed through the ring, and resident
def test_unfused_blocks_keep_their_autograd_graphs_bit_for_bit(tokens, placement):
    # an unfused block's saved value is its autograd graph, its weight views re-read from the
    # backward visit's weights: the step is the recomputing one's bit for bit (the same ATen ops
    # on the same values). (With the ring's two slots a layer's two visits land in one slot, so
    # the test below, with the slot overwritten in between, is the one that checks the re-read.)
    cfg = small_config(kernels="unfused", durability="none", placement=placement, steps=3)
    calls: Counter = Counter()
    hb = hand_built_engine(cfg, saves=(1, 2), wrap=lambda rs: {tid: Counting(r, tid, calls) for tid, r in rs.items()})
    losses, weights = _run(hb, cfg, tokens, 3)
    want, want_weights = _run(hand_built_engine(cfg), cfg, tokens, 3)
    assert losses == want and torch.equal(weights, want_weights)
    n = 3 * cfg.grad_accum * 2  # steps x micro-batches x blocks
    block = hb.run.program.layers[1].template
    assert calls[(block, "save")] == calls[(block, "backward")] == n and calls[(block, "joint")] == 0
    # train chooses them only when told (their size is not known ahead)
    res = train(dataclasses.replace(cfg, save_activations="all"), None, tokens)
    res.store.close()
    assert res.saves == [1, 2] and res.losses == want
    res = train(cfg, None, tokens)
    res.store.close()
    assert res.saves == []


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

    mixed = 0

    def saves(spec: str, left: int = 0, prefetch: int = 0, **kw: Any) -> list[int]:
        monkeypatch.setattr(tr, "_gpu_left", lambda *a, **k: left)
        monkeypatch.setattr(tr, "mixed_saves_bytes", lambda b: mixed)
        cfg = small_config(model_overrides={"n_layers": 4}, save_activations=spec, **kw)
        return plan_saves(cfg, prog, compiled, ["ram"] * prog.n_layers, set(), prefetch)

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
    # an automatic update prefetch leaves its own margin free: the saves chosen after it keep it
    from mtc.runtime.placement import PREFETCH_MARGIN_BYTES

    assert saves("auto", margin + 300 * 2**20, prefetch=2, device="cuda") == []
    assert saves("auto", margin + PREFETCH_MARGIN_BYTES + 300 * 2**20, prefetch=2, device="cuda") == [4]
    assert saves("auto", margin + 300 * 2**20, prefetch=2, device="cuda", update_prefetch=2) == [4]  # named: no margin
    # streamed blocks some of which save and some recompute replay both a joint and a backward
    # graph per ring slot: that is charged with the template's first saving block, unless all fit
    mixed = 64 * 2**20
    assert saves("auto", margin + 300 * 2**20 + mixed - 1, device="cuda") == []
    assert saves("auto", margin + 300 * 2**20 + mixed, device="cuda") == [4]
    assert saves("auto", margin + 900 * 2**20, device="cuda") == blocks  # all four: no joint graph replays
    assert saves("auto", margin + 900 * 2**20 - 1, device="cuda") == [2, 3, 4]  # 300 + 64 + 200 + 200 of 899
    mixed = 0
    with pytest.raises(ConfigError, match="at most 4"):
        saves("5")
    compiled[block].save_graph, compiled[block].split_note = None, "not split: no reason"
    assert saves("auto", 10 * margin, device="cuda") == []
    with pytest.raises(ConfigError, match="not split: no reason"):
        saves("all")


def test_plan_saves_counts_the_state_once(tokens, monkeypatch):
    # mtc.train reads the device's free memory before its state is allocated and hands it to
    # plan_saves, which subtracts the placement's state itself: read after the allocation, the
    # resident state was subtracted twice and fewer blocks kept their activations than planned
    import importlib

    from mtc.runtime import placement as pl
    from mtc.train import open_run

    tr = importlib.import_module("mtc.train")
    run = open_run(small_config(model_overrides={"n_layers": 4}), None)
    run.store.close()
    prog = run.program
    block = prog.layers[1].template
    cfg = small_config(model_overrides={"n_layers": 4}, save_activations="auto", device="cuda", cuda_graphs="off")
    placement = ["gpu"] * prog.n_layers
    numels = [prog.layer_numel(i) for i in range(prog.n_layers)]
    state = pl.gpu_state_bytes(placement, numels, getattr(torch, cfg.resolved_compute_dtype).itemsize)
    per_block = state // 4  # each block's values (2 micro-batches): all four take as much as the state
    compiled = {tid: _Compiled(tid, per_block // 2 if tid == block else 0) for tid in prog.templates}
    monkeypatch.setattr(tr, "_gpu_workspace", lambda *a: 0)
    monkeypatch.setattr(tr, "_graph_gpu_extra", lambda *a: [0] * prog.n_layers)
    free = state + SAVE_MARGIN_BYTES + 4 * per_block  # room for every block beside the state
    monkeypatch.setattr(tr, "_gpu_free", lambda cfg: free - state)  # what the device says after the state
    assert plan_saves(cfg, prog, compiled, placement, set(), gpu_free=free) == [1, 2, 3, 4]
    assert plan_saves(cfg, prog, compiled, placement, set()) == []  # the free memory read now: state counted twice


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
    # two steps: the second replays over buffers the first step's replays wrote (interpreter kernels:
    # each step here costs ~25 s of the suite)
    losses, weights = _run(hand_built_engine(cfg, tmp_path / "k", saves=(1, 2), wrap=wrap), cfg, tokens, 2)
    want, want_weights = _run(hand_built_engine(cfg, tmp_path / "k", saves=(1, 2)), cfg, tokens, 2)
    assert losses == want and torch.equal(weights, want_weights)
    block = next(r for r in wrapped.values() if r.template.kind == "block")
    assert block.stats["backward"].replays == 2 * 2 * cfg.grad_accum and block.stats["joint"].replays == 0
    assert block.stats["save"].skipped and block.stats["save"].captured == 0
    assert any("block" in line and "save: not replayed" in line for line in graph_report(wrapped))


def test_streamed_blocks_that_save_beside_ones_that_recompute_take_what_the_plan_counts(tokens, tmp_path):
    # block 2 saves, block 1 recomputes, both streamed: each ring slot replays a joint graph and a
    # backward graph, and the backward copies its inputs into buffers of its own. What the graphs
    # allocate for it is what `mixed_saves_bytes` charges, plus one set of the saved values (the
    # copy `choose_saves` counts with them)
    from mtc.costmodel import shape_from_program
    from mtc.runtime.graph_replay import EmulatedCapture, GraphRunner, mixed_saves_bytes
    from mtc.train import open_run

    cfg = small_config(kernels="fused", seq_len=8, durability="none", placement="ram")
    run = open_run(cfg, None)
    prog = run.program
    run.store.close()
    wrapped: dict = {}

    def wrap(rs):
        wrapped.update({tid: GraphRunner(r, prog.templates[tid], EmulatedCapture()) for tid, r in rs.items()})
        return wrapped

    hb = hand_built_engine(cfg, tmp_path / "k", saves=(2,), wrap=wrap)
    assert hb.placement[1:3] == ["ram", "ram"]
    saved_bytes = hb.compiled[prog.layers[2].template].saved_bytes()
    _run(hb, cfg, tokens, 2)  # the second step visits the other ring slot: a capture in each
    block = next(r for r in wrapped.values() if r.template.kind == "block")
    assert block.stats["joint"].captured == block.stats["backward"].captured == 2  # a graph of each per ring slot
    st = block.stats["backward"]
    buffers = shape_from_program(prog, cfg.model, 4).graph_buffers[2]
    assert st.static_bytes + st.kept_bytes == mixed_saves_bytes(buffers) + saved_bytes


def test_an_unfused_saved_graph_reads_the_backward_visits_weights():
    # the forward visit's slot is reused by other layers before the backward visit, which may
    # fetch the layer into another slot (a ring of three, say): the kept graph must read its
    # weight views from the backward visit's arguments, not from the slot it was built in
    from mtc.graphs.program import aux_param_dependence
    from mtc.runtime.runners import AutogradRunner
    from mtc.runtime.state import flatten_layer
    from mtc.train import open_run

    run = open_run(small_config(kernels="unfused"), None)
    run.store.close()
    prog, call = run.program, run.program.layers[1]
    t = prog.templates[call.template]
    runner = AutogradRunner(t, call, aux_param_dependence(prog.template_of(0)))
    torch.manual_seed(0)
    aux = [torch.randn(a.shape) for a in prog.aux]
    carry, gout = torch.randn(prog.carry.shape), torch.randn(prog.carry.shape)
    weights = flatten_layer(prog, 1, run.params)

    def args(slot: torch.Tensor) -> list[torch.Tensor]:
        views = {p.key: slot[p.offset:p.offset + p.numel].view(p.spec.shape) for p in prog.layer_params(1)}
        out = []
        for inp in t.inputs:
            src = call.bindings[inp.name]
            out.append(views[src.key] if src.kind == "param" else carry if src.kind == "carry" else aux[src.index])
        return out

    a, b = weights.clone(), weights.clone()
    kept = runner.save(torch.device("cpu"))(*args(a))[-1]
    a.fill_(float("nan"))  # the forward visit's slot, filled with another layer's weights
    got = runner.backward(torch.device("cpu"))(*args(b), kept, gout)
    want = runner.joint(torch.device("cpu"))(*args(b), gout)
    assert all(o is None for o in got[:runner.n_out])
    for x, y in zip(got[runner.n_out:], want[runner.n_out:], strict=True):
        assert (x is None and y is None) or torch.equal(x, y)
