"""Swap multi-op patterns for mtc's hand-tuned kernels (registered here, by the kernels that own them).

* ``use_linear_cross_entropy`` (template level, before lowering): ``linear -> reshape/upcast ->
  cross_entropy`` becomes one call of the fused linear + cross-entropy, so the (N, V) logits are
  never materialised and the loss's gradient is computed in its forward;
* ``use_grouped_kv`` (template level, after SDPA became ``mtc::attention``): K and V heads that
  the model repeats for grouped-query attention (``repeat_interleave`` or HF's ``repeat_kv``
  expand + reshape) go to attention unrepeated, so attention reads each KV head once and its
  backward sums over the group inside the kernel instead of materialising repeated copies;
* ``fold_ce_grad_scale`` (lowered joint graphs): the backward's ``dx * grad``, ``dW * grad``,
  ``db * grad`` after the fused linear + cross-entropy go into the op itself (it divides the
  logits gradient by n_valid / grad), saving a pass over the (V, H) weight gradient (0.7 ms of
  Llama 3's head on an H100);
* ``use_flash_attention`` (lowered graphs): ``mtc::attention`` and its backward become the Triton
  flash-attention forward and backward; the backward reuses the forward's output and logsumexp
  when the joint graph has both, so attention is not recomputed twice.

Each rewrite checks every condition the kernel needs and leaves the pattern alone otherwise (it
then runs as ATen, and the compile report shows it). Graph surgery only: no I/O, no devices.
"""

from __future__ import annotations

import operator

import torch
from mtc.graphs.views import view_root
from torch import fx

__all__ = ["FLASH_MAX_HEAD_DIM", "attention_output_layout_known", "fold_ce_grad_scale", "reads_any_layout", "refresh_attention_meta",
           "use_flash_attention", "use_grouped_kv", "use_linear_cross_entropy"]

aten = torch.ops.aten
FLASH_MAX_HEAD_DIM = 128  # kernels/flash_attention.py holds a (BLOCK, D) tile in registers
_PASS_THROUGH = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.contiguous.default}
_CE_DEFAULTS = (None, 1, -100, 0.0)  # weight, reduction (1 = mean), ignore_index, label_smoothing


def _val(node: object) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _ce_args(ce: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """(logits, targets, ignore_index) of a mean, unweighted, unsmoothed cross_entropy_loss."""
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    bound = dict(zip(names, _CE_DEFAULTS))
    bound.update(zip(names, ce.args[2:]))
    bound.update(ce.kwargs)
    if bound["weight"] is not None or bound["reduction"] != 1 or bound["label_smoothing"] not in (0, 0.0):
        return None
    return ce.args[0], ce.args[1], int(bound["ignore_index"])


def _upcast_only(node: fx.Node) -> bool:
    """A dtype conversion that only widens to fp32 (the `.float()` before the loss)."""
    if node.target is aten.to.dtype:
        dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    elif node.target is aten._to_copy.default:
        if set(node.kwargs) - {"dtype"}:
            return False
        dtype = node.kwargs.get("dtype")
    else:
        return False
    return dtype == torch.float32


def _real_users(n: fx.Node) -> list[fx.Node]:
    """Users that consume the value (export adds metadata assertions that compute nothing)."""
    return [u for u in n.users if u.target is not aten._assert_tensor_metadata.default]


def _linear_behind(logits: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """Walk back from the loss's logits through single-use reshapes and an fp32 upcast to a linear."""
    chain: list[fx.Node] = []
    n = logits
    while n.op == "call_function" and (n.target in _PASS_THROUGH or _upcast_only(n)):
        if len(_real_users(n)) != 1:
            return None
        chain.append(n)
        n = n.args[0]
    if n.op != "call_function" or n.target is not aten.linear.default or len(_real_users(n)) != 1:
        return None
    return n, chain


def use_linear_cross_entropy(gm: fx.GraphModule) -> int:
    """Swap every ``linear -> (reshape | view | .float())* -> cross_entropy`` chain for the fused
    linear + cross-entropy; returns how many were swapped. Needs the nodes' ``meta['val']``."""
    from mtc.kernels.linear_cross_entropy import linear_cross_entropy

    swapped = 0
    for ce in list(gm.graph.nodes):
        if ce.op != "call_function" or ce.target is not aten.cross_entropy_loss.default:
            continue
        args = _ce_args(ce)
        if args is None:
            continue
        logits, targets, ignore_index = args
        found = _linear_behind(logits)
        if found is None:
            continue
        lin, chain = found
        x, w = lin.args[0], lin.args[1]
        b = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
        vx, vw, vl, vt = _val(x), _val(w), _val(logits), _val(targets)
        if vx is None or vw is None or vl is None or vt is None or vw.dim() != 2:
            continue
        rows = vx.numel() // max(vx.shape[-1], 1)
        # the loss must see every row of the linear, each whole, in order: (rows, V), upcast or fp32
        if tuple(vl.shape) != (rows, vw.shape[0]) or vl.dtype != torch.float32 or vt.numel() != rows:
            continue
        vb = _val(b) if b is not None else None
        if vx.dtype != vw.dtype or vx.dtype not in (torch.float16, torch.bfloat16, torch.float32) or (
                vb is not None and vb.dtype != vw.dtype):
            continue  # what the fused kernel takes (a float64 head cast to fp32 logits keeps torch's loss)
        with gm.graph.inserting_before(ce):
            fused = gm.graph.call_function(linear_cross_entropy, (x, w, b, targets, ignore_index))
        fused.meta["val"] = _val(ce)
        ce.replace_all_uses_with(fused)
        for dead in (ce, *chain, lin):
            for u in list(dead.users):  # metadata assertions on values that no longer exist
                gm.graph.erase_node(u)
            gm.graph.erase_node(dead)
        swapped += 1
    if swapped:
        gm.graph.lint()
        gm.recompile()
    return swapped


def _full_slice(n: fx.Node) -> bool:
    """``x[:, ...]``-style slices that keep the whole dimension (HF's ``x[:, :, None]`` emits them)."""
    if n.op != "call_function" or n.target is not aten.slice.Tensor:
        return False
    src, dim = _val(n.args[0]), (n.args[1] if len(n.args) > 1 else 0)
    start = n.args[2] if len(n.args) > 2 else None
    end = n.args[3] if len(n.args) > 3 else None
    step = n.args[4] if len(n.args) > 4 else 1
    return src is not None and start in (None, 0) and step == 1 and (end is None or end >= src.shape[dim])


def _unrepeated(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(x, rep)`` if ``node`` is the 4-D ``x`` (B, Hkv, T, D) with every head repeated ``rep``
    times in place along dim 1: ``repeat_interleave(x, rep, 1)``, or ``x[:, :, None]`` expanded to
    (B, Hkv, rep, T, D) and reshaped to (B, Hkv * rep, T, D)."""
    if node.op != "call_function":
        return None
    if node.target is aten.repeat_interleave.self_int:
        x, rep = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        vx = _val(x)
        if vx is not None and vx.dim() == 4 and dim in (1, -3) and isinstance(rep, int):
            return x, rep
        return None
    if node.target not in _PASS_THROUGH:
        return None
    e = node.args[0]
    while isinstance(e, fx.Node) and e.target in (aten.clone.default, aten.contiguous.default):
        e = e.args[0]
    if not isinstance(e, fx.Node) or e.target is not aten.expand.default:
        return None
    u = e.args[0]
    if not isinstance(u, fx.Node) or u.target is not aten.unsqueeze.default or u.args[1] not in (2, -3):
        return None
    x = u.args[0]
    while isinstance(x, fx.Node) and _full_slice(x):
        x = x.args[0]
    vx, ve, vn = _val(x), _val(e), _val(node)
    if vx is None or ve is None or vn is None or vx.dim() != 4 or ve.dim() != 5:
        return None
    B, kv, T, D = vx.shape
    rep = ve.shape[2]
    if tuple(ve.shape) != (B, kv, rep, T, D) or tuple(vn.shape) != (B, kv * rep, T, D):
        return None
    return x, rep


def use_grouped_kv(gm: fx.GraphModule) -> int:
    """Feed ``mtc::attention`` the unrepeated K and V of grouped-query attention; returns how many
    attention calls changed. Query head h reads KV head h // rep either way."""
    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or str(n.target) != "mtc.attention.default":
            continue
        q, k, v, causal, scale = n.args
        ks, vs = _unrepeated(k), _unrepeated(v)
        vq = _val(q)
        if ks is None or vs is None or vq is None or ks[1] != vs[1]:
            continue
        (xk, rep), (xv, _) = ks, vs
        if _val(xk).shape[1] * rep != vq.shape[1] or _val(xk).shape != _val(xv).shape:
            continue
        n.args = (q, xk, xv, causal, scale)
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return changed


def _flash_ok(q: fx.Node, k: fx.Node, v: fx.Node) -> bool:
    vq, vk, vv = _val(q), _val(k), _val(v)
    if vq is None or vk is None or vv is None or vq.dim() != 4:
        return False
    return (
        vq.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and vq.dtype == vk.dtype == vv.dtype
        and vk.shape == vv.shape
        and vk.shape[0] == vq.shape[0]
        and vk.shape[2:] == vq.shape[2:]  # same length and head dim for queries and keys
        and vk.shape[1] > 0 and vq.shape[1] % vk.shape[1] == 0
        and 1 <= vq.shape[-1] <= FLASH_MAX_HEAD_DIM
    )


def _flash_fwd_val(q: fx.Node) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta values of the flash forward's (out, logsumexp): out laid out as ``empty_like(q)``,
    logsumexp (B, H, T) fp32."""
    vq = _val(q)
    return torch.empty_like(vq, device="meta"), torch.empty(vq.shape[:-1], dtype=torch.float32, device="meta")


def _getitem(graph: fx.Graph, node: fx.Node, i: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, i))
    item.meta["val"] = node.meta["val"][i]
    return item


def use_flash_attention(graph: fx.Graph) -> int:
    """Swap ``mtc::attention`` / ``mtc::attention_backward`` for the flash-attention kernels;
    returns how many attention calls were swapped (forward and backward count separately)."""
    import mtc.kernels.flash_attention  # noqa: F401  (registers mtc::flash_attention_*)

    fwd_op = torch.ops.mtc.flash_attention_fwd.default
    bwd_op = torch.ops.mtc.flash_attention_bwd.default
    forwards: dict[tuple, tuple[fx.Node, fx.Node]] = {}
    swapped = 0
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        if str(n.target) == "mtc.attention.default":
            q, k, v, causal, scale = n.args
            if not _flash_ok(q, k, v):
                continue
            with graph.inserting_before(n):
                call = graph.call_function(fwd_op, (q, k, v, bool(causal), float(scale)))
                call.meta["val"] = _flash_fwd_val(q)
                out, lse = _getitem(graph, call, 0), _getitem(graph, call, 1)
            n.replace_all_uses_with(out)
            graph.erase_node(n)
            forwards[(q, k, v, bool(causal), float(scale))] = (out, lse)
            swapped += 1
        elif str(n.target) == "mtc.attention_backward.default":
            grad, q, k, v, causal, scale = n.args
            if not _flash_ok(q, k, v):
                continue
            key = (q, k, v, bool(causal), float(scale))
            with graph.inserting_before(n):
                if key not in forwards:  # a backward without its forward: recompute out and lse
                    call = graph.call_function(fwd_op, key)
                    call.meta["val"] = _flash_fwd_val(q)
                    forwards[key] = (_getitem(graph, call, 0), _getitem(graph, call, 1))
                out, lse = forwards[key]
                bwd = graph.call_function(bwd_op, (grad, q, k, v, out, lse, bool(causal), float(scale)))
                bwd.meta["val"] = n.meta["val"]
            n.replace_all_uses_with(bwd)
            graph.erase_node(n)
            swapped += 1
    if swapped:
        graph.lint()
    return swapped


def _flash_ops() -> tuple[object, object]:
    import mtc.kernels.flash_attention  # noqa: F401  (registers mtc::flash_attention_*)

    return torch.ops.mtc.flash_attention_fwd.default, torch.ops.mtc.flash_attention_bwd.default


def reads_any_layout(user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user`` takes ``value`` in any strides: the flash-attention ops read q, k and v (and
    the backward dO and O) through their strides, Triton's kernels and cuDNN's alike (the cuDNN
    backward is handed dO in O's layout, `cudnn_attention.backward`)."""
    fwd, bwd = _flash_ops()
    if user.op != "call_function" or user.target not in (fwd, bwd):
        return False
    tensors = user.args[:3] if user.target is fwd else user.args[:5]
    return all(a is not value for a in user.args[len(tensors):]) and any(a is value for a in tensors)


def attention_output_layout_known(node: fx.Node) -> bool:
    """Whether ``node`` views a flash-attention output whose layout at run time is the one its
    meta value records. O is laid out like q (``empty_like``), so q's layout must be known: q
    views a value recorded contiguous, which is laid out so at run time whether ATen or a
    generated kernel computes it (a kernel writes the layout the trace recorded, or the group
    stays on ATen: `mtc.kernels.codegen`'s ``_layout``)."""
    fwd, _ = _flash_ops()
    root = view_root(node)
    if not (root.op == "call_function" and root.target is operator.getitem and root.args[1] == 0
            and isinstance(root.args[0], fx.Node) and root.args[0].target is fwd):
        return False
    v = _val(view_root(root.args[0].args[0]))
    return v is not None and v.is_contiguous()


def refresh_attention_meta(graph: fx.Graph) -> int:
    """Recompute the flash-attention ops' meta values from their inputs' current ones (O laid out
    as q, the gradients as their inputs: what the ops return), after a pass changed their layouts;
    returns the ops whose values changed."""
    fwd, bwd = _flash_ops()
    changed = 0
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in (fwd, bwd):
            continue
        if n.target is fwd:
            new = _flash_fwd_val(n.args[0])
        else:
            new = tuple(torch.empty_like(_val(a), device="meta") for a in n.args[1:4])
        old = n.meta.get("val")
        if old is None or any(a.stride() != b.stride() for a, b in zip(old, new, strict=True)):
            changed += 1
        n.meta["val"] = new
    return changed


def _scale_of(mul: fx.Node, src: fx.Node) -> fx.Node | None:
    """The other factor of ``src * other`` if ``mul`` is that and ``other`` is a 0-dim tensor node."""
    if mul.op != "call_function" or mul.target is not aten.mul.Tensor or mul.kwargs or len(mul.args) != 2:
        return None
    other = mul.args[1] if mul.args[0] is src else mul.args[0] if mul.args[1] is src else None
    v = _val(other)
    return other if isinstance(other, fx.Node) and other is not src and v is not None and v.dim() == 0 else None


def fold_ce_grad_scale(graph: fx.Graph) -> int:
    """Fold the incoming gradient into each fused linear + cross-entropy whose dx, dW and db are
    all used only as ``grad * g`` with one 0-dim ``g`` defined before the op; returns how many."""
    import mtc.kernels.linear_cross_entropy  # noqa: F401  (registers the ops)

    fwd_bwd = torch.ops.mtc.linear_cross_entropy_fwd_bwd.default
    scaled_op = torch.ops.mtc.linear_cross_entropy_fwd_bwd_scaled.default
    order = {n: i for i, n in enumerate(graph.nodes)}
    folded = 0
    for op in list(graph.nodes):
        if op.op != "call_function" or op.target is not fwd_bwd:
            continue
        gets = {u.args[1]: u for u in op.users if u.target is operator.getitem}
        if len(gets) != len(op.users):
            continue
        scale, muls, ok = None, [], True
        for i in (1, 2, 3):
            for u in gets[i].users if i in gets else ():
                g = _scale_of(u, gets[i])
                ok = ok and g is not None and (scale is None or g is scale)
                scale = scale if g is None else g
                muls.append((i, u))
        if not ok or scale is None or order[scale] > order[op]:
            continue
        x, w, b, t, ignore_index, chunk_rows = op.args
        with graph.inserting_after(op):
            new = graph.call_function(scaled_op, (x, w, b, t, scale, ignore_index, chunk_rows))
        new.meta = dict(op.meta)
        outs = {}
        for i in sorted(set(gets) | {i for i, _ in muls}):
            with graph.inserting_after(new):
                outs[i] = graph.call_function(operator.getitem, (new, i))
            outs[i].meta = dict(gets[i].meta)
        for i, u in muls:
            u.replace_all_uses_with(outs[i])
            graph.erase_node(u)
        for i, g in gets.items():
            g.replace_all_uses_with(outs[i])
            graph.erase_node(g)
        graph.erase_node(op)
        folded += 1
    if folded:
        graph.lint()
    return folded
