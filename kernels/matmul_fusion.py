"""Fuse norms into the matmuls they feed and activations / residual adds into the matmuls before
them, where the fused Triton matmul (kernels/fused_matmul.py) beats cuBLAS + a separate kernel.

A *site* is an ``mm`` or ``addmm`` (bias) of a lowered graph, its output seen through a view as
(..., N), and what it can absorb:

* epilogue: an activation (``gelu``, tanh-``gelu``, ``silu``, ``relu``) that is the output's only
  user, then a residual ``add`` of a same-shape tensor that is the previous value's only user
  (values with other users, e.g. a pre-activation the backward reads, stay in memory and keep
  their op outside);
* prologue: an operand is ``view(xn)`` where ``xn = ((x - mean) * rstd) [cast] * w [+ b]`` is a
  LayerNorm or RMSNorm with per-row ``mean`` / ``rstd``: the A operand of the matmuls the norm
  feeds, and in joint graphs the B operand of their weight gradients (``dy^T @ xn``); taken only
  when every user of ``xn`` is such an operand (then ``xn`` is never written: the norm's row
  kernel writes two floats per row and each matmul normalises rows while loading them).

Whether a site is fused is chosen per shape by timing on CUDA, both ways on random inputs of the
site's shapes (the fused kernel against cuBLAS followed by the separate torch ops), and the choice
is remembered in ``matmul_fusion.json`` in the kernel cache (its directory is keyed by torch,
triton and the device capability). On the CPU nothing is fused unless ``mode="on"`` (tests): the
interpreter's timings say nothing about a GPU. Graph surgery plus that timing; no other I/O.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from mtc.kernels.tuning import cuda_bench_ms
from torch import fx

__all__ = ["MODES", "Site", "find_sites", "fuse_matmuls"]

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

    def key(self) -> str:
        """What the timing choice depends on: shapes, dtypes and which parts are fused."""
        a, b = _val(self.a), _val(self.b)
        p = self.prologue
        norm = "none" if p is None else (("layer" if p.mean is not None else "rms") + ("+round" if p.round_norm else "")
                                         + ("@b" if self.prologue_on == "b" else ""))
        return (f"M{a.shape[0]} K{a.shape[1]} N{b.shape[1]} {str(b.dtype).removeprefix('torch.')} norm={norm} "
                f"bias={self.bias is not None} act={self.act} residual={self.residual is not None}")


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


def _epilogue(site: Site) -> None:
    """Extend ``site`` over a view, an activation and a residual add that only it feeds."""
    out = site.mm
    nxt = _single_user(out)
    if _call(nxt, aten.view.default, aten._unsafe_view.default):
        out = nxt
    site.last = out
    nxt = _single_user(out)
    if _call(nxt, *(aten.gelu.default, *_ACTS)) and _act_of(nxt):
        site.act, site.last = _act_of(nxt), nxt
        out = nxt
    nxt = _single_user(out)
    if _call(nxt, aten.add.Tensor) and not nxt.kwargs and len(nxt.args) == 2:
        other = nxt.args[1] if nxt.args[0] is out else nxt.args[0]
        vo, vr = _val(out), _val(other)
        if (other is not out and vr is not None and vo is not None and vr.shape == vo.shape and vr.dtype == vo.dtype
                and vr.is_contiguous() and _val(nxt).dtype == vo.dtype):
            site.residual, site.last = other, nxt


def find_sites(graph: fx.Graph) -> list[Site]:
    """Every fusable matmul of ``graph`` with its epilogue and (where its norm allows) prologue."""
    sites: list[Site] = []
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
        _epilogue(site)
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
        for s, side in group:
            s.prologue, s.prologue_on = p, side
    return sites


def _random(v: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Random values laid out as the graph's value is (a weight's transpose stays transposed: the
    kernels' speed depends on it)."""
    t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
    return t.normal_() if v.dtype.is_floating_point else t.zero_()


def _site_runs(site: Site, device: torch.device) -> tuple[Callable[[], torch.Tensor], Callable[[], object], Callable[[], torch.Tensor]]:
    """(fused, unfused, reference) launches of ``site`` on random inputs of its shapes.

    fused: the Triton kernel. unfused: what the graph runs without it, by memory traffic: the norm's
    row kernel writing the normalised tensor (a copy of x: the statistics pass both sides share is
    left out), cuBLAS (with its bias), then one elementwise pass reading the product (and the
    residual) and writing the result, as the generated kernel after the matmul would.
    """
    import torch.nn.functional as F
    from mtc.kernels.fused_matmul import fused_mm, fused_mm_ref

    a2 = _random(_val(site.a), device)
    b = _random(_val(site.b), device)
    kw: dict[str, torch.Tensor | None] = {"bias": None, "residual": None}
    if site.bias is not None:
        kw["bias"] = _random(_val(site.bias), device)
    if site.residual is not None:
        kw["residual"] = _random(_val(site.residual), device).reshape(a2.shape[0], b.shape[1])
    p = site.prologue
    on_b = p is not None and site.prologue_on == "b"
    if p is not None:
        if on_b:
            b = _random(_val(p.x), device).reshape(b.shape)
        else:
            a2 = _random(_val(p.x), device).reshape(a2.shape)
        kw["rstd"] = torch.rand(_val(p.rstd).shape, device=device, dtype=_val(p.rstd).dtype) + 0.5
        if p.mean is not None:
            kw["mean"] = _random(_val(p.mean), device)
        for name, node in (("norm_w", p.w), ("norm_b", p.b)):
            if node is not None:
                kw[name] = _random(_val(node), device)
    round_norm = bool(p and p.round_norm)

    def fused() -> torch.Tensor:
        return fused_mm(a2, b, act=site.act, round_norm=round_norm, norm_on_b=on_b, **kw)

    def reference() -> torch.Tensor:
        return fused_mm_ref(a2, b, act=site.act, round_norm=round_norm, norm_on_b=on_b, **kw)

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
    """Per-shape fuse-or-not decisions, timed once on CUDA and kept in the kernel cache."""

    def __init__(self, cache: Path | None, bench: Callable[[Callable[[], None]], float] = cuda_bench_ms) -> None:
        self.path = cache / CHOICES if cache is not None else None
        self.bench = bench
        self.known: dict[str, dict] = {}
        if self.path is not None and self.path.is_file():
            try:
                self.known = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self.known = {}  # a torn or foreign file: time again

    def fused(self, site: Site, device: torch.device) -> bool:
        """Whether the fused kernel is right and faster for ``site`` (checked against its torch
        reference and timed on first sight of its key; a disagreement warns and keeps cuBLAS)."""
        key = site.key()
        if key not in self.known:
            fused, unfused, reference = _site_runs(site, device)
            err: float | None = None
            tf: float | None = None
            try:
                got, want = fused().float(), reference().float()
                err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
                if err <= _tolerance(want.device, _val(site.b).dtype):
                    tf = self.bench(fused)
                else:
                    warnings.warn(f"fused matmul disagrees with its reference at {key} (relative error {err:.2e}); "
                                  f"mtc keeps cuBLAS there", stacklevel=2)
            except Exception as e:  # noqa: BLE001  (a kernel that cannot launch here just loses)
                warnings.warn(f"fused matmul cannot run at {key} ({type(e).__name__}: {str(e)[:160]}); "
                              f"mtc keeps cuBLAS there", stacklevel=2)
            tu = self.bench(unfused)
            self.known[key] = {"fused_ms": tf, "unfused_ms": tu, "rel_err": err, "fused": tf is not None and tf < tu}
            self._save()
        return bool(self.known[key]["fused"])

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.known, indent=1, sort_keys=True))
        tmp.replace(self.path)


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
    """Put one ``mtc::fused_mm`` call where ``site.last`` was; ``moved`` maps the values earlier
    rewrites replaced to their new nodes (sites were found before any rewrite)."""
    import mtc.kernels.fused_matmul  # noqa: F401  (registers mtc::fused_mm)

    def now(n: fx.Node | None) -> fx.Node | None:
        return moved.get(n, n) if n is not None else None

    va, vb = _val(site.a), _val(site.b)
    M, N = va.shape[0], vb.shape[1]
    p = site.prologue if with_prologue else None
    on_b = p is not None and site.prologue_on == "b"
    with graph.inserting_before(site.last):
        a = _view(graph, now(p.x), list(va.shape)) if p is not None and not on_b else now(site.a)
        b = _view(graph, now(p.x), list(vb.shape)) if on_b else now(site.b)
        res = _view(graph, now(site.residual), [M, N]) if site.residual is not None else None
        norm = tuple(map(now, (p.mean, p.rstd, p.w, p.b))) if p is not None else (None, None, None, None)
        call = graph.call_function(torch.ops.mtc.fused_mm.default,
                                   (a, b, now(site.bias), res, *norm, site.act, bool(p and p.round_norm), on_b))
        call.meta["val"] = torch.empty((M, N), dtype=vb.dtype, device="meta")
        out = _view(graph, call, list(_val(site.last).shape)) if tuple(_val(site.last).shape) != (M, N) else call
    site.last.replace_all_uses_with(out)
    moved[site.last] = out


def fuse_matmuls(graph: fx.Graph, mode: str = "auto", cache: Path | None = None,
                 device: torch.device | None = None, choices: Choices | None = None) -> list[str]:
    """Rewrite the sites of ``graph`` that are worth fusing into ``mtc::fused_mm``; returns a line
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
