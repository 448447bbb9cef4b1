"""Views moved out of fusion's way: a broadcast sinks below the pointwise ops that read it, a slice
of a pointwise op takes its own copy of the op; kernels merge, values stay bit-identical."""

from __future__ import annotations

import copy

import pytest
import torch
from mtc.graphs.lower import joint_graph
from mtc.graphs.partition import partition
from mtc.graphs.program import instantiate
from mtc.graphs.views import (
    drop_contiguous_clones,
    fold_permutes,
    hoist_permutes,
    hoist_slices,
    move_views,
    refresh_view_meta,
    sink_expands,
    sum_through_reshapes,
)
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


def _rope_grad_to_proj(g, cos, sin):
    """RoPE's backward as a Llama block lowers it: the rotation of the (B, H, T, D) gradient in fp32,
    then the (B, T, H * D) layout the projection's weight gradient reads (transpose, copy, view)."""
    gf = g.float()
    a, b = gf[..., :4], gf[..., 4:]
    r = torch.cat([a * cos + b * sin, b * cos - a * sin], dim=-1).to(g.dtype)
    return r.transpose(1, 2).reshape(g.shape[0], g.shape[2], -1)


def test_a_transposed_rotation_runs_in_the_layout_its_reader_wants():
    g, cos, sin = torch.randn(2, 3, 6, 8).bfloat16(), torch.randn(6, 4), torch.randn(6, 4)
    graph = _graph(_rope_grad_to_proj, g, cos, sin)
    before = instantiate(copy.deepcopy(graph), "cpu")
    assert len(partition(graph, FUSIBLE).groups) == 3  # the cast, the rotation, then the transposed copy
    assert hoist_permutes(graph, FUSIBLE) == 1  # the cast back to bf16 first; the rest follows in move_views
    assert move_views(graph, FUSIBLE) >= 8  # the cat, its halves' ops, the slices; and the fp32 cast's split
    assert len(partition(graph, FUSIBLE).groups) == 1
    # what is left of the permutation: one view each of the gradient and of the tables (given the
    # gradient's rank first), read in place, however many ops read them
    perms = [n for n in graph.nodes if n.target in (aten.permute.default, aten.transpose.int)]
    srcs = [n.args[0] if n.args[0].op == "placeholder" else n.args[0].args[0] for n in perms]
    assert sorted(x.name for x in srcs) == ["cos_1", "g_1", "sin_1"], perms
    _same(graph, before, g, cos, sin)


def _transposed_twice(x):
    y = torch.tanh(x) * 2.0
    return y.transpose(-1, -2).contiguous(), y.transpose(1, 2).contiguous()


def _kept_and_transposed(x):
    y = torch.tanh(x) * 2.0
    return y.transpose(1, 2).contiguous(), y + 1.0


def test_a_transpose_of_the_last_dim_or_of_a_value_read_as_it_is_stays():
    x = torch.randn(2, 3, 4, 5)
    for fn in (_transposed_twice, _kept_and_transposed):
        graph = _graph(fn, x)
        assert hoist_permutes(graph, FUSIBLE) == 0, fn.__name__


def _permuted_back(x):
    y = x.permute(0, 2, 1, 3)
    return y.permute(0, 2, 1, 3) * 2.0, y.permute(0, 2, 3, 1) + 1.0


def test_a_permute_of_a_permute_is_one_or_none():
    x = torch.randn(2, 3, 4, 5)
    graph = _graph(_permuted_back, x)
    before = instantiate(copy.deepcopy(graph), "cpu")
    assert fold_permutes(graph) == 2
    graph.eliminate_dead_code()
    perms = [n for n in graph.nodes if n.target is aten.permute.default]
    assert [n.args for n in perms] == [(perms[0].args[0], [0, 1, 3, 2])]  # the cancelled pair is gone; x.permute(P1).permute(P2)
    assert perms[0].args[0].op == "placeholder"
    _same(graph, before, x)


def _clones(x):
    y = x * 2.0
    return y.clone().view(-1) + 1.0, y.transpose(0, 1).contiguous().view(-1), y.clone()


def _protecting_clone(x):
    y = x * 1.5
    z = y.clone()  # keeps y as it is: the in-place op below writes z only
    z.mul_(2.0)
    return y + z


def _returned_view_of_a_clone(x):
    y = x * 2.0
    return y.clone().view(-1), y + 1.0


def test_only_clones_of_contiguous_values_known_and_not_written_or_returned_are_dropped():
    x = torch.randn(3, 4)
    graph = _graph(_clones, x)
    before = instantiate(copy.deepcopy(graph), "cpu")
    n_clones = _targets(graph).count(aten.clone.default)
    assert drop_contiguous_clones(graph, lambda src: False) == 0  # layouts the caller cannot vouch for
    assert drop_contiguous_clones(graph, lambda src: True) == 1  # not the transposed one, not the returned one
    assert _targets(graph).count(aten.clone.default) == n_clones - 1
    _same(graph, before, x)
    for fn in (_protecting_clone, _returned_view_of_a_clone):
        graph = _graph(fn, x)
        before = instantiate(copy.deepcopy(graph), "cpu")
        assert drop_contiguous_clones(graph, lambda src: True) == 0, fn.__name__
        _same(graph, before, x)


def _permuted_and_back(x):
    y = torch.tanh(x) * 2.0
    return y.transpose(1, 2).transpose(1, 2).reshape(-1) + 1.0  # y's layout again: the reshape is a view


def test_a_permute_read_by_a_view_that_needs_the_old_layout_stays():
    x = torch.randn(2, 3, 4, 5)
    graph = _graph(_permuted_and_back, x)
    before = instantiate(copy.deepcopy(graph), "cpu")
    assert hoist_permutes(graph, FUSIBLE) == 0
    move_views(graph, FUSIBLE)
    _same(graph, before, x)


def _transposed(x):
    return (x * 2.0).transpose(1, 2) + 1.0


def _flattened(x):
    return (x * 2.0).view(2, 12) + 1.0


def test_view_meta_follows_a_producers_new_layout_and_says_when_a_view_no_longer_applies():
    graph = _graph(_transposed, torch.randn(2, 3, 4))
    mul = next(n for n in graph.nodes if n.target is aten.mul.Tensor)
    t = next(n for n in graph.nodes if n.target is aten.transpose.int)
    assert not t.meta["val"].is_contiguous()
    # the producer now writes its (2, 3, 4) values as a (2, 4, 3) buffer seen transposed
    mul.meta["val"] = torch.empty(2, 4, 3, device="meta").transpose(1, 2)
    assert refresh_view_meta(graph) == 1
    assert t.meta["val"].is_contiguous()
    graph = _graph(_flattened, torch.randn(2, 3, 4))
    mul = next(n for n in graph.nodes if n.target is aten.mul.Tensor)
    mul.meta["val"] = torch.empty(2, 4, 3, device="meta").transpose(1, 2)  # the flattening view cannot apply
    with pytest.raises(ValueError, match="no longer applies"):
        refresh_view_meta(graph)


def _bias_grad(h, dy, w):
    """An MLP's backward as GPT-2's lowers: an activation's gradient (pointwise), read by the
    matmul through its 2-D view and summed over that view's rows (the bias gradient)."""
    g = dy * torch.tanh(h) * h + dy
    flat = g.view(-1, g.shape[-1])
    return flat @ w, flat.sum(0, keepdim=True), flat.sum(0)


def test_a_bias_gradient_sums_in_the_kernel_that_makes_its_input():
    h, dy, w = torch.randn(2, 6, 16), torch.randn(2, 6, 16), torch.randn(16, 5)
    g = _graph(_bias_grad, h, dy, w)
    before = instantiate(copy.deepcopy(g), "cpu")
    # the activation's gradient, then the two sums of its view: a column kernel that reads it all back
    assert len(partition(g, FUSIBLE).groups) == 2
    assert move_views(g, FUSIBLE) == 2
    assert len(partition(g, FUSIBLE).groups) == 1
    got, want = instantiate(g, "cpu")(h, dy, w), before(h, dy, w)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # the same sums, maybe in another order


def test_a_sum_of_a_reshaped_graph_input_is_left_alone():
    def fn(x):
        return x.view(-1, x.shape[-1]).sum(0, keepdim=True)

    g = _graph(fn, torch.randn(2, 3, 4))
    assert sum_through_reshapes(g, FUSIBLE) == 0  # no kernel makes x: nothing to join


def test_gpt2_bias_gradients_run_in_the_kernels_of_their_inputs(tmp_path):
    """No column kernel of GPT-2's joint graph reads a reshaped output of another generated kernel
    (before: the MLP's and the QKV projection's bias gradients did, two launches and a read-back each)."""
    from mtc.compiler import compile_template

    prog = trace(build("gpt2-tiny", n_layers=1), 2, 8)
    ct = compile_template(prog.templates[prog.layers[1].template], tmp_path, joint_outputs=True)
    kernel_nodes = {n for n in ct.joint_graph.nodes if n.op == "call_function" and hasattr(n.target, "out_specs")}

    def made_by_kernel(a) -> bool:
        while a.op == "call_function" and a.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            a = a.args[0]
        return a.op == "call_function" and a.args and any(x in kernel_nodes for x in a.args if hasattr(x, "op"))

    columns = [n for n in kernel_nodes if n.target.mode == "column"]
    assert columns
    for n in columns:
        for a in n.args:
            if hasattr(a, "op") and a.op == "call_function" and a.target in (aten.view.default, aten._unsafe_view.default):
                assert not made_by_kernel(a), f"{n.name} reads {a.name}, a reshaped kernel output"
