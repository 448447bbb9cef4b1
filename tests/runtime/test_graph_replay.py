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
    def capture(self, fn, args, copies=()):
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


def test_one_graph_per_weight_address_sharing_the_copied_input_buffers():
    ws = [torch.randn(3, 3) for _ in range(4)]  # two ring slots and two resident layers, say
    ptrs = {w.untyped_storage().data_ptr() for w in ws}
    r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture())
    r.bind_stable(lambda t: t.untyped_storage().data_ptr() in ptrs)
    fwd = r.forward(torch.device("cpu"))
    for _ in range(2):
        for w in ws:
            x = torch.randn(4, 3)
            assert torch.equal(fwd(x, w)[0], x @ w)
    st = r.stats["forward"]
    assert (st.captured, st.copy_in, st.replays, st.eager_calls) == (4, 0, 8, 0)
    assert st.launches_per_call == 1 + 1 + 1  # no weight is copied, at any address
    assert st.static_bytes == 4 * 3 * 4  # one buffer for x, shared by the four graphs
    assert st.kept_bytes == 4 * (4 * 3 * 4)  # each graph keeps its own output
    # another shape than the plan's: eager, counted
    y = fwd(torch.randn(2, 3), ws[0])[0]
    assert y.shape == (2, 3) and st.eager_calls == 1


def test_a_replay_measured_slower_than_eager_runs_eagerly_and_says_so():
    w = torch.randn(3, 3)
    msgs: list[str] = []
    r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture(times=(10.0, 10.5)), log=msgs.append)
    r.bind_stable(lambda t: t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr())
    fwd = r.forward(torch.device("cpu"))
    xs = [torch.randn(4, 3) for _ in range(3)]
    for x in xs:
        assert torch.equal(fwd(x, w)[0], x @ w)
    st = r.stats["forward"]
    assert (st.replays, st.eager_calls, st.static_bytes) == (0, 3, 0)
    assert "replay measured slower than eager: 10.50 vs 10.00 ms" in st.skipped
    assert len(msgs) == 1 and "runs eagerly" in msgs[0]
    assert any("not replayed (replay measured slower" in line for line in r.report_lines())


def test_a_replay_measured_faster_keeps_replaying_and_reports_both_times():
    w = torch.randn(3, 3)
    r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture(times=(10.0, 10.1)))  # within the margin
    r.bind_stable(lambda t: t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr())
    fwd = r.forward(torch.device("cpu"))
    for _ in range(3):
        x = torch.randn(4, 3)
        assert torch.equal(fwd(x, w)[0], x @ w)
    st = r.stats["forward"]
    assert (st.replays, st.eager_calls, st.skipped) == (3, 0, None)
    assert any("measured 10.10 ms per replay vs 10.00 eager" in line for line in r.report_lines())


def test_beyond_a_cap_one_graph_copies_weights_in_and_says_so():
    ws = [torch.randn(3, 3) for _ in range(4)]
    ptrs = {w.untyped_storage().data_ptr() for w in ws}
    msgs: list[str] = []
    r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture(), max_graphs=2, log=msgs.append)
    r.bind_stable(lambda t: t.untyped_storage().data_ptr() in ptrs)
    fwd = r.forward(torch.device("cpu"))
    x = torch.randn(4, 3)
    for _ in range(2):
        for w in ws:
            assert torch.equal(fwd(x, w)[0], x @ w)
    st = r.stats["forward"]
    assert (st.captured, st.copy_in, st.replays, st.copy_in_replays) == (3, 1, 8, 4)
    assert (st.launches_per_call, st.copy_in_launches_per_call) == (3, 4)  # the copy-in graph copies w too
    assert st.static_bytes == 4 * 3 * 4 + 3 * 3 * 4  # x's buffer (shared) and the copy-in graph's w
    assert len(msgs) == 1 and "more than 2 weight addresses" in msgs[0]
    line = r.report_lines()[0]
    assert line.startswith("toy forward: 3 graphs (2 reading weights in place, 1 copying them in: 4 of the replays, 4 launches per call)")


def test_unstable_weights_are_copied_in():
    r = GraphRunner(_ToyRunner(), _toy_template(), EmulatedCapture())  # nothing declared stable
    fwd = r.forward(torch.device("cpu"))
    x = torch.randn(4, 3)
    for _ in range(3):
        w = torch.randn(3, 3)  # a fresh tensor each call (an evaluation's weights)
        assert torch.equal(fwd(x, w)[0], x @ w)
    st = r.stats["forward"]
    assert (st.captured, st.copy_in, st.copy_in_replays) == (1, 1, 3) and st.copy_in_launches_per_call == 2 + 1 + 1


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


def _steps(tokens, wrap: bool, placement: str, steps: int = 3, **kw):
    cfg = small_config(placement=placement, durability="none", **kw)
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
    return losses, weights, captured, runners, prog


@pytest.mark.parametrize("placement", ["gpu:0,ram:1-3"])  # a resident layer and ring slots
def test_replayed_steps_are_bit_identical_to_eager(tokens, placement):
    losses, weights, _, _, _ = _steps(tokens, False, placement)
    got_losses, got_weights, captured, runners, _ = _steps(tokens, True, placement)
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


def test_resident_and_streamed_layers_of_one_template_read_their_weights_in_place(tokens):
    # embed, four blocks of one template, head: blocks 1-2 resident, 3-4 streamed through the two ring slots
    kw = {"model_overrides": {"n_layers": 4}}
    placement = "gpu:0-2,ram:3-5"
    losses, weights, _, _, _ = _steps(tokens, False, placement, **kw)
    got_losses, got_weights, captured, runners, prog = _steps(tokens, True, placement, **kw)
    assert got_losses == losses
    assert torch.equal(got_weights, weights)
    assert captured[1] == captured[2]  # every graph exists after two steps
    block = next(r for r in runners.values() if r.template.kind == "block")
    for st in (block.stats["forward"], block.stats["joint"]):  # a graph per ring slot and per resident layer; none copies weights
        assert (st.captured, st.copy_in, st.copy_in_replays, st.eager_calls, st.fallback) == (4, 0, 0, 0, None)
    # 3 steps x 2 micro-batches x 4 blocks, forward and joint
    assert block.stats["forward"].replays == block.stats["joint"].replays == 3 * 2 * 4
    # per call: copy the carry and the two aux inputs (and the incoming gradient), launch, clone the
    # output (the joint: dx; it returns no output, and the parameter gradients are the graph's buffers)
    assert block.stats["forward"].launches_per_call == 3 + 1 + 1
    assert block.stats["joint"].launches_per_call == 4 + 1 + 1
    line = graph_report(runners)[3]
    assert line.startswith(f"{block.template.id} forward: 4 graphs (4 reading weights in place), 24 replays, 5 launches per call")

    # what the planner counts is what the graphs allocated: one set of copied-input buffers, and
    # the kept outputs of each of the four weight addresses
    from dataclasses import replace

    from mtc.costmodel import shape_from_program
    from mtc.planner import gpu_workspace
    from mtc.runtime.graph_replay import graph_memory_bytes
    from mtc.runtime.placement import resolve_placement

    allocated = sum(st.static_bytes + st.kept_bytes for st in block.stats.values())
    assert allocated == sum(st.static_bytes + st.pool_bytes for st in block.stats.values())  # emulated pool: the outputs
    cfg = small_config(placement=placement, **kw)
    shape = shape_from_program(prog, cfg.model, 4)
    tiers = resolve_placement(placement, prog.n_layers)
    blocks = [shape.graph_buffers[i] if prog.template_of(i).kind == "block" else None for i in range(prog.n_layers)]
    assert graph_memory_bytes(blocks, tiers) == allocated
    assert gpu_workspace(cfg, shape, tiers) - gpu_workspace(replace(cfg, cuda_graphs="off"), shape, tiers) == allocated


def test_the_planner_counts_a_graph_per_ring_slot_and_per_resident_layer():
    from mtc.costmodel import model_shape
    from mtc.planner import gpu_workspace, graph_gpu_extra

    kw = {"device": "cuda", "kernels": "fused", "model_overrides": {"n_layers": 4}}  # embed, 4 blocks, head
    cfg, off = small_config(**kw), small_config(cuda_graphs="off", **kw)
    shape = model_shape(cfg, "bfloat16")
    b = shape.graph_buffers[1]
    assert all(x == b for x in shape.graph_buffers[1:-1])
    hidden = cfg.micro_batch_size * cfg.seq_len * shape.hidden * shape.compute_bytes
    # a block's graphs keep its parameter gradients and two activations (the forward output and
    # dx; its joint does not return the output) per weight address; they share the copied carry,
    # aux inputs and incoming gradient
    assert b.kept == shape.numels[1] * shape.compute_bytes + 2 * hidden
    assert b.copied > 3 * hidden

    def extra(placement):
        return gpu_workspace(cfg, shape, placement) - gpu_workspace(off, shape, placement)

    assert extra(None) == extra(["ram"] * 6) == b.copied + 2 * b.kept  # the ring's two slots
    assert extra(["gpu"] * 3 + ["ram"] * 3) == b.copied + 4 * b.kept  # two slots, two resident blocks
    assert extra(["gpu"] * 5 + ["ram"]) == b.copied + 4 * b.kept  # four resident blocks, no block streams
    assert gpu_workspace(small_config(**{**kw, "kernels": "unfused"}), shape, ["gpu"] * 6) == gpu_workspace(off, shape, ["gpu"] * 6)
    # an automatic placement charges each resident block its graphs (embed stages and heads are not replayed)
    assert graph_gpu_extra(cfg, shape) == [0, b.kept, b.kept, b.kept, b.kept, 0]
    assert graph_gpu_extra(off, shape) == [0] * 6
