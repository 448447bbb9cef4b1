"""Lower a layer template to core ATen: its forward graph and its joint forward+backward graph.

The joint graph of a template is ``(inputs..., grad_outs...) -> (outputs..., grads)``, traced
with make_fx over the template's vector-Jacobian product. It recomputes the forward inside,
which is exactly what the streaming executor does in a backward visit, so nothing has to be
saved between the forward and the backward visit of a layer. Gradients are taken for the carry,
the parameters, and (with ``grad_aux``) the embed stage's aux values that depend on parameters
(learned position tables, scales): blocks then return their gradient and the embed stage takes
one grad output per such aux value, in the order the executor passes them.

Attention: on meta tensors ``scaled_dot_product_attention`` would dispatch to its math
decomposition before any decomposition table is consulted, so lowering swaps it for
``mtc::attention`` (graphs/ops.py), which stays one anchor node forward and backward.

Template-level ``rewrites`` (each ``fn(gm) -> count``) run after that swap and before tracing;
the caller owns them (the compiler hands in kernels/swaps.py's), so this module knows no kernel.
No I/O and no devices: everything runs on meta tensors.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import mtc.graphs.ops  # noqa: F401  (registers mtc::attention, which lowering keeps whole)
import torch
from mtc.graphs.program import Template
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["Rewrite", "diff_inputs", "forward_graph", "grad_outputs", "joint_graph", "lowerable"]

aten = torch.ops.aten
Rewrite = Callable[[fx.GraphModule], int]


def _use_mtc_attention(node: fx.Node) -> None:
    """Swap SDPA for mtc::attention (kept whole by make_fx) when it is plain causal/non-causal
    attention; masked or dropout attention stays SDPA (and decomposes)."""
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    defaults = [None, None, None, None, 0.0, False, None, False]
    bound = dict(zip(names, defaults))
    bound.update(zip(names, node.args))
    bound.update(node.kwargs)
    if bound["attn_mask"] is not None or bound["dropout_p"] not in (0, 0.0):
        return
    q = bound["query"].meta["val"]
    scale = bound["scale"] if bound["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    node.target = torch.ops.mtc.attention.default
    node.args = (bound["query"], bound["key"], bound["value"], bool(bound["is_causal"]), float(scale))
    node.kwargs = {}
    # torch's SDPA returns (B, T, H, D)-strided output, so export drops a `.contiguous()` after
    # `.transpose(1, 2)` as a no-op and keeps a bare `.view(B, T, H * D)` (nanoGPT's attention);
    # mtc::attention's output is (B, H, T, D)-contiguous, where that view is invalid. A reshape
    # is the same view wherever one exists, and copies where it does not.
    todo = list(node.users)
    while todo:
        u = todo.pop()
        if u.op != "call_function" or not isinstance(u.target, torch._ops.OpOverload) or not u.target.is_view:
            continue
        if u.target is aten.view.default:
            u.target = aten.reshape.default
        todo.extend(u.users)


def lowerable(t: Template, rewrites: Sequence[Rewrite] = ()) -> fx.GraphModule:
    """The template on the meta device with SDPA swapped for mtc::attention, then ``rewrites``.

    Templates keep ATen SDPA so eager execution is bit-identical to the user's module; only the
    lowered graphs (what kernels are generated from) use the op that stays whole.
    """
    gm = copy.deepcopy(t.module("meta"))
    for node in gm.graph.nodes:
        if node.target is aten.scaled_dot_product_attention.default:
            _use_mtc_attention(node)
    gm.recompile()
    if any(_mutates(n) for n in gm.graph.nodes):
        # export keeps in-place writes into activations (``h[..., 0] = 0.0`` is a ``fill_`` of a
        # select of h that nothing reads): the compiler's passes order and fuse nodes by what they
        # read, so the write would be lost and the compiled layer compute another function.
        # Functionalised, the write is a ``select_scatter`` that later reads depend on. (Before the
        # rewrites: functorch cannot trace the fused cross-entropy's autograd.Function. Tracing
        # decomposes linear and cross_entropy, so such a template keeps its unfused loss.)
        gm = make_fx(torch.func.functionalize(gm, remove="mutations"))(*_meta_inputs(t))
        _differentiable_copies(gm)
    for rewrite in rewrites:
        rewrite(gm)
    gm.recompile()
    return gm


def _differentiable_copies(gm: fx.GraphModule) -> None:
    """Replace functional ``aten.copy(dst, src)`` (what a functionalised ``copy_``/``fill_`` leaves:
    src cast and broadcast to dst) by ops autograd differentiates, for the joint graph."""
    for n in list(gm.graph.nodes):
        if n.target is not aten.copy.default:
            continue
        dst, src = n.args[0].meta["val"], n.args[1].meta["val"]
        with gm.graph.inserting_before(n):
            # (on dst's device, as copy_ writes there: a lifted scalar constant may live elsewhere)
            v = gm.graph.call_function(aten._to_copy.default, (n.args[1],), {"dtype": dst.dtype, "device": dst.device})
            if tuple(src.shape) != tuple(dst.shape):
                v = gm.graph.call_function(aten.expand.default, (v, list(dst.shape)))
        n.replace_all_uses_with(v)
        gm.graph.erase_node(n)
    gm.recompile()


def _mutates(n: fx.Node) -> bool:
    """Whether ``n`` writes into one of its arguments (an in-place ATen op)."""
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable


def _meta_inputs(t: Template) -> list[torch.Tensor]:
    return [torch.empty(i.spec.shape, dtype=i.spec.torch_dtype, device="meta") for i in t.inputs]


# (operator count, table): torch builds its core ATen table by walking every registered
# composite op (~0.1-0.4 s here), and each template lowers two or three times; a new op registered
# since (a user's library imported between traces) may be composite, so the count is the key.
_DECOMPS: tuple[int, dict[Any, Callable[..., Any]]] | None = None


def _decomps() -> dict[Any, Callable[..., Any]]:
    """The decomposition table lowering traces with (a copy: make_fx's callers own it)."""
    global _DECOMPS
    n_ops = len(torch._C._dispatch_get_all_op_names())
    if _DECOMPS is None or _DECOMPS[0] != n_ops:
        _DECOMPS = (n_ops, _build_decomps())
    return dict(_DECOMPS[1])


def _build_decomps() -> dict[Any, Callable[..., Any]]:
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = dict(core_aten_decompositions())
    # core ATen keeps layer norm whole; decompose it (and var_mean) into reductions the generator fuses
    table.update(get_decompositions([aten.native_layer_norm, aten.native_layer_norm_backward]))
    table[aten.var_mean.correction] = _var_mean
    # keep attention as one anchor (decomposing it would materialise T x T scores)
    for op in list(table):
        if "scaled_dot_product" in str(op):
            del table[op]
    # the embedding's backward is one scatter-add kernel in ATen; decomposed it becomes ~10 ops
    # (masks, a zero fill, index_put) that no generated kernel covers
    for op in (aten.embedding_dense_backward.default, aten.embedding_dense_backward.out):
        table.pop(op, None)
    return table


def _var_mean(x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> Any:
    """var_mean as two last-dim reductions (torch's own decomposition emits prims the generator
    does not know); other dims fall back to the op itself."""
    dims = [d % x.dim() for d in (dim if isinstance(dim, (list, tuple)) else [dim])] if dim is not None else None
    if dims != [x.dim() - 1]:
        return NotImplemented
    n = x.shape[-1]
    mean = aten.mean.dim(x, [-1], True)
    diff = aten.sub.Tensor(x, mean)
    var = aten.div.Scalar(aten.sum.dim_IntList(aten.mul.Tensor(diff, diff), [-1], True), n - (1 if correction is None else correction))
    if not keepdim:
        mean, var = aten.squeeze.dims(mean, [-1]), aten.squeeze.dims(var, [-1])
    return var, mean


def forward_graph(t: Template, rewrites: Sequence[Rewrite] = ()) -> fx.GraphModule:
    """The template's forward lowered to core ATen, traced on meta tensors."""
    gm = lowerable(t, rewrites)
    return make_fx(lambda *xs: gm(*xs), decomposition_table=_decomps())(*_meta_inputs(t))


def _aux_index(t: Template, k: int) -> int:
    return int(t.inputs[k].role)  # the tracer names an aux input by its index among the embed's aux outputs


def diff_inputs(t: Template, grad_aux: Sequence[bool] = ()) -> list[int]:
    """Template inputs whose gradients the joint graph returns: carry, params, and (outside the
    embed stage) aux values that depend on parameters."""
    return [k for k, i in enumerate(t.inputs)
            if i.kind in ("carry", "param")
            or (i.kind == "aux" and t.kind != "embed" and _aux_index(t, k) < len(grad_aux) and grad_aux[_aux_index(t, k)])]


def grad_outputs(t: Template, grad_aux: Sequence[bool] = ()) -> list[int]:
    """Outputs that take a grad output in the joint graph: the carried state (or the loss) and,
    for the embed stage, each aux output that depends on a parameter."""
    return [0] + ([1 + j for j, need in enumerate(grad_aux) if need] if t.kind == "embed" else [])


def joint_graph(t: Template, rewrites: Sequence[Rewrite] = (), grad_aux: Sequence[bool] = (), *,
                outputs: bool = True) -> tuple[fx.GraphModule, list[int]]:
    """``(inputs..., grad_outs...) -> (outputs..., grads)`` in core ATen, and the input indices the
    grads are for (see `diff_inputs` and `grad_outputs`). ``outputs`` False: the outputs are
    None and whatever only they needed is gone from the graph (gradients unchanged)."""
    gm = lowerable(t, rewrites)
    diff = diff_inputs(t, grad_aux)
    outs_idx = grad_outputs(t, grad_aux)
    n_in = len(t.inputs)

    def joint(*args: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xs, gouts = list(args[:n_in]), list(args[n_in:])
        xs = [x.requires_grad_() if k in diff else x for k, x in enumerate(xs)]
        with torch.enable_grad():
            outs = gm(*xs)
            grads = torch.autograd.grad([outs[i] for i in outs_idx], [xs[k] for k in diff], gouts, allow_unused=True)
        return (*(outs if outputs else [None] * len(outs)), *grads)

    ins = _meta_inputs(t)
    outs = gm(*ins)
    g = make_fx(joint, decomposition_table=_decomps())(*ins, *[torch.empty_like(outs[i]) for i in outs_idx])
    if not outputs:
        g.graph.eliminate_dead_code()
        g.recompile()
    return g, diff
