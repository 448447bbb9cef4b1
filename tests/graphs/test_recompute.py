"""Recompute instead of save: cheap fp32 intermediates a forward group stores only for backward
groups are recomputed there; fewer bytes cross between kernels and the values are unchanged."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from mtc.graphs.lower import joint_graph
from mtc.graphs.partition import RECOMPUTE, partition
from mtc.graphs.program import devices_to_marker, dtype_from_name, instantiate
from mtc.graphs.recompute import broadcast_output, copy_broadcast_outputs, recompute_cheap, stored_between_groups
from mtc.graphs.views import move_views
from mtc.kernels.codegen import FUSIBLE

from mtc.compiler import TEMPLATE_SWAPS
from mtc.models import build
from mtc.tracer import trace


def _joint(name: str):
    """(template, a fresh copy of its joint graph); each lowered once per module (lowering is slow)."""
    t, gm = _lowered(name)
    return t, copy.deepcopy(gm).graph


@functools.cache
def _lowered(name: str):
    torch.manual_seed(0)
    prog = trace(build(name, n_layers=1), 2, 8)
    t = prog.templates[prog.layers[1].template]
    gm = joint_graph(t, TEMPLATE_SWAPS)[0]
    for n in gm.graph.nodes:
        n.args, n.kwargs = devices_to_marker(n.args), devices_to_marker(n.kwargs)
    return t, gm


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny"])
def test_recompute_stores_fewer_bytes_and_keeps_values(name):
    t, g = _joint(name)
    before = instantiate(g, "cpu")
    _, bytes0 = stored_between_groups(g, FUSIBLE)
    assert recompute_cheap(g, FUSIBLE) >= 1
    _, bytes1 = stored_between_groups(g, FUSIBLE)
    assert bytes1 < bytes0, (bytes0, bytes1)
    # the copies run in their consumers' kernels, never back in the producer's
    p = partition(g, FUSIBLE)
    copies = [n for n in g.nodes if n.meta.get(RECOMPUTE)]
    assert copies
    for grp in p.groups:
        if any(n in grp.nodes for n in copies):
            assert any(not n.meta.get(RECOMPUTE) and any(a in copies for a in n.all_input_nodes) for n in grp.nodes)
    args = [torch.randn(i.spec.shape) for i in t.inputs]
    gout = torch.randn(t.inputs[0].spec.shape) if t.kind == "block" else torch.randn(())
    want, got = before(*args, gout), instantiate(g, "cpu")(*args, gout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same fp32 ops in the same order


def _bf16_value_read_twice(x, w, W):
    """A bf16 value computed by bf16 ops (no explicit cast: rounded where its kernel stores it),
    read again after an anchor by a kernel that also reads ``x``: the second kernel can rebuild it."""
    h = x * x + x * 1.7
    z = ((h * w).view(-1, x.shape[-1]) @ W).view(x.shape)
    return z * h + x


def test_half_precision_values_are_rebuilt_with_their_rounding(tmp_path):
    """A stored bf16 value is rounded at the store: its copy in the consumer ends in an explicit
    cast, so the generated kernels compute bit for bit what they computed with the value stored,
    and the bytes between kernels drop."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mtc.compiler import _fuse

    torch.manual_seed(0)
    x, w, W = torch.randn(2, 8, 16).bfloat16(), torch.randn(16).bfloat16(), torch.randn(16, 16).bfloat16()
    g = make_fx(_bf16_value_read_twice, tracing_mode="fake")(x, w, W).graph
    stored = copy.deepcopy(g)
    _, bytes0 = stored_between_groups(g, FUSIBLE)
    assert recompute_cheap(g, FUSIBLE) >= 1
    _, bytes1 = stored_between_groups(g, FUSIBLE)
    assert bytes1 < bytes0, (bytes0, bytes1)
    copies = [n for n in g.nodes if n.meta.get(RECOMPUTE)]
    last = max(copies, key=list(g.nodes).index)
    assert last.target is torch.ops.aten._to_copy.default and last.kwargs["dtype"] == torch.bfloat16
    got = instantiate(_fuse(g, tmp_path / "rebuilt")[0], "cpu")(x, w, W)
    want = instantiate(_fuse(stored, tmp_path / "stored")[0], "cpu")(x, w, W)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _broadcast_outputs(g) -> list[str]:
    """Group outputs a generated kernel cannot write (the rule `kernels.codegen` checks)."""
    return [o.name for grp in partition(g, FUSIBLE).groups for o in grp.outputs if broadcast_output(o, grp, FUSIBLE)]


def _two_norms(x, w, W):
    """A per-column fp32 value (w cast up) read by two row kernels an anchor keeps apart."""
    wf = w.float()
    xf = x.float()
    h = (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-5) * wf).to(x.dtype)
    z = (h.view(-1, h.shape[-1]) @ W).view(h.shape).float()
    return (z * torch.rsqrt((z * z).mean(-1, keepdim=True) + 1e-5) * wf).to(x.dtype)


def test_a_broadcast_value_other_kernels_read_is_copied_into_them():
    """A group computing a per-column value another kernel reads would have to store it at a
    shape its kernel cannot write (smaller than its iteration shape): that group stayed on ATen
    (bf16 GPT-2's LayerNorm backward did, before row kernels took per-column values in)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w, W = torch.randn(2, 8, 16).bfloat16(), torch.randn(16).bfloat16(), torch.randn(16, 16).bfloat16()
    g = make_fx(_two_norms, tracing_mode="fake")(x, w, W).graph
    before = instantiate(copy.deepcopy(g), "cpu")
    assert _broadcast_outputs(g), "the case this pass exists for is gone from the graph"
    assert copy_broadcast_outputs(g, FUSIBLE) >= 1
    assert _broadcast_outputs(g) == []
    torch.testing.assert_close(instantiate(g, "cpu")(x, w, W), before(x, w, W), rtol=0, atol=0)


def test_norm_backward_pieces_are_rebuilt_from_bf16_inputs():
    """bf16 Llama: the weight-gradient kernel used to store fp32 pieces of the input gradient
    (dy * w * x, dy * w * rstd) and the forward kernel its fp32 input, for the row kernel that
    finishes the input gradient; rebuilt there from the bf16 gradients and inputs, none is
    stored, and no fp32 value of a full row's size crosses between kernels at all."""
    torch.manual_seed(0)
    prog = trace(build("tiny", n_layers=1).to(torch.bfloat16), 2, 8)
    t = prog.templates[prog.layers[1].template]
    g = joint_graph(t, TEMPLATE_SWAPS)[0].graph
    move_views(g, FUSIBLE)
    before = instantiate(copy.deepcopy(g), "cpu")

    def fp32_stored() -> list[str]:
        p = partition(g, FUSIBLE)
        group_of = {n: i for i, grp in enumerate(p.groups) for n in grp.nodes}
        return [o.name for i, grp in enumerate(p.groups) for o in grp.outputs
                if o.meta["val"].dtype == torch.float32 and o.meta["val"].shape == grp.shape
                and any(group_of.get(u, i) != i for u in o.users)]

    assert len(fp32_stored()) >= 4, fp32_stored()
    _, bytes0 = stored_between_groups(g, FUSIBLE)
    assert recompute_cheap(g, FUSIBLE) >= 4
    assert fp32_stored() == []
    _, bytes1 = stored_between_groups(g, FUSIBLE)
    assert bytes1 < bytes0 / 2, (bytes0, bytes1)
    dt = [dtype_from_name(i.spec.dtype) for i in t.inputs]
    args = [torch.randn(i.spec.shape).to(d) for i, d in zip(t.inputs, dt)]
    gout = torch.randn(t.inputs[0].spec.shape).to(dt[0])
    want, got = before(*args, gout), instantiate(g, "cpu")(*args, gout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same ops: the copies compute the same values
