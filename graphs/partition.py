"""Partition a lowered graph (graphs/lower.py) into anchors and fusion groups.

Every call node is classified:

* ``anchor``: matmuls and attention (``mm``, ``addmm``, ``bmm``, SDPA and its backward, mtc's
  hand-tuned ops): left to cuBLAS / hand-tuned kernels;
* ``view``: metadata-only ops (view, permute, expand, slice, ...): no kernel, run as ATen;
* ``fusible``: what the code generator says it can express (`FusibleOps`, owned by
  kernels/codegen.py and handed in): pointwise ops, last-dim cats, and reductions over the last
  dim (row kernels) or over every leading dim (column kernels: weight and bias gradients), or
  both in one kernel where rows are narrow enough to hold whole (a norm's backward: its input
  gradient's row sums and its weight gradient's column sums from one read of the row);
* ``fallback``: anything else (other cats, embedding, gather, ...): run as ATen, and reported.

A fusion group is a maximal connected set of fusible nodes that compute over one iteration
shape (the shape of the group's largest output); groups never contain anchors or views, so
each group becomes one generated kernel. No I/O and no devices here.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from mtc.graphs.program import external_inputs
from torch import fx

__all__ = ["CAT", "RECOMPUTE", "Frame", "FusibleOps", "FusionGroup", "Partition", "arg_frames", "classify", "column_cast",
           "is_column_reduction", "is_row_and_column", "partition"]

aten = torch.ops.aten

ANCHORS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
    aten.scaled_dot_product_attention.default,
}
VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor, aten.select.int,
    aten.alias.default, aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default,
    aten.unbind.int, operator.getitem,
}


@dataclasses.dataclass(frozen=True, slots=True)
class FusibleOps:
    """The ops a code generator can put in a generated kernel; its owner (kernels/codegen.py)
    hands it to `partition`, so the list exists once.

    ``pointwise``: elementwise ops; ``reductions``: sum/mean/amax-like ops over the last dim or
    over every leading dim; ``cat``: whether last-dim cats are computed in place; ``row_and_column``:
    the widest row a kernel that reduces rows and columns at once can hold (0: no such kernels).
    """

    pointwise: frozenset[Any]
    reductions: frozenset[Any]
    cat: bool = True
    row_and_column: int = 0


def classify(node: fx.Node, fusible: FusibleOps) -> str:
    """'anchor', 'view', 'fusible' or 'fallback' (placeholder/output nodes: 'io')."""
    if node.op != "call_function":
        return "io"
    t = node.target
    if t in ANCHORS or str(t).startswith("mtc."):  # mtc's own ops are hand-tuned kernels or attention
        return "anchor"
    if t in VIEWS:
        return "view"
    if t in fusible.pointwise and _tensor_out(node):
        return "fusible"
    if t in fusible.reductions and _tensor_out(node) and (_last_dim_reduction(node) or is_column_reduction(node)):
        return "fusible"
    if fusible.cat and t is CAT and _last_dim_cat(node):
        return "fusible"
    return "fallback"


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


# What a generated kernel computes exactly as ATen does: it computes in fp32 (rounding half-precision
# values where ATen stores them), so float64 math, or integer sums past 2^24, would lose bits
_KERNEL_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.bool})


def _tensor_out(node: fx.Node) -> bool:
    v = _val(node)
    if not isinstance(v, torch.Tensor) or v.dtype not in _KERNEL_DTYPES:
        return False
    # a comparison computes in its inputs' dtype (int64 ids or positions, float64), not its output's
    return v.dtype != torch.bool or all(not isinstance(_val(a), torch.Tensor) or _val(a).dtype in _KERNEL_DTYPES
                                        for a in node.all_input_nodes)


def _last_dim_reduction(node: fx.Node) -> bool:
    r = _reduced_dims(node)
    return r is not None and r[1] == [r[0].dim() - 1]


def _reduced_dims(node: fx.Node) -> tuple[torch.Tensor, list[int]] | None:
    """(input value, sorted reduced dims) of a sum/mean/amax with an explicit dim list, else None."""
    v = _val(node.args[0])
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (node.target is aten.sum.dim_IntList and node.kwargs.get("dtype") is not None):
        return None
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    if not all(isinstance(d, int) for d in dims):
        return None  # not a reduction's dim list (e.g. a binary op's second operand)
    return v, sorted(d % v.dim() for d in dims)


def is_column_reduction(node: fx.Node) -> bool:
    """A reduction over every dim but the last (weight and bias gradients): (..., N) -> (N,)."""
    r = _reduced_dims(node)
    return r is not None and r[0].dim() >= 2 and r[1] == list(range(r[0].dim() - 1))


CAT = aten.cat.default
RECOMPUTE = "mtc_recompute"  # node meta key: a copy made to be recomputed by its consumer (graphs/recompute.py)
Frame = tuple[int, int]  # (first column, width): the window of the iteration shape's last dim a value lives in


def _last_dim_cat(node: fx.Node) -> bool:
    """cat of same-rank, same-dtype float tensors along their last dim (RoPE's rotate_half)."""
    v = _val(node)
    if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point or v.dim() == 0:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if dim % v.dim() != v.dim() - 1 or not isinstance(node.args[0], (list, tuple)):
        return False
    parts = [_val(a) for a in node.args[0]]
    return all(isinstance(x, torch.Tensor) and x.dim() == v.dim() and x.dtype == v.dtype and x.shape[-1] > 0 for x in parts)


def _width(node: fx.Node) -> int:
    v = _val(node)
    return int(v.shape[-1]) if isinstance(v, torch.Tensor) and v.dim() else 1


def arg_frames(node: fx.Node, frame: Frame, full: Frame) -> list[tuple[fx.Node, Frame]]:
    """The frame each input of ``node`` is computed in when ``node`` is computed in ``frame``.

    A cat's i-th input lives in the columns after the inputs before it; every other op reads its
    inputs at the same columns. A value one column wide is the same at every column, so it is
    always computed in the full frame (reductions' outputs, per-row scalars).
    """
    if node.target is CAT:
        out, start = [], frame[0]
        for a in node.args[0]:
            out.append((a, full if _width(a) == 1 else (start, _width(a))))
            start += _width(a)
        return out
    return [(a, full if _width(a) == 1 else frame) for a in node.all_input_nodes]


def _frames(ms: list[fx.Node], shape: tuple[int, ...]) -> dict[fx.Node, set[Frame]]:
    """Every frame each node of a group is computed in (``ms`` in topological order)."""
    inside, full = set(ms), (0, shape[-1])
    frames: dict[fx.Node, set[Frame]] = {m: set() for m in ms}
    for m in reversed(ms):  # users before producers
        if not m.users or any(u not in inside for u in m.users) or _width(m) == 1:
            frames[m].add(full)  # group outputs are stored at the full width
        for f in frames[m]:
            for a, fa in arg_frames(m, f, full):
                if a in inside:
                    frames[a].add(fa)
    return frames


def _broadcasts(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    return len(small) <= len(big) and all(y in (1, x) for x, y in zip(reversed(big), reversed(small)))


def _shapes_ok(ms: list[fx.Node], shape: tuple[int, ...], red: frozenset[Any]) -> bool:
    """Can every node be computed over ``shape`` (a cat's inputs over their column window of it)?"""
    if not any(m.target is CAT for m in ms):
        return all(_compatible(shape, _iter_shape([m], red)) for m in ms)
    if not shape:
        return False
    for m, fs in _frames(ms, shape).items():
        s = tuple(_val(m).shape)
        if m.target in red and fs != {(0, shape[-1])}:
            return False  # reductions run over whole rows / columns only
        if not all(_broadcasts(s, (*shape[:-1], w)) for _, w in fs):
            return False
    return True


@dataclasses.dataclass(slots=True)
class FusionGroup:
    """Connected fusible nodes sharing one iteration shape ``shape``; ``reduces`` if any reduction."""

    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    shape: tuple[int, ...]
    reduces: bool

    @property
    def name(self) -> str:
        """A readable name (first node's)."""
        return f"group_{self.nodes[0].name}"


@dataclasses.dataclass(slots=True)
class Partition:
    """How a graph splits into kernels."""

    graph: fx.Graph
    groups: list[FusionGroup]
    anchors: list[fx.Node]
    fallbacks: list[fx.Node]
    views: list[fx.Node]

    def aten_ops(self) -> int:
        """Ops that launch a kernel when the graph runs unfused (views launch none and are left out)."""
        return len(self.anchors) + len(self.fallbacks) + sum(len(g.nodes) for g in self.groups)

    def kernels(self) -> int:
        """Kernel launches after fusion: a kernel per group, anchor and fallback (views launch none)."""
        return len(self.groups) + len(self.anchors) + len(self.fallbacks)

    def fallback_ops(self) -> Counter[str]:
        """Which ops stay on ATen because no generated kernel covers them."""
        return Counter(str(n.target) for n in self.fallbacks)


def _iter_shape(nodes: list[fx.Node], red: frozenset[Any]) -> tuple[int, ...]:
    best: tuple[int, ...] = ()
    for n in nodes:
        v = _val(n)
        shapes = [tuple(v.shape)] if isinstance(v, torch.Tensor) else []
        if n.target in red:
            shapes.append(tuple(_val(n.args[0]).shape))
        for s in shapes:
            if _numel(s) > _numel(best):
                best = s
    return best


def _numel(s: tuple[int, ...]) -> int:
    n = 1
    for d in s:
        n *= d
    return n


def _compatible(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Can tensors of shapes a and b be computed in one iteration space (one broadcasts to the other)?"""
    big, small = (a, b) if _numel(a) >= _numel(b) else (b, a)
    if len(small) > len(big):
        return False
    for x, y in zip(reversed(big), reversed(small)):
        if y not in (1, x):
            return False
    return True


def partition(graph: fx.Graph, fusible: FusibleOps) -> Partition:
    """Group fusible nodes: union connected fusible neighbours whose iteration shapes agree.

    A reduction's output (…, 1) joins its input's group (the row kernel broadcasts it back); two
    groups merge only if the merged group still has one iteration shape and no cycle forms
    through the nodes and groups outside it (a group must not both feed and consume an outside
    node, directly or through another group).
    """
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    kind = {n: classify(n, fusible) for n in nodes}
    red = fusible.reductions
    group_of: dict[fx.Node, int] = {}
    members: dict[int, list[fx.Node]] = {}
    shape_of: dict[int, tuple[int, ...]] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    next_id = 0
    for n in nodes:
        if kind[n] != "fusible":
            continue
        gid, next_id = next_id, next_id + 1
        group_of[n], members[gid] = gid, [n]
        shape_of[gid] = _iter_shape([n], red)
        # try to join the groups of fusible producers (in order), if shapes agree and no cycle;
        # a recomputed copy never joins its producers' group (it exists to run in its consumer's)
        for a in n.all_input_nodes:
            if a not in group_of or group_of[a] == group_of[n]:
                continue
            if n.meta.get(RECOMPUTE) and not a.meta.get(RECOMPUTE):
                continue
            ga, gn = group_of[a], group_of[n]
            merged = members[ga] + members[gn]
            shape = _iter_shape(merged, red)
            if not _shapes_ok(merged, shape, red):
                continue
            if any(m.target in red for m in merged) and not _reductions_ok(merged, shape, red, fusible.row_and_column):
                continue
            if _creates_cycle(set(merged), group_of, members):
                continue
            for m in members[gn]:
                group_of[m] = ga
            members[ga] = sorted(merged, key=order.__getitem__)
            shape_of[ga] = shape
            del members[gn], shape_of[gn]
    _merge_sibling_columns(members, shape_of, red, order)
    if fusible.row_and_column:
        _merge_sibling_rows_and_columns(members, shape_of, red, order, fusible.row_and_column)
    _merge_sibling_pointwise(members, shape_of, red, order, fusible.row_and_column)
    groups = []
    for gid, ms in members.items():
        inside = set(ms)
        ins = external_inputs(ms)
        outs = [m for m in ms if any(u not in inside for u in m.users)]
        groups.append(FusionGroup(ms, ins, outs, shape_of[gid], any(m.target in red for m in ms)))
    groups.sort(key=lambda g: order[g.nodes[0]])
    return Partition(
        graph=graph,
        groups=groups,
        anchors=[n for n in nodes if kind[n] == "anchor"],
        fallbacks=[n for n in nodes if kind[n] == "fallback"],
        views=[n for n in nodes if kind[n] == "view"],
    )


def _merge_siblings(members: dict[int, list[fx.Node]], shape_of: dict[int, tuple[int, ...]], order: dict[fx.Node, int],
                    candidates: list[int], related: Callable[[int, int], bool],
                    ok: Callable[[list[fx.Node], tuple[int, ...]], bool]) -> None:
    """Merge pairs of ``candidates`` over one shape that are ``related`` (they share an input),
    where the merged group is ``ok`` over that shape and forms no cycle. Unconnected groups are
    siblings only here; everything else merges through a shared node in `partition`."""
    group_of = {m: g for g, ms in members.items() for m in ms}
    for i, ga in enumerate(candidates):
        if ga not in members:
            continue
        for gb in candidates[i + 1:]:
            if gb not in members or shape_of[gb] != shape_of[ga] or not related(ga, gb):
                continue
            merged = sorted(members[ga] + members[gb], key=order.__getitem__)
            if not ok(merged, shape_of[ga]) or _creates_cycle(set(merged), group_of, members):
                continue
            for m in members[gb]:
                group_of[m] = ga
            members[ga] = merged
            del members[gb], shape_of[gb]


def _merge_sibling_columns(members: dict[int, list[fx.Node]], shape_of: dict[int, tuple[int, ...]], red: frozenset[Any],
                           order: dict[fx.Node, int]) -> None:
    """Column-reduction groups over one shape that read a common input become one group: a norm's
    weight and bias gradients (sum(dy * xhat) and sum(dy)) then read dy once, in one launch."""
    _merge_siblings(members, shape_of, order, [g for g in members if _column_group(members[g], red)],
                    lambda ga, gb: bool(set(external_inputs(members[ga])) & set(external_inputs(members[gb]))),
                    lambda ms, shape: _reductions_ok(ms, shape, red))


def _big_inputs(members: dict[int, list[fx.Node]], shape_of: dict[int, tuple[int, ...]], g: int) -> set[fx.Node]:
    """The inputs of group ``g`` as large as its iteration shape (what a merge reads once, not twice)."""
    n = _numel(shape_of[g])
    return {a for a in external_inputs(members[g]) if isinstance(_val(a), torch.Tensor) and _val(a).numel() == n}


def _merge_sibling_rows_and_columns(members: dict[int, list[fx.Node]], shape_of: dict[int, tuple[int, ...]],
                                    red: frozenset[Any], order: dict[fx.Node, int], row_and_column: int) -> None:
    """A row group and a column group over one shape that read a common full-size input become one
    row-and-column group: with the normalised input fused into the matmuls, a norm's weight
    gradient (a column sum) and its input gradient (row sums) no longer share a node, only the
    incoming gradient and the norm's input, which one kernel then reads once."""
    def reduces(g: int) -> bool:
        return any(m.target in red for m in members[g])

    _merge_siblings(members, shape_of, order, [g for g in members if shape_of[g] and reduces(g)],
                    lambda ga, gb: (_column_group(members[ga], red) != _column_group(members[gb], red)
                                    and bool(_big_inputs(members, shape_of, ga) & _big_inputs(members, shape_of, gb))),
                    lambda ms, shape: _shapes_ok(ms, shape, red) and _reductions_ok(ms, shape, red, row_and_column))


def _merge_sibling_pointwise(members: dict[int, list[fx.Node]], shape_of: dict[int, tuple[int, ...]], red: frozenset[Any],
                             order: dict[fx.Node, int], row_and_column: int = 0) -> None:
    """Pointwise groups over one shape that read a common full-size input become one group, when
    neither feeds the other through outside nodes: SwiGLU's backward recomputes silu(gate) * up
    for the down projection's weight gradient, and computes the gate's and up's gradients, from
    the same three tensors; one kernel reads them once instead of twice. One of the two may be a
    column group (its kernel then also stores the other's full-size outputs): GPT-2's GELU
    backward sums its bias gradient as it goes, beside the GELU the weight gradient recomputes."""
    def big_inputs(g: int) -> set[fx.Node]:
        return _big_inputs(members, shape_of, g)

    def pointwise(g: int) -> bool:
        return not any(m.target in red for m in members[g])

    def ok(ms: list[fx.Node], shape: tuple[int, ...]) -> bool:
        return _shapes_ok(ms, shape, red) and (not any(m.target in red for m in ms) or _reductions_ok(ms, shape, red, row_and_column))

    _merge_siblings(members, shape_of, order,
                    [g for g in members if shape_of[g] and (pointwise(g) or _column_group(members[g], red))],
                    lambda ga, gb: (pointwise(ga) or pointwise(gb)) and bool(big_inputs(ga) & big_inputs(gb)), ok)


def _column_group(ms: list[fx.Node], red: frozenset[Any]) -> bool:
    """Whether the group's reductions are all column reductions (and it has one)."""
    reds = [m for m in ms if m.target in red]
    return bool(reds) and all(is_column_reduction(m) for m in reds)


def _reductions_ok(ms: list[fx.Node], shape: tuple[int, ...], red: frozenset[Any], row_and_column: int = 0) -> bool:
    """A group reduces rows (a row kernel), columns (a column kernel), or both where its rows are
    at most ``row_and_column`` wide: a kernel that walks whole rows, reducing each, and sums the
    column reductions' inputs across the rows it walked (`is_row_and_column`)."""
    column = [m for m in ms if m.target in red and is_column_reduction(m)]
    if not column:
        return _row_ok(ms, shape, red)
    if len(column) == sum(1 for m in ms if m.target in red):
        return _column_ok(ms, column, shape, red)
    if not shape or shape[-1] > row_and_column or not _column_ok(ms, column, shape, red):
        return False
    ends = set(column) | {m for m in ms if column_cast(m, red) is not None}
    return _row_ok([m for m in ms if m not in ends], shape, red)


def is_row_and_column(nodes: list[fx.Node], reductions: frozenset[Any]) -> bool:
    """Whether a group of ``nodes`` reduces both rows (last dim) and columns (every leading dim)."""
    reds = [m for m in nodes if m.target in reductions]
    return any(is_column_reduction(m) for m in reds) and not all(is_column_reduction(m) for m in reds)


def _column_ok(ms: list[fx.Node], column: list[fx.Node], shape: tuple[int, ...], red: frozenset[Any]) -> bool:
    """Column reductions read the whole iteration shape and end the group (their (N,) results are
    complete only after the last row, so nothing in the same kernel may use them), but for a cast
    of the result (`column_cast`): the second stage that combines the chunks casts as it writes."""
    inside = set(ms)
    for c in column:
        if tuple(_val(c.args[0]).shape) != shape:
            return False
        if any(u in inside and column_cast(u, red) is not c for u in c.users):
            return False
    return not any(column_cast(m, red) is not None and any(u in inside for u in m.users) for m in ms)


def column_cast(node: fx.Node, reductions: frozenset[Any]) -> fx.Node | None:
    """The column reduction (one of ``reductions``) ``node`` only casts (its sole user, a plain
    dtype cast), else None: a LayerNorm's weight and bias gradients are summed in fp32 and cast to
    the weight's dtype."""
    if node.target is not aten._to_copy.default or len(node.args) != 1 or set(node.kwargs) - {"dtype"}:
        return None
    src = node.args[0]
    if not isinstance(src, fx.Node) or src.target not in reductions or len(src.users) != 1 or not is_column_reduction(src):
        return None
    return src


def _row_ok(ms: list[fx.Node], shape: tuple[int, ...], red: frozenset[Any]) -> bool:
    """With a reduction in the group, every node must be a full row (…, N), a reduced row (…, 1),
    a per-column value (N,) (or, upstream of a cat, a full row of its column window (…, W))."""
    if not shape:
        return False
    rows = shape[:-1]
    widths = _frames(ms, shape) if any(m.target is CAT for m in ms) else {}
    for m in ms:
        s = tuple(_val(m).shape)
        if m.target in red:
            keep = (m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False))
            if not keep or s != (*rows, 1):
                return False
        elif s not in (shape, (*rows, 1), *((*rows, w) for _, w in widths.get(m, ()))) and not _per_column(s, shape):
            # not a full row, a per-row scalar (e.g. rsqrt(mean + eps)), a cat's part, or a
            # per-column value every row reads alike (a norm's weight cast to fp32)
            return False
    return True


def _per_column(s: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A value of one row's width that broadcasts over every row: (N,), (1, N), (1, 1, N), ..."""
    return 0 < len(s) <= len(shape) and s[-1] == shape[-1] and all(d == 1 for d in s[:-1])


def _creates_cycle(group: set[fx.Node], group_of: dict[fx.Node, int], members: dict[int, list[fx.Node]]) -> bool:
    """True if some path leaves ``group`` and comes back (it could not run as one kernel).

    The other groups (``members``, found through ``group_of``) count as the kernels they become:
    each runs once all of its inputs are ready, so a path that enters one at any of its nodes
    leaves from all of them. A group joined from siblings, or through one edge, may hold two nodes
    with no path between them, so a path through it may come back where the graph's own edges do
    not (a parallel block's gated sum beside the gate's gradient; q and k norms before rotary
    embeddings). Topological position bounds nothing: a group's nodes may lie anywhere.
    """
    frontier = [u for n in group for u in n.users if u not in group]
    seen: set[fx.Node] = set()
    while frontier:
        x = frontier.pop()
        if x in seen:
            continue
        g = group_of.get(x)
        unit = members[g] if g is not None and g in members else [x]
        seen.update(unit)
        for y in unit:
            for u in y.users:
                if u in group:
                    return True
                if u not in seen:
                    frontier.append(u)
    return False
