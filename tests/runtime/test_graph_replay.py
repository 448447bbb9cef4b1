"""Graph replay on the CPU: the decision to capture or fall back, the fixed-buffer plumbing (with a
graph's buffer semantics emulated), the launch proxy and the report. The CUDA capture itself is in
test_graph_replay_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mtc.graphs.program import Template, TemplateInput, TensorSpec

from mtc.data import BatchSampler
from mtc.runtime.graph_replay import (
    EmulatedCapture,
    GraphRunner,
    capture_blocker,
    graph_report,
    replay_graphs,
)
from mtc.runtime.runners import AutogradRunner
from mtc.runtime.state import flatten_layer
from mtc.runtime.tiers import StateTiers
from mtc.runtime.timeline import Timeline
from mtc.train import build_engine, open_run, plan_placement
from tests.runtime.engine_util import skewed_tokens, small_config

# -- deciding: which graphs cannot be captured -------------------------------------------------


def _graph_of(op, *, bool_index: bool = False) -> torch.fx.Graph:
    """x -> op(x) (or x[mask]) as an ATen FX graph, as the compiler's graphs hold them."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(6)
    if bool_index:
        mask = g.call_function(torch.ops.aten.gt.Scalar, (x, 0))
        mask.meta["val"] = torch.empty(6, dtype=torch.bool)
        y = g.call_function(torch.ops.aten.index.Tensor, (x, [mask]))
    else:
        y = g.call_function(op, (x,))
    g.output((y,))
    return g


def test_capture_blocker_names_the_op_that_syncs():
    assert "aten.nonzero" in capture_blocker(_graph_of(torch.ops.aten.nonzero.default))
    assert "aten._local_scalar_dense" in capture_blocker(_graph_of(torch.ops.aten._local_scalar_dense.default))
    assert "boolean mask" in capture_blocker(_graph_of(None, bool_index=True))
    assert capture_blocker(_graph_of(torch.ops.aten.relu.default)) is None


# -- the plumbing, on a toy layer --------------------------------------------------------------


def _toy_template() -> Template:
    spec = TensorSpec((4, 3), "float32")
    inputs = [TemplateInput("x", "carry", spec, "x"), TemplateInput("w", "param", TensorSpec((3, 3), "float32"), "w")]
    return Template("block", torch.fx.Graph(), inputs, id="toy")


class _ToyRunner:
    """y = x @ w; joint returns (y, dx, dw) for grad output g."""

    diff, n_out = [0, 1], 1

    def forward(self, device):
        return lambda x, w: (x @ w,)

    def joint(self, device):
        return lambda x, w, g: (x @ w, g @ w.T, x.T @ g)


class _Failing:
    def capture(self, fn, args):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")


def test_replay_reads_bound_weights_in_place_and_copies_the_rest():
    w = torch.randn(3, 3)
    r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture())
    r.bind_stable(lambda t: t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr())
    fwd = r.forward(torch.device("cpu"))
    xs = [torch.randn(4, 3) for _ in range(3)]
    outs = [fwd(x, w)[0] for x in xs]
    for x, y in zip(xs, outs, strict=True):  # each output kept is a copy: later replays do not overwrite it
        assert torch.equal(y, x @ w)
    w.mul_(2)  # an update in place (the resident tier / a refilled ring slot): the same graph reads it
    assert torch.equal(fwd(xs[0], w)[0], xs[0] @ w)
    st = r.stats["forward"]
    assert (st.captured, st.replays, st.eager_calls) == (1, 4, 0)
    assert st.launches_per_call == 1 + 1 + 1  # copy x, launch, clone y (w is read in place)


def test_parameter_gradients_are_graph_buffers_activation_gradients_are_copies():
    w = torch.randn(3, 3)
    r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture())
    r.bind_stable(lambda t: t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr())
    joint = r.joint(torch.device("cpu"))
    x1, x2, g = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3)
    y1, dx1, dw1 = joint(x1, w, g)
    dw1_now = dw1.clone()
    _, _, dw2 = joint(x2, w, g)
    assert dw2 is dw1 and torch.equal(dw2, x2.T @ g)  # the graph's own buffer: consume before the next replay
    assert not torch.equal(dw1_now, dw2)
    assert torch.equal(y1, x1 @ w) and torch.equal(dx1, g @ w.T)  # recomputed output and dx: kept intact
    assert r.stats["joint"].launches_per_call == 2 + 1 + 2


def test_one_graph_per_weight_address_then_one_that_copies_weights_in():
    ws = [torch.randn(3, 3) for _ in range(4)]
    ptrs = {w.untyped_storage().data_ptr() for w in ws}
    r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture(), max_graphs=2)
    r.bind_stable(lambda t: t.untyped_storage().data_ptr() in ptrs)
    fwd = r.forward(torch.device("cpu"))
    x = torch.randn(4, 3)
    for _ in range(2):
        for w in ws:
            assert torch.equal(fwd(x, w)[0], x @ w)
    st = r.stats["forward"]
    assert st.captured == 3 and st.replays == 8  # two slots' graphs, then one copy-in graph for the rest
    # another shape than the plan's: eager, counted
    y = fwd(torch.randn(2, 3), ws[0])[0]
    assert y.shape == (2, 3) and st.eager_calls == 1


def test_unstable_weights_are_copied_in():
    r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture())  # nothing declared stable
    fwd = r.forward(torch.device("cpu"))
    x = torch.randn(4, 3)
    for _ in range(3):
        w = torch.randn(3, 3)  # a fresh tensor each call (an evaluation's weights)
        assert torch.equal(fwd(x, w)[0], x @ w)
    st = r.stats["forward"]
    assert st.captured == 1 and st.launches_per_call == 2 + 1 + 1


def test_weights_outside_the_executors_buffers_run_eagerly():
    r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture())
    r.bind_stable(lambda t: False)  # an executor is bound, but these weights are not in its buffers
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    assert torch.equal(r.forward(torch.device("cpu"))(x, w)[0], x @ w)
    assert r.stats["forward"].captured == 0 and r.stats["forward"].eager_calls == 1


def test_failed_capture_falls_back_once_and_says_why():
    msgs: list[str] = []
    r = GraphRunner(_ToyRunner(), _toy_template(), _Failing(), log=msgs.append)
    fwd = r.forward(torch.device("cpu"))
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    for _ in range(3):
        assert torch.equal(fwd(x, w)[0], x @ w)
    assert msgs == [("cuda graphs: template toy forward runs without graph replay (capture failed: RuntimeError: "
                     "operation not permitted when stream is capturing)")]
    assert r.stats["forward"].eager_calls == 3 and r.stats["forward"].captured == 0
    assert r.report_lines()[0].startswith("toy forward: eager (capture failed")


def test_a_graph_that_syncs_is_never_captured():
    t = _toy_template()
    g = _graph_of(torch.ops.aten.nonzero.default)
    msgs: list[str] = []
    r = GraphRunner(_ToyRunner(), t, _Failing(), graphs={"forward": g}, log=msgs.append)
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    assert torch.equal(r.forward(torch.device("cpu"))(x, w)[0], x @ w)
    assert len(msgs) == 1 and "aten.nonzero" in msgs[0] and r.stats["forward"].eager_calls == 1


def test_replay_graphs_wraps_compiled_templates_on_cuda_or_with_a_backend():
    t = _toy_template()
    compiled = {"toy": SimpleNamespace(forward_graph=_graph_of(torch.ops.aten.relu.default),
                                       joint_graph=_graph_of(torch.ops.aten.nonzero.default),
                                       forward_report=SimpleNamespace(kernels=9), backward_report=SimpleNamespace(kernels=9))}
    runners = {"toy": _ToyRunner(), "other": _ToyRunner()}
    cpu = torch.device("cpu")
    assert replay_graphs(runners, {"toy": t}, compiled, cpu) is runners  # no CUDA: as they were
    assert replay_graphs(runners, {"toy": t}, compiled, cpu, mode="off", backend=EmulatedCapture()) is runners
    msgs: list[str] = []
    got = replay_graphs(runners, {"toy": t}, compiled, cpu, backend=EmulatedCapture(), log=msgs.append)
    assert isinstance(got["toy"], GraphRunner) and got["other"] is runners["other"]  # only compiled templates
    assert got["toy"].stats["joint"].fallback is not None and len(msgs) == 1  # decided before any call


def test_a_graph_whose_replay_would_save_few_launches_runs_eagerly():
    g = torch.fx.Graph()  # the toy layer's forward: x @ w, one output
    x, w = g.placeholder("x"), g.placeholder("w")
    g.output((g.call_function(torch.ops.aten.mm.default, (x, w)),))
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    for eager, replayed in ((5, False), (6, True)):  # replay: copy x, launch, clone y = 3 (it must save 3)
        r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture(), graphs={"forward": g},
                        eager_launches={"forward": eager})
        assert torch.equal(r.forward(torch.device("cpu"))(x, w)[0], x @ w)
        st = r.stats["forward"]
        assert (st.captured, st.eager_calls, st.skipped is None) == ((1, 0, True) if replayed else (0, 1, False))
        if not replayed:
            assert r.report_lines() == ["toy forward: not replayed (replay would launch 3 kernels per call, eager 5)"]


# -- the executor fills the buffers: a training step, replayed, is bit-identical ---------------


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "tok.bin")


def _steps(tokens, wrap: bool, placement: str, steps: int = 3):
    cfg = small_config(placement=placement, durability="none")
    run = open_run(cfg, None)
    prog = run.program
    placement_, gpu_update = plan_placement(cfg, prog)
    tiers = StateTiers(prog, placement_, torch.device("cpu"), torch.float32)
    for i in range(prog.n_layers):
        tiers.set_layer(i, flatten_layer(prog, i, run.params))
    from mtc.graphs.program import aux_param_dependence

    aux = aux_param_dependence(prog.template_of(0))
    runners = {}
    for call in prog.layers:
        if call.template not in runners:
            runners[call.template] = AutogradRunner(prog.templates[call.template], call, aux)
            if wrap:
                runners[call.template] = GraphRunner(runners[call.template], prog.templates[call.template], EmulatedCapture())
    eng = build_engine(cfg, prog, tiers, gpu_update, run.store, Timeline(), runners=runners)
    sampler = BatchSampler(tokens, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=0)
    losses, captured = [], []
    try:
        for step in range(steps):
            eng.optimizer.begin_step(step, 1e-3)
            mbs = [sampler.batch(step * cfg.grad_accum + j) for j in range(cfg.grad_accum)]
            out = eng.executor.run_step(mbs, eng.optimizer)
            losses.append(eng.optimizer.finish_step(out.loss).loss)
            captured.append(sum(st.captured for r in runners.values() if isinstance(r, GraphRunner) for st in r.stats.values()))
        eng.optimizer.wait()
        weights = torch.cat([tiers[i].master.clone() for i in range(prog.n_layers)])
    finally:
        eng.close()
        run.store.close()
    return losses, weights, captured, runners


@pytest.mark.parametrize("placement", ["gpu:0,ram:1-3"])  # a resident layer and ring slots
def test_replayed_steps_are_bit_identical_to_eager(tokens, placement):
    losses, weights, _, _ = _steps(tokens, False, placement)
    got_losses, got_weights, captured, runners = _steps(tokens, True, placement)
    assert got_losses == losses
    assert torch.equal(got_weights, weights)
    # every graph was captured in the first two steps (the ring's slots alternate between steps); the
    # third only replays: one graph per slot, none per layer
    assert captured[1] == captured[2] > 0
    for r in runners.values():
        for st in r.stats.values():
            assert st.eager_calls == 0 and st.captured <= 2 and st.fallback is None
    # every visit of a block or the embed stage ran a graph, and the head's (joint only) too
    kinds = {r.template.kind: r for r in runners.values()}
    assert all(kinds[k].stats[w].captured for k, w in [("embed", "forward"), ("embed", "joint"), ("block", "forward"),
                                                        ("block", "joint"), ("head", "joint")])
    lines = graph_report(runners)
    assert lines[0].startswith("cuda graphs: ") and len(lines) == 1 + 5


def test_the_planner_counts_graph_buffers_in_the_gpu_workspace():
    from mtc.costmodel import model_shape
    from mtc.planner import gpu_workspace
    from mtc.runtime.graph_replay import graph_memory_bytes

    cfg = small_config(device="cuda", kernels="fused")
    shape = model_shape(cfg, "bfloat16")
    hidden = cfg.micro_batch_size * cfg.seq_len * shape.hidden * shape.compute_bytes
    extra = graph_memory_bytes(max(shape.numels[1:-1]), shape.compute_bytes, hidden)  # the blocks' graphs
    assert extra > 0
    for off in ({"kernels": "fused", "cuda_graphs": "off"}, {"kernels": "unfused"}):
        assert gpu_workspace(cfg, shape) - gpu_workspace(small_config(device="cuda", **off), shape) == extra
