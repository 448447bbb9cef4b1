"""Move views out of the way of fusion: sink broadcasts below pointwise ops, hoist slices above them.

`partition` never puts a view in a fusion group (a view launches no kernel), so a view between
two fusible ops splits them into two kernels, and the producer's whole output goes through
memory. Two shapes of this show up in every decoder block's joint graph:

* **A broadcast** (``expand``) of a per-row value into a pointwise op: RMSNorm's backward
  expands the row sum ``(…, 1)`` to ``(…, N)`` before dividing it by N. The row-reduction
  kernel stops at the expand, and the pointwise rest of the input gradient runs as a kernel of
  its own, reading back the fp32 values the reduction kernel's producers wrote for it. Pointwise
  ops broadcast their inputs anyway: the expand is dropped where another input has the full
  shape, and moved below the op where none has (the op then runs on the small shape). The row
  kernel then computes the sum and the gradient in one pass.
* **A slice** of a pointwise op's output: RoPE casts q (and k, and in the backward their
  gradients) to fp32 and splits (or slices) off the halves for ``rotate_half``. The cast runs as a kernel of its
  own writing the fp32 tensor, and the rotary kernel reads it back. When every user of the op is
  a last-dim slice that feeds fusible ops, each slice takes its own copy of the op over the
  matching slices of the op's inputs, and the copy runs inside the consumer's kernel.

* **An alias.** ``alias`` is the identity (autograd leaves them where a backward formula reads
  its forward's output, e.g. RMSNorm's ``rsqrt``): the per-row value a row kernel stores reached
  the input gradient's pointwise ops through two of them, and that pointwise part ran as a kernel
  of its own. Ops read the aliased value directly instead.

* **A transpose of a pointwise op's output.** RoPE's backward rotates the gradients of q and
  k in the attention's (B, H, T, D) layout, and the projections' weight gradients read them
  back as (B, T, H*D): a transpose, whose copy ran as a kernel of its own after the rotary
  kernel (Llama's dq and dk: two launches, 80 MB through memory per 8192-token call). A
  permutation that keeps the last dim moves to the op's inputs instead (each read through its
  strides, in runs of the last dim), so the op runs in the layout its readers want and the copy
  joins its kernel. Cats and slices along the last dim pass it on the same way.

* **A reshape under a column sum.** A linear layer's bias gradient sums the incoming gradient
  over every row of its ``(B*T, N)`` view, the view the matmuls read. The column kernel reads the
  view, so it cannot join the kernel that produced the ``(B, T, N)`` gradient, and reads all of it
  back (GPT-2's MLP and QKV bias gradients: 184 MB per block call at 8192 tokens). The sum reads
  the producer's value directly instead, over its leading dims (the same elements per column).

The rewrites keep every value: the ops compute the same elements from the same inputs; only
where (in which kernel) they are computed changes. Pure graph surgery: no I/O, no devices.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable

import torch
from mtc.graphs.partition import CAT, FusibleOps, classify
from torch import fx

__all__ = ["compute_in_source_layout", "drop_aliases", "drop_contiguous_clones", "fold_permutes", "hoist_permutes", "hoist_slices",
           "move_views", "refresh_view_meta", "sink_expands", "splits_to_slices", "sum_through_reshapes", "view_root"]

aten = torch.ops.aten

# pointwise ops whose output is not the broadcast of their inputs (copy_'s is its destination's shape)
_NOT_BROADCAST = frozenset({aten.copy.default})


def _val(n: object) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _broadcasting(n: fx.Node, fusible: FusibleOps) -> bool:
    """A fusible pointwise op whose output shape is the broadcast of its tensor arguments'."""
    return (n.op == "call_function" and n.target in fusible.pointwise and n.target not in _NOT_BROADCAST
            and classify(n, fusible) == "fusible" and not any(isinstance(v, fx.Node) for v in n.kwargs.values()))


def _out_shape(args: tuple, fallback: torch.Size) -> torch.Size:
    """The broadcast shape of the tensor arguments (a scalar-only call keeps ``fallback``)."""
    shapes = [_val(a).shape for a in args if _val(a) is not None]
    return torch.broadcast_shapes(*shapes) if shapes else fallback


def _meta(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _expand_source(a: object) -> fx.Node | None:
    """``x`` when ``a`` is ``expand(x, …)`` of a tensor that broadcasts to ``a``'s shape."""
    if not (isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.expand.default):
        return None
    x = a.args[0]
    vx, va = _val(x), _val(a)
    if vx is None or va is None:
        return None
    try:
        ok = torch.broadcast_shapes(vx.shape, va.shape) == va.shape
    except RuntimeError:
        return None
    return x if ok else None


def sink_expands(graph: fx.Graph, fusible: FusibleOps) -> int:
    """Drop each ``expand`` a broadcasting pointwise op reads where the op's other inputs give the
    full shape anyway; where they do not, run the op on the unexpanded value and expand its result
    instead (then its users get the same treatment). Returns the rewrites made."""
    done = 0
    for n in list(graph.nodes):
        if not _broadcasting(n, fusible):
            continue
        srcs = {a: x for a in n.args if (x := _expand_source(a)) is not None}
        if not srcs:
            continue
        vn = _val(n)
        new_args = tuple(srcs.get(a, a) if isinstance(a, fx.Node) else a for a in n.args)
        shape = _out_shape(new_args, vn.shape)
        if shape == vn.shape:
            n.args = new_args
            done += 1
            continue
        # the op would shrink: compute it on the small shape and broadcast its result, but only
        # when every user is itself a broadcasting op (the expand then sinks further or vanishes;
        # an anchor or the graph output keeps a materialised value)
        if not n.users or not all(_broadcasting(u, fusible) for u in n.users):
            continue
        with graph.inserting_before(n):
            small = graph.call_function(n.target, new_args, dict(n.kwargs))
            small.meta = {**n.meta, "val": _meta(shape, vn.dtype)}
            big = graph.call_function(aten.expand.default, (small, list(vn.shape)))
            big.meta = {**n.meta, "val": _meta(shape, vn.dtype).expand(vn.shape)}
        n.replace_all_uses_with(big)
        graph.erase_node(n)
        done += 1
    return done


def _last_dim(v: torch.Tensor, dim: int) -> bool:
    return v.dim() > 0 and dim % v.dim() == v.dim() - 1


def _windows(u: fx.Node, v: torch.Tensor) -> list[tuple[fx.Node, tuple[int, int]]] | None:
    """The column windows user ``u`` takes of ``v``'s last dim, each with the node that stands for
    it: a step-1 ``slice`` (itself), or a ``split`` whose every user is a ``getitem`` (those);
    None for any other user."""
    if u.op != "call_function":
        return None
    n = v.shape[-1] if v.dim() else 0
    if u.target is aten.slice.Tensor:
        dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)
        start = u.args[2] if len(u.args) > 2 else u.kwargs.get("start")
        end = u.args[3] if len(u.args) > 3 else u.kwargs.get("end")
        step = u.args[4] if len(u.args) > 4 else u.kwargs.get("step", 1)
        if not _last_dim(v, dim) or step != 1:
            return None
        start, end = (0 if start is None else start), (sys.maxsize if end is None else end)
        start, end = max(0, start + n if start < 0 else start), min(n, end + n if end < 0 else end)
        return [(u, (start, end))] if start < end else None
    if u.target in (aten.split_with_sizes.default, aten.split.Tensor):
        dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
        if not _last_dim(v, dim) or not all(g.target is operator.getitem for g in u.users):
            return None
        size = u.args[1]
        sizes = list(size) if isinstance(size, (list, tuple)) else [size] * -(-n // size)
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return [(g, (bounds[g.args[1]], min(n, bounds[g.args[1] + 1]))) for g in u.users]
    return None


def hoist_slices(graph: fx.Graph, fusible: FusibleOps) -> int:
    """Give each last-dim slice (or split piece) of a broadcasting pointwise op its own copy of the
    op over the same slice of the op's inputs, when every user of the op is such a slice and every slice
    feeds only fusible ops (so each copy runs inside its consumer's kernel and the op's full
    output is never stored). Returns the ops rewritten."""
    done = 0
    for a in list(graph.nodes):
        if not _broadcasting(a, fusible) or not a.users:
            continue
        va = _val(a)
        if va is None or va.dim() == 0:
            continue
        found = [_windows(u, va) for u in a.users]
        if any(w is None for w in found):
            continue
        windows = dict(w for ws in found for w in ws)
        if not windows or not all(classify(u, fusible) == "fusible" for s in windows for u in s.users):
            continue
        splits = [u for u in a.users if u.target is not aten.slice.Tensor]
        n_cols = va.shape[-1]
        for s, (start, end) in windows.items():
            with graph.inserting_before(s):
                args = []
                for x in a.args:
                    vx = _val(x)
                    # inputs one column wide (or of lower rank, broadcast in front) read the same at every column
                    if vx is None or vx.dim() == 0 or vx.shape[-1] == 1:
                        args.append(x)
                        continue
                    if vx.shape[-1] != n_cols:
                        raise AssertionError(f"{a.name}: input {x.name} of width {vx.shape[-1]} broadcast to {n_cols}")
                    part = graph.call_function(aten.slice.Tensor, (x, vx.dim() - 1, start, end))
                    part.meta = {**_untagged(x), "val": vx[..., start:end]}
                    args.append(part)
                copy = graph.call_function(a.target, tuple(args), dict(a.kwargs))
                copy.meta = {**a.meta, "val": _meta((*va.shape[:-1], end - start), va.dtype)}
            s.replace_all_uses_with(copy)
            graph.erase_node(s)
        for sp in splits:
            graph.erase_node(sp)
        graph.erase_node(a)
        done += 1
    return done


_PERMUTES = frozenset({aten.permute.default, aten.transpose.int})


def _perm_dims(t: fx.Node) -> list[int] | None:
    """The full dims of a permute or transpose node (None for any other node)."""
    if t.op != "call_function" or t.target not in _PERMUTES:
        return None
    v = _val(t.args[0])
    if v is None:
        return None
    r = v.dim()
    if t.target is aten.permute.default:
        return [int(d) % r for d in t.args[1]]
    dims = list(range(r))
    i, j = int(t.args[1]) % r, int(t.args[2]) % r
    dims[i], dims[j] = dims[j], dims[i]
    return dims


def _permutation(t: fx.Node) -> tuple[int, ...] | None:
    """The dims of a permute (or transpose) node that moves some leading dim and keeps the last
    dim last (a kernel then reads its inputs in runs of the last dim); None for anything else."""
    dims = _perm_dims(t)
    if dims is None or len(dims) < 3:
        return None
    return tuple(dims) if dims[-1] == len(dims) - 1 and dims != list(range(len(dims))) else None


def _last_dim_slice(n: fx.Node) -> bool:
    if n.op != "call_function" or n.target is not aten.slice.Tensor:
        return False
    v, dim = _val(n.args[0]), (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0))
    step = n.args[4] if len(n.args) > 4 else n.kwargs.get("step", 1)
    return v is not None and _last_dim(v, dim) and step == 1 and not n.kwargs


_HOISTED = "hoisted_permutation"  # meta key of the views `_permuted` makes: the dims of a permute, "lead" of a view


def _untagged(n: fx.Node) -> dict:
    """``n``'s meta without `_HOISTED` (a node made from another is not one of `_permuted`'s views)."""
    return {k: v for k, v in n.meta.items() if k != _HOISTED}


def _permuted(graph: fx.Graph, x: object, dims: tuple[int, ...]) -> object:
    """``x`` permuted by ``dims``: a tensor node of lower rank is first viewed with leading size-1
    dims (as broadcasting would); scalars and 0-dim values stay. The views go right after ``x``
    (after the graph's inputs, for an input), and later readers share them: an eager graph runs
    each view as an ATen call, and RoPE's cos and sin tables each have four readers."""
    vx = _val(x)
    if vx is None or vx.dim() == 0 or not isinstance(x, fx.Node):
        return x
    lead = len(dims) - vx.dim()
    shape = [1] * lead + list(vx.shape)
    # made before, for another reader: tagged (so placed right after x) and the same view
    src = next((u for u in x.users if u.meta.get(_HOISTED) == "lead" and u.target is aten.view.default
                and list(u.args[1]) == shape), None) if lead else x
    if src is not None:
        made = next((u for u in src.users if u.meta.get(_HOISTED) == dims and u.target is aten.permute.default
                     and list(u.args[1]) == list(dims)), None)
        if made is not None:
            return made
    if x.op == "placeholder":
        after = [n for n in graph.nodes if n.op == "placeholder"][-1]
    else:
        after = x
    if src is None:
        with graph.inserting_after(after):
            src = graph.call_function(aten.view.default, (x, shape))
        src.meta = {**_untagged(x), "val": vx.view(shape), _HOISTED: "lead"}
        after = src
    elif src is not x:
        after = src
    with graph.inserting_after(after):
        p = graph.call_function(aten.permute.default, (src, list(dims)))
    p.meta = {**_untagged(x), "val": _val(src).permute(dims), _HOISTED: dims}
    return p


def _takes_any_layout(r: fx.Node, fusible: FusibleOps, any_layout: Callable[[fx.Node, fx.Node], bool] | None) -> bool:
    """Whether a reader of a permuted value works whatever that value's strides: a fusible op (its
    kernel reads through strides), or a permute whose every reader is a fusible op or one that
    ``any_layout`` accepts (not a view that needs contiguity: a permute of the permuted value puts
    the old layout back, which is no longer contiguous once the op writes the permuted one)."""
    if r.op == "call_function" and classify(r, fusible) == "fusible":
        return True
    if r.op != "call_function" or r.target not in _PERMUTES:
        return False
    return all(rr.op == "call_function" and (classify(rr, fusible) == "fusible" or (any_layout is not None and any_layout(rr, r)))
               for rr in r.users)


def hoist_permutes(graph: fx.Graph, fusible: FusibleOps, any_layout: Callable[[fx.Node, fx.Node], bool] | None = None) -> int:
    """Move a permutation that keeps the last dim (`_permutation`) from the output of a
    broadcasting pointwise op, a last-dim cat or a last-dim slice to its inputs, when every user
    of the op is such a permutation (the same one) and every reader of those takes any layout
    (`_takes_any_layout`; ``any_layout`` names readers beyond fusible ops that do): the op then
    computes its values in the permuted layout from permuted views of its inputs. Returns the
    ops rewritten."""
    done = 0
    for a in list(graph.nodes):
        if a.op != "call_function" or not a.users:
            continue
        perms = {_permutation(u) for u in a.users}
        if len(perms) != 1 or None in perms:
            continue
        (dims,) = perms
        va = _val(a)
        if va is None or va.dim() != len(dims):
            continue
        if not all(_takes_any_layout(r, fusible, any_layout) for u in a.users for r in u.users):
            continue
        kind = _hoist_kind(a, fusible)
        if kind is None:
            continue
        shape = [va.shape[d] for d in dims]
        with graph.inserting_before(a):
            if kind == "slice":  # a view: it stays one, over the permuted source
                new = graph.call_function(aten.slice.Tensor, (_permuted(graph, a.args[0], dims), len(dims) - 1, *a.args[2:]))
                new.meta = {**a.meta, "val": va.permute(dims)}
            elif kind == "cat":
                new = graph.call_function(CAT, ([_permuted(graph, x, dims) for x in a.args[0]], len(dims) - 1))
                new.meta = {**a.meta, "val": _meta(shape, va.dtype)}
            else:
                new = graph.call_function(a.target, tuple(_permuted(graph, x, dims) for x in a.args), dict(a.kwargs))
                new.meta = {**a.meta, "val": _meta(shape, va.dtype)}
        for u in list(a.users):
            u.replace_all_uses_with(new)
            graph.erase_node(u)
        graph.erase_node(a)
        done += 1
    return done


def _hoist_kind(n: fx.Node, fusible: FusibleOps) -> str | None:
    """How `hoist_permutes` moves a permutation through ``n``: a last-dim "slice", a last-dim "cat"
    of same-rank values, a broadcasting "pointwise" op; None: it does not."""
    if _last_dim_slice(n):
        return "slice"
    va = _val(n)
    if n.op == "call_function" and n.target is CAT and not n.kwargs and va is not None:
        same_rank = all(_val(x) is not None and _val(x).dim() == va.dim() for x in n.args[0])
        return "cat" if same_rank and _last_dim(va, n.args[1] if len(n.args) > 1 else 0) else None
    return "pointwise" if _broadcasting(n, fusible) else None


def _source_chain(x: fx.Node, fusible: FusibleOps) -> tuple[set[fx.Node], set[tuple[int, ...]]] | None:
    """The ops between ``x`` and the permuted views it is computed from (x included), and those
    views' permutations; None when an op on the way is one `hoist_permutes` cannot move through."""
    chain: set[fx.Node] = set()
    perms: set[tuple[int, ...]] = set()
    todo = [x]
    while todo:
        n = todo.pop()
        if n in chain:
            continue
        dims = _permutation(n)
        if dims is not None:
            perms.add(dims)
            continue
        if n.op != "call_function" or (classify(n, fusible) != "fusible" and not _last_dim_slice(n)):
            continue  # an input of the chain read as it is (a graph input, an anchor's output, a broadcast table)
        if _hoist_kind(n, fusible) is None:
            return None
        chain.add(n)
        todo += [a for a in n.all_input_nodes if _val(a) is not None and _val(a).dim() == _val(n).dim()]
    return chain, perms


def _to_fixpoint(rewrite: Callable[[], int]) -> int:
    """Run ``rewrite`` (returning how many rewrites it made) until it makes none; the total."""
    total = 0
    while (n := rewrite()) > 0:
        total += n
    return total


def compute_in_source_layout(graph: fx.Graph, fusible: FusibleOps, any_layout: Callable[[fx.Node, fx.Node], bool]) -> int:
    """Compute each value that only layout-agnostic readers take (``any_layout(reader, value)``: the
    reader accepts the value in any strides, e.g. attention's q and k) in the layout of the views it
    is computed from, and hand the readers a permuted view of it. RoPE's q and k are computed from
    the projections' (B, T, H, D) outputs seen as (B, H, T, D): the rotary kernel then writes them
    (B, T, H, D), attention's output follows q's layout, and the transpose back to (B, T, H * D)
    for the output projection is a view where it was a copy (`drop_contiguous_clones`). Only where
    the whole chain of ops moves (`hoist_permutes`: each op's only readers are the next ones, one
    permutation on every view it starts from); returns the values rewritten. Run
    `refresh_view_meta` on the graph once the readers' values are refreshed too. Splits become
    slices and slices of pointwise ops are hoisted first (`splits_to_slices`, `hoist_slices`: RoPE
    splits q, or its fp32 cast, in halves), so the chains reach the views."""
    splits_to_slices(graph)
    _to_fixpoint(lambda: hoist_slices(graph, fusible))
    done = 0
    for x in list(graph.nodes):
        if x.op != "call_function" or not x.users or classify(x, fusible) != "fusible":
            continue
        if not all(any_layout(u, x) for u in x.users):
            continue
        found = _source_chain(x, fusible)
        if found is None or len(found[1]) != 1:
            continue
        chain, (dims,) = found[0], tuple(found[1])
        if any(u not in chain for n in chain - {x} for u in n.users):
            continue  # some op of the chain is read outside it: the permutation would stop there
        inv = tuple(sorted(range(len(dims)), key=lambda d: dims[d]))
        vx = _val(x)
        with graph.inserting_after(x):
            back = graph.call_function(aten.permute.default, (x, list(inv)))
        back.meta = {**x.meta, "val": vx.permute(inv)}
        with graph.inserting_after(back):
            view = graph.call_function(aten.permute.default, (back, list(dims)))
        view.meta = {**x.meta, "val": vx}
        for u in list(x.users):
            if u is not back:
                u.replace_input_with(x, view)
        done += 1
    if done:
        _to_fixpoint(lambda: hoist_permutes(graph, fusible, any_layout))
        fold_permutes(graph)
        graph.eliminate_dead_code()
        graph.lint()
    return done


def splits_to_slices(graph: fx.Graph) -> int:
    """Each last-dim ``split`` whose every user picks a piece (``getitem``) becomes one ``slice``
    per piece (the same views, each its own node, which the rewrites here move); returns the
    splits rewritten."""
    done = 0
    for sp in list(graph.nodes):
        if sp.op != "call_function" or sp.target not in (aten.split_with_sizes.default, aten.split.Tensor):
            continue
        v = _val(sp.args[0])
        found = _windows(sp, v) if v is not None else None
        if not found:
            continue
        for g, (start, end) in found:
            with graph.inserting_before(g):
                piece = graph.call_function(aten.slice.Tensor, (sp.args[0], v.dim() - 1, start, end))
            piece.meta = {**g.meta, "val": v[..., start:end]}
            g.replace_all_uses_with(piece)
            graph.erase_node(g)
        graph.erase_node(sp)
        done += 1
    return done


def fold_permutes(graph: fx.Graph) -> int:
    """A permute of a permute becomes one permute of the source, or the source itself when the two
    cancel; returns the nodes folded."""
    done = 0
    for p in list(graph.nodes):
        outer = _perm_dims(p)
        inner = _perm_dims(p.args[0]) if outer is not None and isinstance(p.args[0], fx.Node) else None
        if inner is None:
            continue
        src = p.args[0].args[0]
        dims = [inner[d] for d in outer]
        if dims == list(range(len(dims))):
            p.replace_all_uses_with(src)
        else:
            with graph.inserting_before(p):
                new = graph.call_function(aten.permute.default, (src, dims))
            new.meta = _untagged(p)
            p.replace_all_uses_with(new)
        graph.erase_node(p)
        done += 1
    return done


# views whose meta values `refresh_view_meta` recomputes from their source's
_REFRESHED = frozenset({aten.permute.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default,
                        aten.slice.Tensor, aten.unsqueeze.default, aten.expand.default, aten.t.default, aten.alias.default,
                        aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.select.int, aten.as_strided.default,
                        aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, operator.getitem})


def refresh_view_meta(graph: fx.Graph) -> int:
    """Recompute each view's meta value from its source's current one, in graph order (strides
    change when a producer's layout did); a ``getitem`` takes its item of its source's value.
    Raises ValueError naming a view that no longer applies. Returns the values that changed."""
    changed = 0
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in _REFRESHED:
            continue
        src = n.args[0]
        vs = src.meta.get("val") if isinstance(src, fx.Node) else None
        if vs is None:
            continue
        if n.target is operator.getitem:
            if not isinstance(vs, (tuple, list)):
                continue
            new = vs[n.args[1]]
        else:
            if not isinstance(vs, torch.Tensor):
                continue
            args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in n.args]
            try:
                new = n.target(*args, **n.kwargs)
            except (RuntimeError, ValueError) as e:  # torch's meta views raise either
                raise ValueError(f"{n.name} ({n.target}) no longer applies to the layout of {src.name}: {e}") from None
        old = n.meta.get("val")
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.stride() == new.stride()
                and old.shape == new.shape):
            changed += 1
        n.meta["val"] = new
    return changed


def _is_view(n: fx.Node) -> bool:
    """A view op of one tensor (a ``getitem`` only of a split's pieces)."""
    if n.op != "call_function" or n.target not in _REFRESHED:
        return False
    return n.target is not operator.getitem or (isinstance(n.args[0], fx.Node) and n.args[0].target in _SPLITS)


_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int})


def view_root(n: fx.Node) -> fx.Node:
    """The node whose storage ``n`` views: up through view ops (itself if it is none)."""
    while _is_view(n) or (n.op == "call_function" and n.target in _SPLITS):
        n = n.args[0]
    return n


def _views_of(n: fx.Node) -> set[fx.Node]:
    """``n`` and every node that views its storage (down through view ops)."""
    out, todo = set(), [n]
    while todo:
        m = todo.pop()
        if m in out:
            continue
        out.add(m)
        todo += [u for u in m.users if _is_view(u) or u.target in _SPLITS]
    return out


def _writes(n: fx.Node) -> bool:
    """Whether ``n`` writes into one of its arguments (an in-place or out= op)."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def drop_contiguous_clones(graph: fx.Graph, known: Callable[[fx.Node], bool]) -> int:
    """Drop a contiguous ``clone`` of a value already contiguous, when its source's layout at run
    time is the one its meta value records (``known(source)``: a generated kernel writes its
    outputs contiguous whatever layout the trace recorded for them, so only the caller can vouch
    for it), and nothing could tell the two apart: no op writes into either of them (or a view
    of them), and the graph does not return the clone (or a view of it). Its readers then read
    the source. Returns the clones dropped."""
    done = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.clone.default:
            continue
        fmt = n.kwargs.get("memory_format", torch.contiguous_format)
        src = n.args[0]
        vs = _val(src)
        if fmt not in (torch.contiguous_format, torch.preserve_format) or set(n.kwargs) - {"memory_format"}:
            continue
        if vs is None or not vs.is_contiguous() or not known(src):
            continue
        mine, theirs = _views_of(n), _views_of(view_root(src))
        if any(u.op == "output" for m in mine for u in m.users) or any(_writes(u) for m in mine | theirs for u in m.users):
            continue
        n.replace_all_uses_with(src)
        graph.erase_node(n)
        done += 1
    return done


_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def sum_through_reshapes(graph: fx.Graph, fusible: FusibleOps) -> int:
    """Make each column sum over the first dim of a 2-D reshape ``(M, N)`` of a value ``x`` of
    shape ``(..., N)`` (its leading dims merged, the last kept) a sum of ``x`` over its leading
    dims, viewed back to the old result's shape, when ``x`` comes from a fusible op (its kernel
    can then take the sum). Returns the rewrites made."""
    done = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.sum.dim_IntList or n.target not in fusible.reductions:
            continue
        r = n.args[0]
        if not (isinstance(r, fx.Node) and r.op == "call_function" and r.target in _RESHAPES):
            continue
        x = r.args[0]
        vx, vr, vn = _val(x), _val(r), _val(n)
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        if (vx is None or vr is None or vn is None or vr.dim() != 2 or vx.dim() < 3 or set(n.kwargs) - {"dim", "keepdim"}
                or vx.shape[-1] != vr.shape[-1] or not isinstance(dims, (list, tuple)) or [d % 2 for d in dims] != [0]):
            continue
        if not (isinstance(x, fx.Node) and x.op == "call_function" and classify(x, fusible) == "fusible"):
            continue  # a graph input or an anchor's output: no kernel to join
        lead = list(range(vx.dim() - 1))
        with graph.inserting_before(n):
            folded = graph.call_function(aten.sum.dim_IntList, (x, lead, bool(keep)))
            folded.meta = {**n.meta, "val": _meta((*([1] * len(lead) if keep else []), vx.shape[-1]), vn.dtype)}
            out = folded
            if keep:
                out = graph.call_function(aten.view.default, (folded, list(vn.shape)))
                out.meta = {**n.meta, "val": _meta(vn.shape, vn.dtype)}
        n.replace_all_uses_with(out)
        graph.erase_node(n)
        done += 1
    return done


def drop_aliases(graph: fx.Graph) -> int:
    """Ops that read an ``alias`` of a value read the value itself (the graph's outputs keep theirs:
    an output that is also an input stays a distinct result); returns the uses rewritten."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.alias.default:
            continue
        src = node.args[0]
        while isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.alias.default:
            src = src.args[0]
        for user in list(node.users):
            if user.op == "call_function":
                user.replace_input_with(node, src)
                n += 1
    return n


def move_views(graph: fx.Graph, fusible: FusibleOps) -> int:
    """`drop_aliases`, then `sink_expands`, `hoist_slices`, `hoist_permutes` and
    `sum_through_reshapes` until none finds more; returns the rewrites made."""
    total = drop_aliases(graph)
    total += _to_fixpoint(lambda: sink_expands(graph, fusible) + hoist_slices(graph, fusible) + hoist_permutes(graph, fusible)
                          + sum_through_reshapes(graph, fusible))
    if total:
        graph.eliminate_dead_code()
        graph.lint()
    return total
