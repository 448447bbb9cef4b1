"""Partitioning templates into anchors and fusion groups (forward and joint forward+backward)."""

from __future__ import annotations

import pytest
import torch
from mtc.graphs.lower import forward_graph, joint_graph
from mtc.graphs.partition import classify, partition
from mtc.kernels.codegen import FUSIBLE

from mtc.compiler import TEMPLATE_SWAPS
from mtc.models.llama import Llama, preset
from mtc.tracer import trace


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    return trace(Llama(preset("tiny", n_layers=2)), 2, 16)


def _check_partition(p) -> None:
    seen = set()
    for g in p.groups:
        inside = set(g.nodes)
        assert not inside & seen, "a node may belong to one group only"
        seen |= inside
        assert all(classify(n, FUSIBLE) == "fusible" for n in g.nodes)
        assert g.outputs, "a group must produce something used outside it"
        if len(g.nodes) > 1:  # connected: every node but the first reads another member
            assert all(any(a in inside for a in n.all_input_nodes) or n is g.nodes[0] or
                       any(u in inside for u in n.users) for n in g.nodes)
    fusible = [n for n in p.graph.nodes if classify(n, FUSIBLE) == "fusible"]
    assert set(fusible) == seen, "every fusible node is in a group"
    assert p.kernels() < p.aten_ops()


def test_block_forward_fuses_rmsnorm(program):
    block = program.templates[program.layers[1].template]
    p = partition(forward_graph(block, TEMPLATE_SWAPS).graph, FUSIBLE)
    _check_partition(p)
    mm = [n for n in p.anchors if n.target is torch.ops.aten.mm.default]
    assert len(mm) == 7, "q, k, v, o, gate, up, down projections"
    attn = [n for n in p.anchors if str(n.target) == "mtc.attention.default"]
    assert len(attn) == 1, "attention stays one anchor instead of decomposing into softmax pieces"
    norm = [g for g in p.groups if g.reduces]
    assert norm and all(g.shape == (2, 16, 128) for g in norm)
    # the whole RMSNorm (square, mean, + eps, rsqrt, scale, weight) is one kernel, and the
    # second one also takes the residual add before it
    rms = ["aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor", "aten.rsqrt.default", "aten.mul.Tensor", "aten.mul.Tensor"]
    ops = sorted([str(n.target) for n in g.nodes] for g in norm)
    assert ops == sorted([rms, ["aten.add.Tensor", *rms]])


def test_joint_graph_has_every_gradient(program):
    block = program.templates[program.layers[1].template]
    jg, diff = joint_graph(block, TEMPLATE_SWAPS)
    outs = next(n for n in jg.graph.nodes if n.op == "output").args[0]
    assert len(outs) == 1 + len(diff)
    assert len(diff) == 1 + len(block.input_names("param"))
    for k, o in zip(diff, outs[1:]):
        assert o is not None and tuple(o.meta["val"].shape) == block.inputs[k].spec.shape
    p = partition(jg.graph, FUSIBLE)
    _check_partition(p)
    assert len([n for n in p.anchors if n.target is torch.ops.aten.mm.default]) == 21  # 7 fwd + 14 bwd
    assert sorted(str(n.target) for n in p.anchors if "mtc." in str(n.target)) == [
        "mtc.attention.default", "mtc.attention_backward.default"]


def test_a_joint_graph_without_outputs_skips_the_last_matmul(program):
    """What a training step's backward visit runs: the block's output (the next layer's saved
    input) is not recomputed, so its last matmul (the down projection) and residual add go;
    every gradient is the same."""
    from mtc.graphs.program import instantiate, joint_keeps_outputs

    block = program.templates[program.layers[1].template]
    assert not joint_keeps_outputs(block) and joint_keeps_outputs(program.templates[program.layers[-1].template])
    full = joint_graph(block, TEMPLATE_SWAPS)[0].graph
    lean = joint_graph(block, TEMPLATE_SWAPS, outputs=False)[0].graph
    mms = [sum(1 for n in g.nodes if n.target is torch.ops.aten.mm.default) for g in (full, lean)]
    assert mms == [21, 20]
    args = [torch.randn(i.spec.shape) for i in block.inputs]
    gout = torch.randn(block.inputs[0].spec.shape)
    want, got = instantiate(full, "cpu")(*args, gout), instantiate(lean, "cpu")(*args, gout)
    assert want[0] is not None and got[0] is None
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _swiglu_grads(g, u, dh, w):
    """SwiGLU's backward as lowering writes it: silu(g) * u for the weight gradient, and the gate's
    and up's gradients, in chains that share their inputs but not a node."""
    s = torch.nn.functional.silu(g.float()).to(g.dtype)
    h, du = s * u, dh * s
    sig = torch.sigmoid(g.float())
    dg = ((dh * u).float() * sig * (g.float() * (sig * -1.0 + 1.0) + 1.0)).to(g.dtype)
    return h @ w, du, dg


def _dependent(g, u, w):
    """Two pointwise chains over one shape sharing g, where the second reads the first through a matmul."""
    a = g * u
    b = (a @ w) * g
    return a, b


def _act_and_bias_grad(h, dy, w):
    """GPT-2's MLP backward after views moved: the activation recomputed for the weight gradient,
    and the activation's gradient summed over the rows for the bias gradient, both from h."""
    a = h * torch.sigmoid(h)
    g = dy * h * 2.0
    return a.view(-1, 8) @ w, g, g.sum([0, 1])


def _row_and_pointwise(h, dy):
    return (h * dy).sum(-1, keepdim=True), h * 3.0


def test_a_pointwise_sibling_joins_a_column_kernel_over_a_shared_input():
    from torch.fx.experimental.proxy_tensor import make_fx

    h, dy = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    p = partition(make_fx(_act_and_bias_grad, tracing_mode="fake")(h, dy, torch.randn(8, 8)).graph, FUSIBLE)
    _check_partition(p)
    assert len(p.groups) == 1 and len(p.groups[0].outputs) == 3  # a, g and the sum from one read of h
    # a row kernel takes no pointwise sibling this way (rows and columns never share a kernel)
    p = partition(make_fx(_row_and_pointwise, tracing_mode="fake")(h, dy).graph, FUSIBLE)
    assert len(p.groups) == 2


def test_sibling_pointwise_groups_over_shared_inputs_become_one_kernel():
    from torch.fx.experimental.proxy_tensor import make_fx

    g, u, dh = (torch.randn(4, 6, 8, dtype=torch.bfloat16) for _ in range(3))
    p = partition(make_fx(_swiglu_grads, tracing_mode="fake")(g, u, dh, torch.randn(8, 8, dtype=torch.bfloat16)).graph, FUSIBLE)
    _check_partition(p)
    assert len(p.groups) == 1 and len(p.groups[0].outputs) == 3  # h, du, dg from one read of g, u, dh
    # a matmul between the two would make one kernel both feed and wait for it: they stay apart
    p = partition(make_fx(_dependent, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)).graph, FUSIBLE)
    assert len(p.groups) == 2
