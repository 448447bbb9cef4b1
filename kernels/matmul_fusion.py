"""Fuse norms into the matmuls they feed and activations / residual adds into the matmuls before
them, where the fused Triton matmul (kernels/fused_matmul.py) beats cuBLAS + a separate kernel.

A *site* is an ``mm`` or ``addmm`` (bias) of a lowered graph, its output seen through a view as
(..., N), and what it can absorb:

* epilogue: an activation (``gelu``, tanh-``gelu``, ``silu`` (also as lowered,
  ``x * sigmoid(x)``), ``relu``) of the output whose result is written to memory anyway (a matmul
  or another op no generated kernel absorbs reads it: GPT-2's GELU feeding c_proj, not Llama's
  SiLU, which only the gating multiply's generated kernel reads and computes on the fly), then a
  residual ``add`` of a same-shape tensor that is the previous value's only user. Where the
  product has users besides its activation (a pre-activation the backward reads: joint graphs),
  the site becomes ``mtc::fused_mm_pre``, which writes the product for those users and the
  activation's result for the others (a residual is then taken only if it is computed before
  the product);
* prologue: an operand is ``view(xn)`` where ``xn = ((x - mean) * rstd) [cast] * w [+ b]`` is a
  LayerNorm or RMSNorm with per-row ``mean`` / ``rstd``: the A operand of the matmuls the norm
  feeds, and in joint graphs the B operand of their weight gradients (``dy^T @ xn``); taken only
  when every user of ``xn`` is such an operand (then ``xn`` is never written: the norm's row
  kernel writes two floats per row and each matmul normalises rows while loading them).

Whether a site is fused is chosen per shape by timing on CUDA, both ways on random inputs of the
site's shapes (the fused kernel against cuBLAS followed by the separate torch ops), and the choice
is remembered in ``matmul_fusion.json`` in the kernel cache under the stamp the compiler gives it
(mtc version, kernel-source hash, torch, triton, device capability): a file with another stamp
is timed again, so an edit of the fused kernel never inherits old timings. The compiler also
keeps each template's choices in its compiled record. On the CPU nothing is fused unless
``mode="on"`` (tests): the interpreter's timings say nothing about a GPU. Graph surgery plus that
timing; no other I/O.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from mtc.graphs.partition import classify
from mtc.kernels.codegen import FUSIBLE
from mtc.kernels.tuning import cuda_bench_ms, tuning_input
from torch import fx

__all__ = ["MODES", "Choices", "Site", "find_sites", "fuse_matmuls"]

aten = torch.ops.aten
MODES = ("auto", "on", "off")
CHOICES = "matmul_fusion.json"
_ACTS = {aten.silu.default: "silu", aten.relu.default: "relu"}


def _val(n: object) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _call(n: object, *targets: object) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


@dataclasses.dataclass(slots=True)
class Prologue:
    """``xn = ((x - mean) * rstd) [round] * w [+ b]`` feeding a matmul's A operand."""

    xn: fx.Node
    x: fx.Node
    mean: fx.Node | None
    rstd: fx.Node
    w: fx.Node | None
    b: fx.Node | None
    round_norm: bool


@dataclasses.dataclass(slots=True)
class Site:
    """One matmul and what it may absorb; ``last`` is the node whose value the fused op replaces."""

    mm: fx.Node
    a: fx.Node
    b: fx.Node
    bias: fx.Node | None
    act: str = "none"
    residual: fx.Node | None = None
    last: fx.Node | None = None
    prologue: Prologue | None = None
    prologue_on: str = "a"  # which operand is the normalised one ('b': a weight gradient dy^T @ xn)
    pre: fx.Node | None = None  # the product (mm or its view) when users besides the activation read it

    def key(self) -> str:
        """What the timing choice depends on: shapes, dtypes and which parts are fused."""
        a, b = _val(self.a), _val(self.b)
        p = self.prologue
        norm = "none" if p is None else (("layer" if p.mean is not None else "rms") + ("+round" if p.round_norm else "")
                                         + ("@b" if self.prologue_on == "b" else ""))
        return (f"M{a.shape[0]} K{a.shape[1]} N{b.shape[1]} {str(b.dtype).removeprefix('torch.')} norm={norm} "
                f"bias={self.bias is not None} act={self.act} residual={self.residual is not None}"
                + (" pre=True" if self.pre is not None else ""))


def _vec(n: object, k: int) -> bool:
    v = _val(n)
    return v is not None and tuple(v.shape) == (k,)


def _per_row(n: object, rows: tuple[int, ...]) -> bool:
    v = _val(n)
    return v is not None and tuple(v.shape) == (*rows, 1)


def _mul_parts(n: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    if not _call(n, aten.mul.Tensor) or len(n.args) != 2 or not all(isinstance(a, fx.Node) for a in n.args):
        return None
    return n.args[0], n.args[1]


def match_norm(xn: fx.Node) -> Prologue | None:
    """The LayerNorm / RMSNorm behind ``xn`` (lowered ATen), or None."""
    v = _val(xn)
    if v is None or v.dim() < 2:
        return None
    K, rows = v.shape[-1], tuple(v.shape[:-1])
    n, b, w = xn, None, None
    if _cast(n) and tuple(_val(n.args[0]).shape) == tuple(v.shape):
        n = n.args[0]  # half precision: the norm computes in fp32 and casts its result (the kernel casts too)
    if _call(n, aten.add.Tensor) and not n.kwargs and len(n.args) == 2 and _vec(n.args[1], K):
        n, b = n.args[0], n.args[1]
    parts = _mul_parts(n)
    if parts and _vec(parts[1], K) or parts and _vec(parts[0], K):
        n, w = (parts[0], parts[1]) if _vec(parts[1], K) else (parts[1], parts[0])
    round_norm = False
    if _cast(n) and _val(n).dtype == v.dtype and _val(n.args[0]).dtype != v.dtype:
        n, round_norm = n.args[0], True
    parts = _mul_parts(n)
    if parts is None:
        return None
    d, rstd = (parts[0], parts[1]) if _per_row(parts[1], rows) else (parts[1], parts[0])
    if not _per_row(rstd, rows) or tuple(_val(d).shape) != tuple(v.shape):
        return None
    mean = None
    if _call(d, aten.sub.Tensor) and not d.kwargs and _per_row(d.args[1], rows):
        d, mean = d.args[0], d.args[1]
    if w is None and b is None and not round_norm:
        return None  # a bare (x - mean) * rstd: nothing worth a prologue (and too loose a match)
    if _cast(d) and _val(d).dtype == torch.float32:
        d = d.args[0]  # the kernel upcasts what it loads: read x itself, not its fp32 copy
    return Prologue(xn, d, mean, rstd, w, b, round_norm)


def _cast(n: object) -> bool:
    """A plain dtype conversion (``_to_copy`` with at most a dtype)."""
    return _call(n, aten._to_copy.default) and set(n.kwargs) <= {"dtype"} and isinstance(n.args[0], fx.Node)


def _single_user(n: fx.Node) -> fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _act_of(n: fx.Node) -> str | None:
    if n.target is aten.gelu.default:
        approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return "gelu_tanh" if approx == "tanh" else "gelu" if approx == "none" else None
    return _ACTS.get(n.target)


def _activation(out: fx.Node) -> tuple[str, fx.Node, set[fx.Node]] | None:
    """The one activation among ``out``'s users: (its name, the node holding its result, the users
    of ``out`` that compute it), or None. SiLU also as lowered, ``out * sigmoid(out)``."""
    found = []
    for u in out.users:
        if _call(u, aten.gelu.default, *_ACTS) and u.args[0] is out and _act_of(u):
            found.append((_act_of(u), u, {u}))
        elif _call(u, aten.sigmoid.default) and u.args[0] is out and not u.kwargs:
            m = _single_user(u)
            if _call(m, aten.mul.Tensor) and not m.kwargs and len(m.args) == 2 and set(m.args) == {out, u}:
                found.append(("silu", m, {u, m}))
    if len(found) != 1:
        return None
    vo, va = _val(out), _val(found[0][1])
    if vo is None or va is None or va.shape != vo.shape or va.dtype != vo.dtype:
        return None  # a promoting or broadcasting pattern: not what the epilogue computes
    return found[0]


def _materialised(n: fx.Node) -> bool:
    """Whether fusion groups would write ``n``'s value to memory: a user (through views) that a
    generated kernel cannot absorb (a matmul, attention, an op left to ATen, the graph's output).
    Otherwise the consumers' generated kernel computes ``n`` on the fly from its inputs."""
    for u in n.users:
        kind = classify(u, FUSIBLE)
        if kind == "view" and _materialised(u) or kind not in ("view", "fusible"):
            return True
    return False


def _epilogue(site: Site, order: dict[fx.Node, int]) -> None:
    """Extend ``site`` over a view, an activation and a residual add that only it feeds
    (``order``: the graph's node positions)."""
    out = site.mm
    nxt = _single_user(out)
    if _call(nxt, aten.view.default, aten._unsafe_view.default):
        out = nxt
    site.last = product = out
    hit = _activation(out)
    if hit is not None:
        site.act, site.last, computes = hit
        if set(out.users) - computes:
            site.pre = out  # read elsewhere too (the backward): the fused op writes it as well
        out = site.last
    nxt = _single_user(out)
    if _call(nxt, aten.add.Tensor) and not nxt.kwargs and len(nxt.args) == 2:
        other = nxt.args[1] if nxt.args[0] is out else nxt.args[0]
        vo, vr = _val(out), _val(other)
        # with the product written for other users, the fused op goes where the product was: the
        # residual must exist by then (it might even depend on the product otherwise)
        before = site.pre is None or (isinstance(other, fx.Node) and order[other] < order[site.pre])
        if (other is not out and vr is not None and vo is not None and vr.shape == vo.shape and vr.dtype == vo.dtype
                and vr.is_contiguous() and _val(nxt).dtype == vo.dtype and before):
            site.residual, site.last = other, nxt
    if site.act != "none" and not _materialised(site.last):
        # an activation (and residual) only generated kernels read is computed there on the fly:
        # moving it into the matmul saves no bytes (and, the product being read elsewhere too,
        # writes one more tensor): the site stays a plain matmul
        site.act, site.pre, site.residual, site.last = "none", None, None, product


def find_sites(graph: fx.Graph) -> list[Site]:
    """Every fusable matmul of ``graph`` with its epilogue and (where its norm allows) prologue."""
    sites: list[Site] = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        if _call(n, aten.mm.default):
            a, b, bias = n.args[0], n.args[1], None
        elif _call(n, aten.addmm.default) and not n.kwargs and _vec(n.args[0], _val(n).shape[-1]):
            bias, a, b = n.args
        else:
            continue
        va, vb = _val(a), _val(b)
        if va is None or vb is None or va.dtype != vb.dtype or not va.dtype.is_floating_point:
            continue
        site = Site(n, a, b, bias)
        _epilogue(site, order)
        sites.append(site)
    # prologues: a norm whose every user is, through a (rows, K) view, an operand of sites: the A
    # operand of the matmuls it feeds, the B operand of the weight gradients (dy^T @ xn) in joint graphs
    uses: dict[fx.Node, list[tuple[Site, str]]] = {}
    for s in sites:
        for side in ("a", "b"):
            v = getattr(s, side)
            if _call(v, aten.view.default, aten._unsafe_view.default) and isinstance(v.args[0], fx.Node):
                uses.setdefault(v.args[0], []).append((s, side))
    for xn, group in uses.items():
        views = {getattr(s, side) for s, side in group}
        vx = _val(xn)
        if vx is None or set(xn.users) != views or any(s.prologue is not None for s, _ in group):
            continue
        if any(set(v.users) - {s.mm for s, _ in group} for v in views):
            continue  # a view of xn also feeds something else: xn is written anyway
        if any(tuple(_val(v).shape) != (vx.numel() // vx.shape[-1], vx.shape[-1]) for v in views):
            continue
        p = match_norm(xn)
        if p is None or not (_val(p.x).is_contiguous() and vx.is_contiguous()):
            continue
        if _val(p.x).dtype != vx.dtype:  # the kernel reads x as the operand: a dtype of its own (an fp32 residual) cannot
            continue
        for s, side in group:
            s.prologue, s.prologue_on = p, side
    return sites


Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def _site_runs(site: Site, device: torch.device) -> tuple[Callable[[], Outputs], Callable[[], object], Callable[[], Outputs]]:
    """(fused, unfused, reference) launches of ``site`` on random inputs of its shapes.

    fused: the Triton kernel (writing the product too where ``site.pre`` is read elsewhere).
    unfused: what the graph runs without it, by memory traffic: the norm's row kernel writing the
    normalised tensor (a copy of x: the statistics pass both sides share is left out), cuBLAS (with
    its bias; it writes the product, pre-activation or not), then one elementwise pass reading the
    product (and the residual) and writing the result, as the generated kernel after the matmul would.
    """
    import torch.nn.functional as F
    from mtc.kernels.fused_matmul import fused_mm, fused_mm_pre, fused_mm_pre_ref, fused_mm_ref

    a2 = tuning_input(_val(site.a), device)
    b = tuning_input(_val(site.b), device)
    kw: dict[str, torch.Tensor | None] = {"bias": None, "residual": None}
    if site.bias is not None:
        kw["bias"] = tuning_input(_val(site.bias), device)
    if site.residual is not None:
        kw["residual"] = tuning_input(_val(site.residual), device).reshape(a2.shape[0], b.shape[1])
    p = site.prologue
    on_b = p is not None and site.prologue_on == "b"
    if p is not None:
        if on_b:
            b = tuning_input(_val(p.x), device).reshape(b.shape)
        else:
            a2 = tuning_input(_val(p.x), device).reshape(a2.shape)
        kw["rstd"] = tuning_input(_val(p.rstd), device).abs() + 0.5  # a positive scale, as an rstd is
        if p.mean is not None:
            kw["mean"] = tuning_input(_val(p.mean), device)
        for name, node in (("norm_w", p.w), ("norm_b", p.b)):
            if node is not None:
                kw[name] = tuning_input(_val(node), device)
    round_norm = bool(p and p.round_norm)

    kernel, ref = (fused_mm_pre, fused_mm_pre_ref) if site.pre is not None else (fused_mm, fused_mm_ref)

    def fused() -> Outputs:
        return kernel(a2, b, act=site.act, round_norm=round_norm, norm_on_b=on_b, **kw)

    def reference() -> Outputs:
        return ref(a2, b, act=site.act, round_norm=round_norm, norm_on_b=on_b, **kw)

    raw = b if on_b else a2
    xn = torch.empty(raw.shape, dtype=b.dtype, device=device) if p is not None else raw
    act = {"gelu": F.gelu, "gelu_tanh": F.gelu, "silu": F.silu, "relu": torch.relu}.get(site.act)
    bias, res = kw["bias"], kw["residual"]

    def unfused() -> object:
        if p is not None:
            xn.copy_(raw)
        lhs, rhs = (a2, xn) if on_b else (xn, b)
        c = torch.mm(lhs, rhs) if bias is None else torch.addmm(bias, lhs, rhs)
        if res is not None:
            return torch.add(c, res)  # act + residual: one generated kernel, the same bytes as this add
        return act(c) if act is not None else c

    return fused, unfused, reference


class Choices:
    """Per-shape fuse-or-not decisions, timed once on CUDA and kept in the kernel cache.

    ``stamp``: what the timings depend on besides the site (the compiler's toolchain key); a stored
    file with another stamp (or none) is ignored and rewritten. ``seconds``: time spent checking
    and timing sites; ``asked``: the keys looked up so far (a template's share of the choices).
    """

    def __init__(self, cache: Path | None, bench: Callable[[Callable[[], None]], float] = cuda_bench_ms,
                 stamp: dict[str, str] | None = None) -> None:
        self.path = cache / CHOICES if cache is not None else None
        self.bench = bench
        self.stamp = dict(stamp or {})
        self.known: dict[str, dict] = {}
        self.seconds = 0.0
        self.asked: set[str] = set()
        if self.path is not None and self.path.is_file():
            try:
                doc = json.loads(self.path.read_text())
                if isinstance(doc, dict) and doc.get("stamp") == self.stamp and isinstance(doc.get("choices"), dict):
                    self.known = doc["choices"]
            except (OSError, ValueError):
                self.known = {}  # a torn or foreign file: time again

    def fused(self, site: Site, device: torch.device) -> bool:
        """Whether the fused kernel is right and faster for ``site`` (checked against its torch
        reference and timed on first sight of its key; a disagreement warns and keeps cuBLAS)."""
        key = site.key()
        self.asked.add(key)
        if key not in self.known:
            t0 = time.perf_counter()
            fused, unfused, reference = _site_runs(site, device)
            err: float | None = None
            tf: float | None = None
            try:
                got, want = _flat_float(fused()), _flat_float(reference())
                err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
                if err <= _tolerance(want.device, _val(site.b).dtype):
                    tf = self.bench(fused)
                else:
                    warnings.warn(f"fused matmul disagrees with its reference at {key} (relative error {err:.2e}); "
                                  f"mtc keeps cuBLAS there", stacklevel=2)
            except Exception as e:  # noqa: BLE001  (a kernel that cannot launch here just loses)
                warnings.warn(f"fused matmul cannot run at {key} ({type(e).__name__}: {str(e)[:160]}); "
                              f"mtc keeps cuBLAS there", stacklevel=2)
            try:
                tu: float | None = self.bench(unfused)
            except Exception as e:  # noqa: BLE001  (cuBLAS's own run failed here: keep the graph as it is)
                warnings.warn(f"the unfused matmul at {key} failed to time ({type(e).__name__}: {str(e)[:160]}); "
                              f"mtc keeps cuBLAS there", stacklevel=2)
                tu = None
            self.known[key] = {"fused_ms": tf, "unfused_ms": tu, "rel_err": err,
                               "fused": tf is not None and tu is not None and tf < tu}
            self.seconds += time.perf_counter() - t0
            self._save()
        return bool(self.known[key]["fused"])

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stamp": self.stamp, "choices": self.known}, indent=1, sort_keys=True))
        tmp.replace(self.path)


def _flat_float(out: Outputs) -> torch.Tensor:
    """All of a launch's outputs as one fp32 vector (the error is judged over pre and post together)."""
    return torch.cat([t.float().reshape(-1) for t in (out if isinstance(out, tuple) else (out,))])


def _tolerance(device: torch.device, dtype: torch.dtype) -> float:
    """Relative (norm) error a fused matmul may show against its reference: products rounded to
    half precision, TF32 where torch allows it, plain fp32 otherwise."""
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2
    return 5e-3 if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32 else 1e-4


def _view(graph: fx.Graph, n: fx.Node, shape: list[int]) -> fx.Node:
    v = graph.call_function(aten.view.default, (n, shape))
    v.meta["val"] = _val(n).view(shape)
    return v


def _rewrite(graph: fx.Graph, site: Site, with_prologue: bool, moved: dict[fx.Node, fx.Node]) -> None:
    """Put one ``mtc::fused_mm`` call where ``site.last`` was (``mtc::fused_mm_pre`` right after the
    product, where ``site.pre`` has other users: they read its first output); ``moved`` maps the
    values earlier rewrites replaced to their new nodes (sites were found before any rewrite)."""
    import mtc.kernels.fused_matmul  # noqa: F401  (registers mtc::fused_mm, mtc::fused_mm_pre)

    def now(n: fx.Node | None) -> fx.Node | None:
        return moved.get(n, n) if n is not None else None

    def shaped(n: fx.Node, like: fx.Node) -> fx.Node:
        shape = tuple(_val(like).shape)
        return _view(graph, n, list(shape)) if shape != (M, N) else n

    va, vb = _val(site.a), _val(site.b)
    M, N = va.shape[0], vb.shape[1]
    p = site.prologue if with_prologue else None
    on_b = p is not None and site.prologue_on == "b"
    # the product's other users may come before the activation: the call then goes before them all
    # (its inputs, the residual included (see _epilogue), are computed before the product)
    where = site.last if site.pre is None else site.pre.next
    with graph.inserting_before(where):
        a = _view(graph, now(p.x), list(va.shape)) if p is not None and not on_b else now(site.a)
        b = _view(graph, now(p.x), list(vb.shape)) if on_b else now(site.b)
        res = _view(graph, now(site.residual), [M, N]) if site.residual is not None else None
        norm = tuple(map(now, (p.mean, p.rstd, p.w, p.b))) if p is not None else (None, None, None, None)
        args = (a, b, now(site.bias), res, *norm, site.act, bool(p and p.round_norm), on_b)
        if site.pre is None:
            call = graph.call_function(torch.ops.mtc.fused_mm.default, args)
            call.meta["val"] = torch.empty((M, N), dtype=vb.dtype, device="meta")
            out = shaped(call, site.last)
        else:
            call = graph.call_function(torch.ops.mtc.fused_mm_pre.default, args)
            call.meta["val"] = tuple(torch.empty((M, N), dtype=vb.dtype, device="meta") for _ in range(2))
            pre, post = (graph.call_function(operator.getitem, (call, i)) for i in range(2))
            pre.meta["val"], post.meta["val"] = call.meta["val"]
            pre, out = shaped(pre, site.pre), shaped(post, site.last)
    site.last.replace_all_uses_with(out)
    moved[site.last] = out
    if site.pre is not None:
        site.pre.replace_all_uses_with(pre)  # the activation's own nodes are dead by now
        moved[site.pre] = pre


def fuse_matmuls(graph: fx.Graph, mode: str = "auto", cache: Path | None = None,
                 device: torch.device | None = None, choices: Choices | None = None) -> list[str]:
    """Rewrite the sites of ``graph`` that are worth fusing into ``mtc::fused_mm`` (or
    ``mtc::fused_mm_pre``, where the pre-activation is read elsewhere too); returns a line
    per fused site (its key). ``mode``: 'auto' (time on CUDA, nothing on the CPU), 'on', 'off'.
    ``choices`` (tests) replaces the timing cache, and then 'auto' consults it on any device."""
    if mode not in MODES:
        raise ValueError(f"matmul fusion mode must be one of {MODES}, got {mode!r}")
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if mode == "off" or (mode == "auto" and device.type != "cuda" and choices is None):
        return []
    choices = choices or Choices(cache)

    def chosen(s: Site) -> bool:
        return mode == "on" or choices.fused(s, device)

    sites = find_sites(graph)
    # a norm's prologue pays only if every matmul it feeds takes it: otherwise xn is written anyway
    by_norm: dict[fx.Node, list[Site]] = {}
    for s in sites:
        if s.prologue is not None:
            by_norm.setdefault(s.prologue.xn, []).append(s)
    for group in by_norm.values():
        if not all(chosen(s) for s in group):
            for s in group:
                s.prologue = None
    done: list[str] = []
    moved: dict[fx.Node, fx.Node] = {}
    for s in sites:
        if s.prologue is None and s.act == "none" and s.residual is None:
            continue  # a plain mm or addmm: cuBLAS adds the bias itself, nothing to fuse
        if s.prologue is None and not chosen(s):
            continue
        _rewrite(graph, s, s.prologue is not None, moved)
        done.append(s.key())
    if done:
        graph.eliminate_dead_code()
        graph.lint()
    return done
