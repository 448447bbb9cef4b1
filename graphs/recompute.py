"""Recompute cheap intermediates in the fusion groups that consume them instead of saving them.

In a joint forward+backward graph a fusion group often stores a value only because another
group reads it later: RMSNorm's ``x * rstd`` or its fp32 input (for the weight and input
gradients), the pieces of the input gradient a weight-gradient kernel computes on its way
(``dy * w * x``, ``dy * w * rstd``) for the row kernel that finishes it, LayerNorm's
``(x - mean) * rstd``, a rotary product. When that value is a short pointwise chain over tensors
that exist anyway (graph inputs, outputs of anchors or other kernels) and per-row or per-column
values (a few bytes per row), the consumer can compute it again from those. It pays when the
bytes saved (the producer's store and each consumer's read of the value) exceed the bytes of the
chain's inputs the consumers do not read already: an fp32 value rebuilt from one or two bf16
tensors always pays, and so does a bf16 value rebuilt from tensors its consumer reads anyway
(RMSNorm's ``x * rstd`` before the weight, which the forward kernel stored for the weight
gradient, rebuilt in the kernel that computes the norm's input gradient from the same ``x``). Each consumer group gets its own copy of the chain (marked
``mtc_recompute`` so that `partition` puts it with its consumer, not back with its producer);
the pass repeats until nothing more pays, so a value rebuilt inside a consumer can carry
another value's chain further back.

The copy computes the very values the producer stored. Inside a chain any float dtype may
appear: a generated kernel keeps every intermediate in fp32 and rounds only at an explicit cast,
and the copy computes the same expression from the same inputs. A half-precision value is rounded
where the producer stores it, so its copy ends in an explicit cast to that dtype (a round trip
the kernel computes as the store and the load would have; a no-op for ATen, whose ops round
their outputs anyway). Pure graph surgery.
"""

from __future__ import annotations

import math

import torch
from mtc.graphs.partition import RECOMPUTE, FusibleOps, FusionGroup, partition
from torch import fx

__all__ = ["MAX_CHAIN", "broadcast_output", "copy_broadcast_outputs", "recompute_cheap", "stored_between_groups"]

MAX_CHAIN = 12  # pointwise ops copied per recomputed value: beyond that the copy is not cheap


def _val(n: object) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _small(n: fx.Node, big: torch.Tensor) -> bool:
    """A per-row / per-column value (or a scalar): costs a few bytes per row to keep."""
    v = _val(n)
    return v is not None and v.numel() * 8 <= big.numel()


def _chain(o: fx.Node, inside: set[fx.Node], fusible: FusibleOps) -> tuple[list[fx.Node], set[fx.Node]] | None:
    """(pointwise nodes computing ``o`` from roots, in graph order; its full-size roots) or None.

    Roots are values from outside the group (materialised anyway) or small fp32 values inside it
    (the group then stores them: a few bytes per row; a small half-precision value would be read
    back rounded where the producer used it unrounded). Anything else (a reduction over full
    rows, a cat, a large intermediate not pointwise) stops the chain.
    """
    vo = _val(o)
    chain: list[fx.Node] = []
    big_roots: set[fx.Node] = set()
    stack, seen = [o], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n is not o and n not in inside:
            big_roots.add(n)
            continue
        if n is not o and _small(n, vo):
            if _val(n).dtype != torch.float32:
                return None
            continue
        if n.target not in fusible.pointwise or _val(n) is None or not _val(n).dtype.is_floating_point:
            return None
        chain.append(n)
        if len(chain) > MAX_CHAIN:
            return None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(o.graph.nodes)}
    big_roots = {r for r in big_roots if not _small(r, vo)}
    return sorted(chain, key=order.__getitem__), big_roots


def _nbytes(n: fx.Node) -> int:
    v = _val(n)
    return 0 if v is None else math.prod(v.shape) * v.element_size()


def recompute_cheap(graph: fx.Graph, fusible: FusibleOps, *, max_rounds: int = 8) -> int:
    """Copy each cheap value a fusion group stores only for other fusion groups into those
    groups, where that moves fewer bytes; returns how many values are no longer stored. Rounds
    repeat (a fresh partition each) until one recomputes nothing. Run `partition` again afterwards."""
    done = 0
    for _ in range(max_rounds):
        n = _recompute_round(graph, fusible)
        if not n:
            break
        done += n
    if done:
        graph.eliminate_dead_code()
        graph.lint()
    return done


def _recompute_round(graph: fx.Graph, fusible: FusibleOps) -> int:
    p = partition(graph, fusible)
    group_of = {n: i for i, g in enumerate(p.groups) for n in g.nodes}
    reads = [set(g.inputs) for g in p.groups]  # what each group reads, kept current as copies land
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for gi, g in enumerate(p.groups):
        inside = set(g.nodes)
        for o in g.outputs:
            vo = _val(o)
            outside = [u for u in o.users if u not in inside]
            # stored only for other fusion groups (an anchor or the graph's output needs it whole)
            if vo is None or not vo.dtype.is_floating_point or _small(o, vo) or not outside:
                continue
            if any(group_of.get(u, gi) == gi for u in outside):
                continue
            found = _chain(o, inside, fusible)
            if found is None:
                continue
            chain, big_roots = found
            consumers: dict[int, list[fx.Node]] = {}
            for u in outside:
                consumers.setdefault(group_of[u], []).append(u)
            # the producer's store and each consumer's read go; each consumer reads the roots it lacks
            saved = _nbytes(o) * (1 + len(consumers))
            added = sum(_nbytes(r) for c in consumers for r in big_roots - reads[c])
            if added >= saved:
                continue
            copies: list[tuple[list[fx.Node], list[fx.Node]]] = []
            for users in consumers.values():
                first = min(users, key=order.__getitem__)
                env: dict[fx.Node, fx.Node] = {}
                with graph.inserting_before(first):
                    for n in chain:
                        env[n] = graph.node_copy(n, lambda a, env=env: env.get(a, a))
                        env[n].meta[RECOMPUTE] = True
                    made = [env[n] for n in chain]
                    if vo.dtype != torch.float32:  # rounded as the producer's store rounds it
                        made.append(_round(graph, env[o], vo))
                for u in users:
                    u.replace_input_with(o, made[-1])
                copies.append((users, made))
            if _joined(graph, fusible, copies):
                done += 1
                for c in consumers:
                    reads[c] = (reads[c] | big_roots) - {o}
            else:
                _undo(graph, o, copies)
    return done


def _round(graph: fx.Graph, x: fx.Node, like: torch.Tensor) -> fx.Node:
    """An explicit cast of ``x`` to ``like``'s dtype (inserted at the graph's insertion point)."""
    r = graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": like.dtype})
    r.meta["val"] = like
    r.meta[RECOMPUTE] = True
    return r


def broadcast_output(o: fx.Node, group: FusionGroup, fusible: FusibleOps) -> bool:
    """Whether ``group`` outputs ``o`` at a shape its kernel cannot write: smaller than the
    iteration shape, and neither a reduction's result nor a per-row value of a row kernel."""
    v = _val(o)
    if v is None or o.target in fusible.reductions:
        return False
    s, S = tuple(v.shape), tuple(group.shape)
    row = any(n.target in fusible.reductions for n in group.nodes) and s == (*S[:-1], 1)
    return s != S and not row and math.prod(s) < math.prod(S)


def copy_broadcast_outputs(graph: fx.Graph, fusible: FusibleOps) -> int:
    """Give the other users of a broadcast value their own copy of it; returns how many values.

    A fusion group may compute a value smaller than its iteration shape (a norm's weight cast to
    fp32, broadcast over every row) that other kernels read too. A generated kernel writes only
    outputs of its iteration shape (and its reductions'), so such an output made the whole group
    stay on ATen (GPT-2's LayerNorm backward: ten ops). Its users outside the group get a copy of
    its pointwise chain (small: the value has fewer elements than a row block), marked like a
    recomputed value so `partition` puts each copy with its consumers; the chain is fp32 and
    computes the same ops, so the copy's values are the original's."""
    p = partition(graph, fusible)
    group_of = {n: i for i, g in enumerate(p.groups) for n in g.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for g in p.groups:
        inside = set(g.nodes)
        for o in g.outputs:
            if not broadcast_output(o, g, fusible):
                continue
            found = _chain(o, inside, fusible)
            if found is None:
                continue
            chain, _ = found
            consumers: dict[int | None, list[fx.Node]] = {}  # a copy per consuming group (None: other users)
            for u in sorted((u for u in o.users if u not in inside), key=order.__getitem__):
                consumers.setdefault(group_of.get(u), []).append(u)
            for users in consumers.values():
                env: dict[fx.Node, fx.Node] = {}
                with graph.inserting_before(users[0]):
                    for n in chain:
                        env[n] = graph.node_copy(n, lambda a, env=env: env.get(a, a))
                        env[n].meta[RECOMPUTE] = True
                for u in users:
                    u.replace_input_with(o, env[o])
            done += 1
    if done:
        graph.eliminate_dead_code()
        graph.lint()
    return done


def _joined(graph: fx.Graph, fusible: FusibleOps, copies: list[tuple[list[fx.Node], list[fx.Node]]]) -> bool:
    """Did every copy land in its consumers' kernel? (Shape or cycle rules may keep it apart: then
    it would be one more kernel storing the same value.)"""
    group_of = {n: i for i, g in enumerate(partition(graph, fusible).groups) for n in g.nodes}
    return all(group_of.get(c) is not None and all(group_of.get(u) == group_of[c] for u in users)
               for users, made in copies for c in made)


def _undo(graph: fx.Graph, o: fx.Node, copies: list[tuple[list[fx.Node], list[fx.Node]]]) -> None:
    for users, made in copies:
        for u in users:
            u.replace_input_with(made[-1], o)
        for c in reversed(made):
            graph.erase_node(c)


def stored_between_groups(graph: fx.Graph, fusible: FusibleOps) -> tuple[int, int]:
    """(values, bytes) fusion groups store for other fusion groups to read: what recomputation saves."""
    p = partition(graph, fusible)
    group_of = {n: i for i, g in enumerate(p.groups) for n in g.nodes}
    count = nbytes = 0
    for gi, g in enumerate(p.groups):
        for o in g.outputs:
            if any(group_of.get(u, gi) != gi for u in o.users if u in group_of):
                v = _val(o)
                count += 1
                nbytes += math.prod(v.shape) * v.element_size() if v is not None else 0
    return count, nbytes
