"""Split a layer's joint graph into a forward that saves and a backward that reads the saved values.

The streaming executor normally recomputes a block in its backward visit: the joint graph runs
the layer's forward again, then its backward (graphs/lower.py), so nothing lives on the GPU between
the two visits but the layer's input. When GPU memory is left over, a block can instead keep some
of its forward values from the forward visit and skip most of that second forward. This module
cuts a joint graph ``(inputs..., grad_outs...) -> (outputs..., grads...)`` (traced with its
outputs) into

- ``save``: ``(inputs...) -> (outputs..., saved...)``, run in the forward visit, and
- ``backward``: ``(inputs..., saved..., grad_outs...) -> (None..., grads...)``, run in the
  backward visit (the outputs are None, as in a block's joint graph traced without them).

What is saved is chosen as selective activation checkpointing does: the outputs of the forward's
expensive nodes (matmuls, attention and its log-sum-exp, any op no generated kernel computes) that
the backward reads, directly or through cheap ops. Views and the ops ``recomputable`` accepts
(pointwise ops and reductions a generated kernel computes: norms, activations, rotary products,
casts) are not saved: the backward graph computes them again from the saved values and the
inputs, where partitioning fuses them into its own kernels. A norm's fp32 input or a SwiGLU
product therefore costs no memory between the visits; a Llama block keeps its q/k/v, attention
output, o-projection, gate and up projections (about 43k bf16 values per token at Llama-8B's
width) instead of recomputing four matmuls and attention.

Both graphs compute exactly what the joint graph does, node for node (each node is copied with its
arguments), so their gradients are the joint graph's bit for bit wherever its kernels are
deterministic. Pure graph surgery: no I/O, no devices, no kernels.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch
from torch import fx

__all__ = ["SplitError", "SplitJoint", "split_joint"]


class SplitError(ValueError):
    """The joint graph cannot be split (the caller keeps recomputing the layer)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SplitJoint:
    """The two graphs of a split joint graph and what passes between them."""

    save: fx.Graph
    backward: fx.Graph
    saved: list[tuple[tuple[int, ...], torch.dtype]]  # shape and dtype of each saved value, in the order `save` returns them


def _tensor(n: fx.Node) -> torch.Tensor | None:
    v = n.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def split_joint(joint: fx.Graph, n_inputs: int, n_outputs: int, recomputable: Callable[[fx.Node], bool]) -> SplitJoint:
    """Cut ``joint`` (``n_inputs`` template inputs, then grad outputs; returning ``n_outputs``
    outputs, then gradients) into the `SplitJoint` pair; ``recomputable(node)``: whether the
    backward may compute ``node`` again instead of receiving it (views always may)."""
    phs = [n for n in joint.nodes if n.op == "placeholder"]
    if len(phs) <= n_inputs:
        raise SplitError("the joint graph takes no grad outputs")
    inputs, gouts = phs[:n_inputs], phs[n_inputs:]
    out_node = next(n for n in joint.nodes if n.op == "output")
    results = list(out_node.args[0])
    outs, grads = results[:n_outputs], results[n_outputs:]
    if any(not isinstance(o, fx.Node) for o in outs):
        raise SplitError("the joint graph was traced without its outputs; trace it with them to split it")

    # the backward: every node that depends on a grad output
    bwd: set[fx.Node] = set(gouts)
    for n in joint.nodes:
        if n.op == "call_function" and any(a in bwd for a in n.all_input_nodes):
            bwd.add(n)
    # what the backward reads of the forward: recompute the cheap, save the rest
    recompute: set[fx.Node] = set()
    saved: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [a for n in bwd for a in n.all_input_nodes if a not in bwd]
    stack += [g for g in grads if isinstance(g, fx.Node) and g not in bwd]  # a gradient known without grad outputs
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if a.op == "placeholder":
            continue  # a template input: the backward takes it again
        if _recompute(a, recomputable):
            recompute.add(a)
            stack.extend(a.all_input_nodes)
        elif _tensor(a) is None:
            raise SplitError(f"the backward reads {a.name} ({a.target}), which is no single tensor")
        else:
            saved.append(a)
    order = {n: i for i, n in enumerate(joint.nodes)}
    saved.sort(key=order.__getitem__)

    save = _copy(joint, inputs, _needed(outs + saved), lambda env: (*[env[o] for o in outs], *[env[s] for s in saved]))
    backward = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in inputs:
        env[p] = _placeholder(backward, p.name, p)
    for k, s in enumerate(saved):
        env[s] = _placeholder(backward, f"saved_{k}", s)
    for p in gouts:
        env[p] = _placeholder(backward, p.name, p)
    for n in joint.nodes:
        if n.op == "call_function" and (n in bwd or n in recompute) and n not in env:
            env[n] = backward.node_copy(n, env.__getitem__)
    backward.output((*[None] * n_outputs, *[env[g] if isinstance(g, fx.Node) else g for g in grads]))
    backward.eliminate_dead_code()
    backward.lint()
    specs = [(tuple(_tensor(s).shape), _tensor(s).dtype) for s in saved]  # type: ignore[union-attr]
    return SplitJoint(save, backward, specs)


def _recompute(n: fx.Node, recomputable: Callable[[fx.Node], bool]) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:  # an output of a multi-output op: saved when the op is
        src = n.args[0]
        return isinstance(src, fx.Node) and _recompute(src, recomputable)
    # a factory (zeros, full, arange): nothing to read, nothing worth keeping
    return not n.all_input_nodes or recomputable(n)


def _needed(roots: list[fx.Node]) -> set[fx.Node]:
    need: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(n.all_input_nodes)
    return need


def _placeholder(g: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    p = g.placeholder(name)
    if "val" in like.meta:
        p.meta["val"] = like.meta["val"]
    return p


def _copy(joint: fx.Graph, inputs: list[fx.Node], keep: set[fx.Node], result: Callable[[dict[fx.Node, fx.Node]], tuple]) -> fx.Graph:
    """The nodes of ``joint`` in ``keep``, in order, after every template input."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in inputs:
        env[p] = _placeholder(g, p.name, p)
    for n in joint.nodes:
        if n.op == "call_function" and n in keep:
            env[n] = g.node_copy(n, env.__getitem__)
    g.output(result(env))
    g.lint()
    return g
