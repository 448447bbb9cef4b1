"""Views moved out of fusion's way: a broadcast sinks below the pointwise ops that read it, a slice
of a pointwise op takes its own copy of the op; kernels merge, values stay bit-identical."""

from __future__ import annotations

import copy

import torch
from mtc.graphs.lower import joint_graph
from mtc.graphs.partition import partition
from mtc.graphs.program import instantiate
from mtc.graphs.views import hoist_slices, move_views, sink_expands
from mtc.kernels.codegen import FUSIBLE
from torch.fx.experimental.proxy_tensor import make_fx

from mtc.compiler import TEMPLATE_SWAPS
from mtc.models import build
from mtc.tracer import trace

aten = torch.ops.aten


def _graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args).graph


def _targets(g) -> list:
    return [n.target for n in g.nodes if n.op == "call_function"]


def _same(g, before, *args):
    got, want = instantiate(g, "cpu")(*args), before(*args)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _mean_grad(x, s):
    """RMSNorm backward's shape: a row sum, expanded to the row, divided, then used pointwise."""
    r = (x * x).sum(-1, keepdim=True)
    return (r.expand(x.shape) / x.shape[-1]) * x + s


def test_an_expanded_row_value_joins_the_row_kernel():
    x, s = torch.randn(3, 5, 12), torch.randn(3, 5, 12)
    g = _graph(_mean_grad, x, s)
    assert aten.expand.default in _targets(g)
    before = instantiate(copy.deepcopy(g), "cpu")
    assert len(partition(g, FUSIBLE).groups) == 2  # the expand splits the reduction from its users
    assert sink_expands(g, FUSIBLE) >= 1
    g.eliminate_dead_code()
    assert aten.expand.default not in _targets(g)
    assert len(partition(g, FUSIBLE).groups) == 1
    _same(g, before, x, s)


def _expand_out(x):
    """An expand whose reader is the graph's output: it must stay materialised at full shape."""
    return x.sum(-1, keepdim=True).expand(x.shape) * 2.0


def test_an_expand_feeding_no_broadcasting_op_stays():
    x = torch.randn(4, 6)
    g = _graph(_expand_out, x)
    before = instantiate(copy.deepcopy(g), "cpu")
    assert sink_expands(g, FUSIBLE) == 0  # mul.Scalar would shrink, and its user is the output
    _same(g, before, x)


def _rope(q, cos, sin):
    """RoPE as Llama writes it: cast up, split the halves, rotate, cat, cast down."""
    qf = q.float()
    a, b = qf.split([q.shape[-1] // 2] * 2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(q.dtype)


def _rope_sliced(q, cos, sin):
    qf = q.transpose(1, 2).float()
    h = q.shape[-1] // 2
    a, b = qf[..., :h], qf[..., h:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(q.dtype)


def test_a_split_cast_runs_in_the_rotary_kernel():
    q, cos, sin = torch.randn(2, 3, 6, 8).bfloat16(), torch.randn(6, 4), torch.randn(6, 4)
    for fn, args in ((_rope, (q, cos, sin)), (_rope_sliced, (q.transpose(1, 2).contiguous(), cos, sin))):
        g = _graph(fn, *args)
        before = instantiate(copy.deepcopy(g), "cpu")
        assert len(partition(g, FUSIBLE).groups) == 2, fn.__name__  # the cast alone, then the rotation
        assert hoist_slices(g, FUSIBLE) == 1
        g.eliminate_dead_code()
        assert len(partition(g, FUSIBLE).groups) == 1, fn.__name__
        _same(g, before, *args)


def _slice_to_matmul(x, w):
    xf = x.float() * 2.0
    return xf[..., :4] @ w, xf[..., 4:] + 1.0


def test_a_slice_read_by_a_matmul_is_left_alone():
    x, w = torch.randn(5, 8), torch.randn(4, 3)
    g = _graph(_slice_to_matmul, x, w)
    assert hoist_slices(g, FUSIBLE) == 0


def test_llama_joint_graph_has_fewer_kernels_and_the_same_values():
    torch.manual_seed(0)
    prog = trace(build("tiny", n_layers=1).to(torch.bfloat16), 2, 8)
    t = prog.templates[prog.layers[1].template]
    g = joint_graph(t, TEMPLATE_SWAPS)[0].graph
    before = instantiate(copy.deepcopy(g), "cpu")
    groups = len(partition(g, FUSIBLE).groups)
    # RoPE: q and k forward and their gradients (4 casts); RMSNorm backward: two expands
    assert move_views(g, FUSIBLE) >= 6
    assert len(partition(g, FUSIBLE).groups) <= groups - 6, (groups, len(partition(g, FUSIBLE).groups))
    args = [torch.randn(i.spec.shape).to(getattr(torch, i.spec.dtype)) for i in t.inputs]
    gout = torch.randn(t.inputs[0].spec.shape).bfloat16()
    want, got = before(*args, gout), instantiate(g, "cpu")(*args, gout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
