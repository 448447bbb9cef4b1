"""Generate a Triton kernel for a fusion group, from the group's FX nodes.

Four kernel shapes cover what `mtc.graphs.partition` groups (from the ops `FUSIBLE` lists):

* ``pointwise``: one program per BLOCK elements of the iteration shape S; every input is read
  through its strides after broadcasting to S (so transposed or expanded inputs need no copy);
* ``row``: groups with last-dimension reductions (norms, softmax pieces): one program per row of
  S, the row in one block of next_pow2(N) columns; a reduction yields a per-row scalar that later
  nodes broadcast against full rows;
* ``column``: groups ending in reductions over every leading dim (weight and bias gradients):
  programs on a (column blocks, row chunks) grid, each looping over [BLOCK_M, BLOCK] tiles of
  its rows and accumulating them elementwise in an fp32 tile, reduced across rows once after the
  loop; the pointwise producers of the reduced value are computed in the same loop. Each chunk
  writes an fp32 partial per column and a second small kernel (kernels/column_reduce.py)
  combines the partials in a fixed order (deterministic, unlike atomics), scales and casts.
* ``rowcol``: groups with both (a norm's backward: the input gradient needs row sums, the weight
  gradient column sums of values computed from the same rows): each program walks a chunk of
  whole rows as a row kernel does, one row at a time, and adds each column reduction's input row
  into an fp32 accumulator of one row's width; after its last row it writes that partial, and the
  second stage combines the chunks as for ``column``. The row's inputs are read once, where a row
  kernel and a column kernel would each read them (and the row kernel write what the column
  kernel reads back).

A cat along the last dim is computed in place: its inputs are computed in their column windows
of S (loads at shifted columns, masked to the window) and picked per column with ``tl.where``.

Every value is computed in fp32 (loads are cast up, stores cast to the node's dtype); offsets are
int64; every load and store is masked. The source is written to a file (Triton's JIT reads kernel
source with `inspect`) in a cache directory and imported from there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import math
import operator
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from mtc.graphs.partition import CAT, Frame, FusibleOps, FusionGroup, arg_frames, column_cast, is_column_reduction
from mtc.kernels.column_reduce import combine_partials
from mtc.kernels.tuning import Decisions, Tuner
from torch import fx

from mtc.errors import KernelInputError

__all__ = ["FUSIBLE", "MAX_ROW", "TUNED_MODES", "CodegenError", "FusedKernel", "compile_group", "generate_source",
           "generated_tuning", "generated_tuning_seconds", "load_kernel", "seed_generated_tuning"]

# Column and rowcol kernels read at 2.0-2.9 TB/s of the H200's ~4.8 where row and pointwise ones
# reach 3.8-4.4 (bench_fusion, GPT-2 block, 2026-11-27): their launch configuration (tile, warps,
# programs per SM) is timed per kernel and shape when a plan compiles on CUDA (`FusedKernel.tune`,
# the compiler's "tune generated kernels" pass), the default among the candidates, so a choice is
# never slower than the default as timed; a compiled plan stores the choices and seeds them back.
TUNED_MODES = ("column", "rowcol")
_TUNER = Tuner("generated kernels")


def seed_generated_tuning(decisions: Decisions) -> None:
    """Take a compiled plan's launch choices for generated kernels as known (nothing is timed again)."""
    _TUNER.seed(decisions)


def generated_tuning() -> Any:
    """A context collecting the launch choices generated kernels use inside it (`Tuner.recording`)."""
    return _TUNER.recording()


def generated_tuning_seconds() -> float:
    """Seconds this process has spent timing generated kernels' launch configurations."""
    return _TUNER.seconds

aten = torch.ops.aten
MAX_ROW = 16384  # widest row a row kernel holds in one block

_TL_DTYPE = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.bool: "tl.int1", torch.int64: "tl.int64", torch.int32: "tl.int32",
}


# What this generator can express, handed to graphs.partition (the one list of fusible ops):
# every pointwise op below has an expression in `_expr`; reductions run as row or column kernels.
REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.mean.dim, aten.amax.default})
FUSIBLE = FusibleOps(
    pointwise=frozenset({
        aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
        aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.exp.default, aten.log.default,
        aten.sqrt.default, aten.rsqrt.default, aten.reciprocal.default, aten.sigmoid.default,
        aten.tanh.default, aten.relu.default, aten.abs.default, aten.pow.Tensor_Scalar,
        aten.maximum.default, aten.minimum.default, aten.where.self, aten.clone.default,
        aten._to_copy.default, aten.silu.default, aten.gelu.default, aten.erf.default,
        aten.lt.Scalar, aten.gt.Scalar, aten.le.Scalar, aten.ge.Scalar, aten.eq.Scalar,
        aten.lt.Tensor, aten.gt.Tensor, aten.le.Tensor, aten.ge.Tensor,
        aten.sin.default, aten.cos.default, aten.fill.Scalar, aten.copy.default,
    }),
    reductions=REDUCTIONS,
    cat=True,
    row_and_column=MAX_ROW,
)


class CodegenError(Exception):
    """This group cannot be expressed by the generator; the plan keeps it on ATen."""


def _lit(x: Any) -> str:
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, (int, float)):
        if isinstance(x, float) and not math.isfinite(x):
            return "float('inf')" if x > 0 else ("float('-inf')" if x < 0 else "float('nan')")
        return repr(float(x))
    raise CodegenError(f"unsupported scalar argument {x!r}")


def _sig(a: str) -> str:
    return f"(1.0 / (1.0 + tl.exp(-({a}))))"


def _expr(node: fx.Node, v: Callable[[Any], str]) -> str:
    """Triton expression for one pointwise node (arguments already named by ``v``)."""
    t, a = node.target, node.args
    if t in (aten.add.Tensor, aten.sub.Tensor):
        alpha = node.kwargs.get("alpha", 1)
        rhs = v(a[1]) if alpha == 1 else f"({v(a[1])} * {_lit(alpha)})"
        return f"({v(a[0])} {'+' if t is aten.add.Tensor else '-'} {rhs})"
    simple = {
        aten.add.Scalar: "+", aten.sub.Scalar: "-", aten.mul.Tensor: "*", aten.mul.Scalar: "*",
        aten.div.Tensor: "/", aten.div.Scalar: "/",
    }
    if t in simple:
        return f"({v(a[0])} {simple[t]} {v(a[1])})"
    cmp = {aten.lt: "<", aten.gt: ">", aten.le: "<=", aten.ge: ">=", aten.eq: "=="}
    for packet, op in cmp.items():
        if t in (getattr(packet, "Scalar", None), getattr(packet, "Tensor", None)):
            return f"({v(a[0])} {op} {v(a[1])})"
    unary = {
        aten.neg.default: "(-({0}))", aten.exp.default: "tl.exp({0})", aten.log.default: "tl.log({0})",
        aten.sqrt.default: "tl.sqrt({0})", aten.rsqrt.default: "(1.0 / tl.sqrt({0}))",
        aten.reciprocal.default: "(1.0 / ({0}))", aten.sigmoid.default: _sig("{0}"),
        aten.tanh.default: "(2.0 * " + _sig("2.0 * ({0})") + " - 1.0)", aten.relu.default: "tl.maximum({0}, 0.0)",
        aten.abs.default: "tl.abs({0})", aten.clone.default: "({0})", aten.silu.default: "(({0}) * " + _sig("{0}") + ")",
        aten.sin.default: "tl.sin({0})", aten.cos.default: "tl.cos({0})", aten.erf.default: "tl.erf({0})",
    }
    if t in unary:
        return unary[t].format(v(a[0]))
    if t is aten.pow.Tensor_Scalar:
        e, x = a[1], v(a[0])
        if e == 0.5:
            return f"tl.sqrt({x})"
        if e == -0.5:
            return f"(1.0 / tl.sqrt({x}))"
        if not float(e).is_integer():  # NaN for a negative base, as in torch
            return f"tl.exp({_lit(e)} * tl.log({x}))"
        # an integral exponent (3.0 as much as 3): exp(e * log(x)) would be NaN for a negative x
        k = int(e)
        if k == 0:  # 1 everywhere, also at 0, inf and NaN
            return f"tl.where({x} == {x}, 1.0, 1.0)"
        if abs(k) <= 4:
            mag = "(" + " * ".join([x] * abs(k)) + ")"
        else:
            mag = f"tl.exp({_lit(abs(k))} * tl.log(tl.abs({x})))"
            if k % 2:
                mag = f"tl.where({x} < 0.0, -{mag}, {mag})"
        return mag if k > 0 else f"(1.0 / {mag})"
    if t in (aten.maximum.default, aten.minimum.default):
        return f"tl.{'maximum' if t is aten.maximum.default else 'minimum'}({v(a[0])}, {v(a[1])})"
    if t is aten.where.self:
        return f"tl.where({v(a[0])}, {v(a[1])}, {v(a[2])})"
    if t is aten.gelu.default:
        if node.kwargs.get("approximate", "none") == "tanh":
            x = v(a[0])
            inner = f"(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))"
            return f"(0.5 * {x} * (1.0 + (2.0 * " + _sig(f"2.0 * {inner}") + " - 1.0)))"
        return f"(0.5 * {v(a[0])} * (1.0 + tl.erf({v(a[0])} * 0.7071067811865476)))"
    if t is aten._to_copy.default:
        dt = node.kwargs.get("dtype")
        if dt in (torch.float16, torch.bfloat16):  # round like ATen would, keep computing in fp32
            return f"({v(a[0])}).to({_TL_DTYPE[dt]}).to(tl.float32)"
        if dt in (None, torch.float32, torch.float64):
            return f"({v(a[0])})"
        raise CodegenError(f"cast to {dt} is not generated")
    if t is aten.fill.Scalar:
        return f"({v(a[0])} * 0.0 + {_lit(a[1])})"
    if t is aten.copy.default:
        return f"({v(a[1])})"
    raise CodegenError(f"no expression for {t}")


def _shape(n: fx.Node) -> tuple[int, ...]:
    return tuple(n.meta["val"].shape)


def _dtype(n: fx.Node) -> torch.dtype:
    return n.meta["val"].dtype


def _mode(group: FusionGroup) -> str:
    """'pointwise', 'row' (last-dim reductions), 'column' (reductions over all leading dims) or
    'rowcol' (both)."""
    reds = [n for n in group.nodes if n.target in REDUCTIONS]
    if not reds:
        return "pointwise"
    column = [n for n in reds if is_column_reduction(n)]
    if not column:
        return "row"
    return "column" if len(column) == len(reds) else "rowcol"


def _reduced(o: fx.Node, mode: str) -> fx.Node | None:
    """Column and rowcol modes: the column reduction output ``o`` is (or casts: `column_cast`), else None."""
    if mode not in ("column", "rowcol"):
        return None
    if o.target in REDUCTIONS and is_column_reduction(o):
        return o
    return column_cast(o, REDUCTIONS)


def _check_outputs(group: FusionGroup, mode: str) -> None:
    S = group.shape
    for o in group.outputs:
        s = _shape(o)
        if _reduced(o, mode) is not None:
            if math.prod(s) != S[-1] or s[-1:] != S[-1:]:
                raise CodegenError(f"column reduction {o.name} has shape {s}, not ({S[-1]},)")
        elif s != S and not (mode in ("row", "rowcol") and s == (*S[:-1], 1)):
            raise CodegenError(f"output {o.name} has shape {s}, not the iteration shape {S}")
        if _dtype(o) not in _TL_DTYPE:
            raise CodegenError(f"output dtype {_dtype(o)}")
        if _unwritable(o, S, mode):
            raise CodegenError(f"output {o.name} is recorded with strides {o.meta['val'].stride()} (not dense), which the "
                               "kernel cannot write")
    if mode in ("column", "rowcol") and any(u in set(group.nodes) and column_cast(u, REDUCTIONS) is not n
                                            for n in group.nodes if n.target in REDUCTIONS and is_column_reduction(n)
                                            for u in n.users):
        raise CodegenError(f"{group.name}: a column reduction is used inside its own group")


def _dense_strides(v: torch.Tensor) -> tuple[int, ...] | None:
    """``v``'s strides when it is non-overlapping and dense and not contiguous; None otherwise."""
    shape, st = tuple(v.shape), v.stride()
    if len(shape) < 2 or any(n == 0 for n in shape) or v.is_contiguous():
        return None
    # dense and non-overlapping: the strides, sorted, are the running products of the sizes in that order
    run = 1
    for d in sorted(range(len(shape)), key=lambda d: (st[d], -d)):
        if shape[d] != 1 and st[d] != run:
            return None
        run *= shape[d]
    return tuple(int(x) for x in st)


def _layout(o: fx.Node, S: tuple[int, ...], mode: str) -> tuple[int, ...] | None:
    """The strides an output is written with when not contiguous: those the trace recorded for it,
    so the graph's later views (which need the layout they were traced against) apply at run
    time (a q normed after its transpose to (B, H, T, D) is recorded in the (B, T, H, D) layout,
    and ops viewing it, or values laid out like it, rely on that): a full-shape output, or a
    per-row one (..., 1) of a row or rowcol kernel, recorded dense (ATen's outputs are); None
    (contiguous) otherwise. Column reductions are 1-D. A last dim that is not innermost is
    written strided (slow, but as recorded: a norm of a transposed input, say). `_check_outputs`
    refuses a group whose output is recorded in a layout this cannot write."""
    v = o.meta.get("val") if isinstance(o, fx.Node) else None
    if not isinstance(v, torch.Tensor) or _reduced(o, mode) is not None:
        return None
    if tuple(v.shape) != S and not (mode in ("row", "rowcol") and tuple(v.shape) == (*S[:-1], 1)):
        return None
    return _dense_strides(v)


def _unwritable(o: fx.Node, S: tuple[int, ...], mode: str) -> bool:
    """An output recorded in a layout other than contiguous that `_layout` cannot write (not
    dense): the group stays on ATen, which keeps the recorded layout."""
    v = o.meta.get("val") if isinstance(o, fx.Node) else None
    if not isinstance(v, torch.Tensor) or _reduced(o, mode) is not None or v.numel() == 0 or v.is_contiguous():
        return False
    return _layout(o, S, mode) is None


def _prologue(mode: str, S: tuple[int, ...]) -> list[str]:
    """Index set-up: leading indices ``i0..i{R-2}``, columns ``cols`` and ``mask`` for each mode.

    pointwise: flat 1-D blocks; row: one row per program, 1-D columns; column: a block of columns
    and a chunk of CHUNK rows per program, in [BLOCK_M, BLOCK] tiles; rowcol: a chunk of CHUNK
    whole rows per program, one row per step (the loop body follows, indented, in the last two).
    """
    R, N = len(S), S[-1]
    if mode == "pointwise":
        L = ["pid = tl.program_id(0).to(tl.int64)", "offs = pid * BLOCK + tl.arange(0, BLOCK)", "mask = offs < NUMEL",
             "rem = offs"]
        for d in reversed(range(R)):
            L += [f"i{d} = rem % {S[d]}", f"rem = rem // {S[d]}"]
        return L + [f"cols = i{R - 1}"]
    if mode == "row":
        # int64 columns: a transposed input's last-dim stride times the column can pass 2^31
        L = ["row = tl.program_id(0).to(tl.int64)", "cols = tl.arange(0, BLOCK).to(tl.int64)", f"mask = cols < {N}", "rem = row"]
    elif mode == "rowcol":
        # the loop runs over exactly this chunk's rows (the last chunk is cut at M): no row mask;
        # the bounds are int64 (pid is), so the row offsets are too
        M = math.prod(S[:-1])
        L = ["pid = tl.program_id(0).to(tl.int64)", "cols = tl.arange(0, BLOCK).to(tl.int64)", f"mask = cols < {N}", "%ACC%",
             "r_lo = pid * CHUNK", f"r_hi = tl.minimum(r_lo + CHUNK, {M})",
             # STAGES > 1: the next rows' loads are issued (async copies) while this row computes
             "for row in tl.range(r_lo, r_hi, num_stages=STAGES):", "    rem = row"]
    else:
        M = math.prod(S[:-1])
        L = ["pid = tl.program_id(0).to(tl.int64)", "ccols = pid * BLOCK + tl.arange(0, BLOCK)", f"cmask = ccols < {N}",
             "cols = ccols[None, :]", "%ACC%", "r_lo = tl.program_id(1) * CHUNK",
             "for r0 in tl.range(r_lo, r_lo + CHUNK, BLOCK_M, num_stages=STAGES):",
             "    row = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]", f"    mask = (row < {M}) & cmask[None, :]",
             "    rem = row"]
    ind = "    " if mode in ("column", "rowcol") else ""
    for d in reversed(range(R - 1)):
        L += [f"{ind}i{d} = rem % {S[d]}", f"{ind}rem = rem // {S[d]}"]
    return L


class _Emitter:
    """Writes the kernel body: each (node, frame) once, its inputs first (see partition.arg_frames).

    A frame (first column, width) is the window of the iteration shape's last dim a value is
    computed in: everything at full width except the inputs of a cat, which are computed at the
    columns they fill, from loads at shifted columns masked to the window.
    """

    def __init__(self, group: FusionGroup, mode: str) -> None:
        self.group, self.mode, self.S = group, mode, group.shape
        self.full: Frame = (0, group.shape[-1])
        self.inputs = {n: i for i, n in enumerate(group.inputs)}
        self.inside = set(group.nodes)
        self.ind = "    " if mode in ("column", "rowcol") else ""
        self.body: list[str] = []
        self.epilogue: list[str] = []
        self.acc: list[str] = []
        self.finish: list[str] = []  # column mode: after the row loop, each accumulator tile reduced to (BLOCK,)
        self.rows = mode in ("row", "rowcol")  # whole rows: per-row values are scalars
        self.names: dict[tuple[fx.Node, Frame], str] = {}
        self.masks: dict[Frame, str] = {self.full: "mask"}
        self.scalar: set[fx.Node] = set()  # row mode: per-row values (reductions and what only they feed)

    def line(self, text: str) -> None:
        self.body.append(self.ind + text)

    def mask(self, f: Frame) -> str:
        if f not in self.masks:
            self.masks[f] = f"fm{len(self.masks)}"
            self.line(f"{self.masks[f]} = mask & (cols >= {f[0]}) & (cols < {f[0] + f[1]})")
        return self.masks[f]

    def val(self, n: fx.Node, f: Frame) -> str:
        """Name of the value of ``n`` computed in frame ``f`` (emitting it on first use)."""
        w = _shape(n)[-1] if _shape(n) else 1
        if w == 1:
            f = self.full  # one column: the same value at every column
        elif w != f[1]:
            raise CodegenError(f"{n.name} is {w} columns wide but computed in a window of {f[1]}")
        if (n, f) not in self.names:
            self.names[(n, f)] = self._load(n, f) if n in self.inputs else self._compute(n, f)
        return self.names[(n, f)]

    def _load(self, n: fx.Node, f: Frame) -> str:
        i, R, S = self.inputs[n], len(self.S), self.S
        var = f"x{i}" if f == self.full else f"x{i}_{f[0]}"
        # masked lanes load 1.0, not 0: keeps rsqrt/log/div of padding finite (reductions mask them)
        other = "0" if _dtype(n) in (torch.bool, torch.int64, torch.int32) else "1.0"
        cast = "" if _dtype(n) == torch.bool else ".to(tl.float32)"
        lead = [f"i{d} * s{i}_{d}" for d in range(R - 1)]
        shp = _shape(n)
        if self.rows and (not shp or shp[-1] == 1) and S[-1] != 1:
            # a per-row input (…, 1): one scalar per row, so values computed from it stay per-row
            self.line(f"{var} = tl.load(in{i} + ({' + '.join(lead) or '0'})){cast}")
            self.scalar.add(n)
            return var
        col = f"cols * s{i}_{R - 1}" if f[0] == 0 else f"(cols - {f[0]}) * s{i}_{R - 1}"
        self.line(f"{var} = tl.load(in{i} + ({' + '.join([*lead, col])}), mask={self.mask(f)}, other={other}){cast}")
        return var

    def _compute(self, n: fx.Node, f: Frame) -> str:
        if n not in self.inside:
            raise CodegenError(f"{n.name} is neither computed in nor passed to {self.group.name}")
        frames = dict(arg_frames(n, f, self.full)) if n.target is not CAT else None
        if n.target is CAT:
            expr = self._cat(n, f)
        elif n.target in REDUCTIONS:
            return self._reduce(n, self.val(n.args[0], self.full))
        else:
            expr = _expr(n, lambda a: self.val(a, frames[a]) if isinstance(a, fx.Node) else _lit(a))
        var = f"v{len(self.names)}"
        self.line(f"{var} = {expr}")
        # per-row if computed only from per-row values (a cat varies along the row by construction)
        if n.target is not CAT and n.all_input_nodes and all(a in self.scalar for a in n.all_input_nodes):
            self.scalar.add(n)
        return var

    def _cat(self, n: fx.Node, f: Frame) -> str:
        """Column c of the cat is input j's value where c falls in input j's window."""
        names = [self.val(a, fa) for a, fa in arg_frames(n, f, self.full)]
        ends = list(itertools.accumulate((_shape(a)[-1] for a in n.args[0]), initial=f[0]))[1:]
        expr = names[-1]
        for name, end in zip(reversed(names[:-1]), reversed(ends[:-1])):
            expr = f"tl.where(cols < {end}, {name}, {expr})"
        return expr

    def _reduce(self, n: fx.Node, src: str) -> str:
        var = f"v{len(self.names)}"
        is_max = n.target is aten.amax.default
        neutral = "float('-inf')" if is_max else "0.0"
        masked = f"tl.where(mask, {src}, {neutral})"
        if self.rows and not (self.mode == "rowcol" and is_column_reduction(n)):
            self.line(f"{var} = tl.{'max' if is_max else 'sum'}({masked}, axis=0)")
            if n.target is aten.mean.dim:
                self.line(f"{var} = {var} / {self.S[-1]}")
            self.scalar.add(n)
            return var
        if self.mode == "rowcol":
            # a column reduction of whole rows: add each row into a (BLOCK,) fp32 accumulator; the
            # launcher's second stage combines the chunks (and divides a mean)
            init = "tl.full([BLOCK], float('-inf'), tl.float32)" if is_max else "tl.zeros([BLOCK], dtype=tl.float32)"
            self.acc.append(f"{var} = {init}")
            self.line(f"{var} = tl.maximum({var}, {masked})" if is_max else f"{var} += {masked}")
            return var
        # column: accumulate this chunk's tiles elementwise in a [BLOCK_M, BLOCK] fp32 tile and reduce
        # across its rows once after the loop (a cross-warp reduction per tile would serialise the
        # loop); the launcher's second stage combines the chunks (and divides a mean)
        init = "tl.full([BLOCK_M, BLOCK], float('-inf'), tl.float32)" if is_max else "tl.zeros([BLOCK_M, BLOCK], dtype=tl.float32)"
        self.acc.append(f"{var} = {init}")
        self.line(f"{var} = tl.maximum({var}, {masked})" if is_max else f"{var} += {masked}")
        self.finish.append(f"{var} = tl.{'max' if is_max else 'sum'}({var}, axis=0)")
        return var


def generate_source(group: FusionGroup, name: str) -> tuple[str, str]:
    """(Triton source defining ``name``, mode) for ``group``; raises CodegenError if unsupported."""
    S = group.shape
    if not S:
        raise CodegenError("scalar groups are left to ATen")
    mode = _mode(group)
    _check_outputs(group, mode)
    if mode in ("row", "rowcol") and S[-1] > MAX_ROW:
        raise CodegenError(f"row of {S[-1]} elements exceeds {MAX_ROW}")
    R = len(S)
    ins = [f"in{i}" for i in range(len(group.inputs))]
    outs = [f"out{i}" for i in range(len(group.outputs))]
    strides = [f"s{i}_{d}" for i in range(len(ins)) for d in range(R)]
    consts = {"column": "CHUNK, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, STAGES: tl.constexpr",
              "rowcol": "CHUNK, BLOCK: tl.constexpr, STAGES: tl.constexpr"}.get(
        mode, "BLOCK: tl.constexpr")
    L = ["import triton", "import triton.language as tl", "", "", "@triton.jit",
         f"def {name}({', '.join(ins + outs + strides)}, NUMEL, {consts}):"]
    em = _Emitter(group, mode)
    out_off = "offs" if mode == "pointwise" else f"row * {S[-1]} + cols"
    for j, o in enumerate(group.outputs):
        st = _layout(o, S, mode)  # recorded strides (None: contiguous): the leading indices place the row
        lead = [] if st is None else [f"i{d} * {st[d]}" for d in range(R - 1) if S[d] > 1]
        off = out_off if st is None else " + ".join([*lead, "cols" if st[-1] == 1 or S[-1] == 1 else f"cols * {st[-1]}"])
        red = _reduced(o, mode)
        value = em.val(o if red is None else red, em.full)  # a cast of a reduction: the combine casts
        dt = _TL_DTYPE[_dtype(o)]
        if red is not None:
            em.epilogue.append(f"tl.store(out{j} + pid * {S[-1]} + cols, {value}, mask=mask)" if mode == "rowcol" else
                               f"tl.store(out{j} + tl.program_id(1).to(tl.int64) * {S[-1]} + ccols, {value}, mask=cmask)")
            continue
        if em.rows and (o in em.scalar) != (_shape(o) != S):
            raise CodegenError(f"output {o.name}: per-row value and shape {_shape(o)} disagree")
        if o in em.scalar and em.rows:
            em.line(f"tl.store(out{j} + {'row' if st is None else '(' + ' + '.join(lead or ['0']) + ')'}, ({value}).to({dt}))")
        else:
            em.line(f"tl.store(out{j} + ({off}), ({value}).to({dt}), mask=mask)")
    head = _prologue(mode, S)
    if "%ACC%" in head:
        k = head.index("%ACC%")
        head[k:k + 1] = em.acc
    L += ["    " + line for line in head + em.body + em.finish + em.epilogue]
    return "\n".join(L) + "\n", mode


class FusedKernel:
    """Callable that launches one generated kernel: ``kernel(*inputs) -> tuple(outputs)``."""

    def __init__(
        self,
        fn: Any,
        mode: str,
        source: str,
        shape: tuple[int, ...],
        in_shapes: list[tuple[int, ...]],
        out_specs: list[tuple[tuple[int, ...], torch.dtype]],
        combine: list[str | None],
        out_strides: list[tuple[int, ...] | None] | None = None,
    ) -> None:
        self.fn, self.mode, self.source = fn, mode, source
        self.shape, self.in_shapes, self.out_specs = shape, in_shapes, out_specs
        # per output, the strides it is written with (`_layout`; None: contiguous)
        self.out_strides = list(out_strides) if out_strides is not None else [None] * len(out_specs)
        # column mode: how each reduction output's per-chunk partials combine (None: stored directly)
        self.combine = combine
        self.__name__ = fn.__name__
        self._plans: dict[tuple[Any, ...], _LaunchPlan] = {}  # input signature -> launch (see __call__)
        # column mode: (how, dtype, output indices) of the outputs combined in one second-stage launch
        by: dict[tuple[str, torch.dtype], list[int]] = {}
        for j, ((_, dt), c) in enumerate(zip(out_specs, combine, strict=True)):
            if c is not None:
                by.setdefault((c, dt), []).append(j)
        self._combines = [(how, dt, js) for (how, dt), js in by.items()]

    @classmethod
    def of_group(cls, fn: Any, group: FusionGroup, mode: str, source: str) -> FusedKernel:
        """The launcher of ``fn``, generated from ``group``."""
        combine = [str(r.target).split(".")[1] if (r := _reduced(o, mode)) is not None else None for o in group.outputs]
        return cls(fn, mode, source, group.shape, [_shape(i) for i in group.inputs],
                   [(_shape(o), _dtype(o)) for o in group.outputs], combine,
                   [_layout(o, group.shape, mode) for o in group.outputs])

    @property
    def second_stage_launches(self) -> int:
        """Launches after the kernel's own, per call, at most: a column kernel's combines (one per
        output dtype and kind; fp32 sums over a single chunk need none, which only the call knows)."""
        return len(self._combines)

    def spec(self) -> dict[str, Any]:
        """What `load_kernel` needs to rebuild this launcher from the cached source (JSON-able)."""
        return {"name": self.__name__, "mode": self.mode, "shape": list(self.shape), "in_shapes": [list(s) for s in self.in_shapes],
                "out_specs": [[list(s), str(dt).removeprefix("torch.")] for s, dt in self.out_specs], "combine": self.combine,
                "out_strides": [None if st is None else list(st) for st in self.out_strides]}

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # a graph calls a kernel with the same shapes and strides every time: the checks, strides and
        # launch sizes are worked out once per input signature (~14 us of Python for 8 inputs on a
        # slow CPU, 3-4 us to look up), and launches stay cheap next to the GPU work they queue
        try:
            key = tuple([(x.shape, x.stride(), x.get_device()) for x in inputs])
        except AttributeError:
            raise KernelInputError(f"{self.__name__}: expected tensors, got {[type(x).__name__ for x in inputs]}") from None
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(inputs)
            if len(self._plans) < _MAX_PLANS:
                self._plans[key] = plan
        return self._launch(inputs, plan)

    def _launch(self, inputs: Sequence[torch.Tensor], plan: _LaunchPlan) -> tuple[torch.Tensor, ...]:
        """Launch with ``plan`` (worked out for these inputs' signature); the outputs."""
        ins = [x if x.dim() else x.reshape(1) for x in inputs] if plan.scalar_inputs else inputs
        if self.mode in ("column", "rowcol"):
            return self._columns(ins, plan)
        outs = [self._empty(j, inputs[0].device) for j in range(len(self.out_specs))]
        self.fn[plan.grid](*ins, *outs, *plan.strides, plan.numel, BLOCK=plan.block, num_warps=plan.warps)
        return tuple(outs)

    def _empty(self, j: int, device: torch.device) -> torch.Tensor:
        """Output ``j``'s buffer, laid out as the kernel writes it."""
        shape, dtype = self.out_specs[j]
        st = self.out_strides[j]
        return torch.empty(shape, dtype=dtype, device=device) if st is None else torch.empty_strided(shape, st, dtype=dtype,
                                                                                                     device=device)

    def _plan(self, inputs: tuple[torch.Tensor, ...], config: dict[str, int] | None = None) -> _LaunchPlan:
        """Check ``inputs`` against the kernel's shapes and work out their strides and the launch
        (column and rowcol kernels: with ``config``, else the tuner's choice or the default)."""
        S = self.shape
        if len(inputs) != len(self.in_shapes):
            raise KernelInputError(f"{self.__name__}: expected {len(self.in_shapes)} inputs, got {len(inputs)}")
        dev = inputs[0].device
        flat: list[int] = []
        for x, shp in zip(inputs, self.in_shapes, strict=True):
            if tuple(x.shape) != shp or x.device != dev:
                raise KernelInputError(f"{self.__name__}: input of shape {tuple(x.shape)} on {x.device}, expected {shp} on {dev}")
            flat += _strides(x, S)
        strides, scalar = tuple(flat), any(x.dim() == 0 for x in inputs)
        numel = math.prod(S)
        cuda, sms = launch_target(dev)
        if self.mode in TUNED_MODES and config is None:
            cands = self.candidates(cuda)
            config = _TUNER.recall(self._tuning_key(strides, cuda), cands) or cands[0]
        if self.mode == "column":
            N, M = S[-1], numel // S[-1]
            block, block_m = min(triton_next_pow2(N), config["block"]), min(triton_next_pow2(M), config["block_m"])
            tiles = triton_cdiv(M, block_m)
            split = max(1, min(tiles, config["per_sm"] * sms // triton_cdiv(N, block)))
            chunk = triton_cdiv(tiles, split) * block_m
            split = triton_cdiv(M, chunk)
            return _LaunchPlan(strides, scalar, (triton_cdiv(N, block), split), block, config["warps"], numel, block_m, chunk,
                               split, config["stages"])
        if self.mode in ("row", "rowcol"):
            block = triton_next_pow2(S[-1])
            M = max(1, numel // S[-1])
            if self.mode == "row":
                return _LaunchPlan(strides, scalar, (M,), block, _row_warps(block), numel)
            # rowcol: chunks of rows, each a partial of one row's width to combine
            chunk = triton_cdiv(M, min(M, config["per_sm"] * sms))
            split = triton_cdiv(M, chunk)
            return _LaunchPlan(strides, scalar, (split,), block, config["warps"], numel, 0, chunk, split, config["stages"])
        # the CPU interpreter pays ~25 ms per program whatever its size: two programs (a block
        # edge and a masked tail stay tested), each one vectorised numpy op
        block = 1024 if cuda else min(1 << 16, max(256, triton_next_pow2(triton_cdiv(numel, 2))))
        return _LaunchPlan(strides, scalar, (triton_cdiv(numel, block),), block, 4, numel)

    def candidates(self, cuda: bool) -> list[dict[str, int]]:
        """Launch configurations of a column or rowcol kernel, the default first (GPU: 128-column,
        32-row tiles and 4 programs per SM, a rowcol kernel's warps by row width; CPU interpreter:
        wide tiles, two programs), then the alternatives timed on CUDA: taller tiles and more warps
        keep more bytes in flight; half the programs per SM (rowcol); narrower tiles hold fewer
        registers; a pipelined row loop, whose next loads Triton issues as async copies while a row
        computes (a plain loop never does for loads no matmul reads). All of them compile for
        sm_90 without spills at the real blocks' shapes (Triton 3.9 on the CPU, 2026-11-27)."""
        S = self.shape
        if self.mode == "column":
            N, M = S[-1], math.prod(S) // S[-1]

            def col(block: int, block_m: int, warps: int, per_sm: int, stages: int = 1) -> dict[str, int]:
                return {"block": min(triton_next_pow2(N), block), "block_m": min(triton_next_pow2(M), block_m),
                        "warps": warps, "per_sm": per_sm, "stages": stages}

            if not cuda:
                return _unique([col(1024, 64, 4, 2), col(128, 64, 8, 4), col(64, 64, 4, 4, 2)])
            # (64, 32): half the registers per thread, for kernels with many inputs (GPT-2's
            # MLP bias-and-activation gradient takes 128 registers at the default tile on sm_90)
            # each candidate is a Triton compile (~0.7 s): five, where a rowcol kernel's take three
            return _unique([col(128, 32, 4, 4), col(128, 64, 8, 4), col(64, 32, 4, 4), col(128, 32, 4, 4, 2),
                            col(128, 32, 4, 4, 3)])
        if self.mode == "rowcol":
            w = _row_warps(triton_next_pow2(S[-1]))
            other = w * 2 if w < 16 else w // 2
            if not cuda:
                return _unique([{"warps": w, "per_sm": 2, "stages": 1}, {"warps": other, "per_sm": 3, "stages": 2}])
            return _unique([{"warps": w, "per_sm": 4, "stages": 1}, {"warps": w, "per_sm": 2, "stages": 1},
                            {"warps": other, "per_sm": 4, "stages": 1}, {"warps": w, "per_sm": 4, "stages": 2},
                            {"warps": w, "per_sm": 2, "stages": 2}])
        return [{}]

    def _tuning_key(self, strides: tuple[int, ...], cuda: bool) -> tuple[str, str, str, str]:
        # the kernel (its source hash), the shape it runs at, its inputs' layout and the device type
        # (a choice the CPU tests force never reaches a CUDA launch, nor the reverse)
        return (self.__name__, "x".join(map(str, self.shape)), hashlib.sha256(str(strides).encode()).hexdigest()[:8],
                "cuda" if cuda else "cpu")

    def tune(self, inputs: Sequence[torch.Tensor], *, force: bool = False) -> dict[str, int] | None:
        """Column and rowcol kernels on CUDA (any device with ``force``: the CPU tests): time each
        launch configuration on ``inputs`` once for their signature, and launch with the fastest
        from then on; returns the choice (None: nothing to choose here)."""
        if self.mode not in TUNED_MODES or (inputs[0].device.type != "cuda" and not force):
            return None
        cuda = inputs[0].device.type == "cuda"
        base = self._plan(tuple(inputs), self.candidates(cuda)[0])

        choice = _TUNER.choose(self._tuning_key(base.strides, cuda), self.candidates(cuda),
                               lambda cfg: self._launch(inputs, self._plan(tuple(inputs), cfg)))
        self._plans.clear()  # the cached launch plans were worked out before the choice
        return choice

    def _columns(self, ins: Sequence[torch.Tensor], plan: _LaunchPlan) -> tuple[torch.Tensor, ...]:
        """Column mode: a (column blocks, row chunks) grid writing fp32 partials, combined here;
        rowcol mode: a grid of row chunks, also storing its row outputs as it goes."""
        dev, N, split = ins[0].device, self.shape[-1], plan.split
        M = plan.numel // N
        outs: list[torch.Tensor | None] = [self._empty(j, dev) if c is None else None for j, c in enumerate(self.combine)]
        # the outputs that combine alike share one (K, split, N) buffer of fp32 partials
        parts = []
        for how, dt, js in self._combines:
            buf = torch.empty((len(js), split, N), dtype=torch.float32, device=dev)
            parts.append(buf)
            for i, j in enumerate(js):
                outs[j] = buf[i]
        if self.mode == "rowcol":
            self.fn[plan.grid](*ins, *outs, *plan.strides, plan.numel, plan.chunk, BLOCK=plan.block, STAGES=plan.stages,
                               num_warps=plan.warps)
        else:
            self.fn[plan.grid](*ins, *outs, *plan.strides, plan.numel, plan.chunk, BLOCK=plan.block, BLOCK_M=plan.block_m,
                               STAGES=plan.stages, num_warps=plan.warps)
        for buf, (how, dt, js) in zip(parts, self._combines, strict=True):
            # second stage: one small launch per buffer sums the chunks in a fixed order, scales and casts
            got = combine_partials(buf, how, M, dt)
            for i, j in enumerate(js):
                outs[j] = got[i].reshape(self.out_specs[j][0])
        return tuple(outs)


# launch plans kept per kernel (input signatures: a plan's graphs call each kernel with one or two)
_MAX_PLANS = 16


@dataclasses.dataclass(frozen=True, slots=True)
class _LaunchPlan:
    """What one input signature (shapes, strides, device) of a `FusedKernel` launches with."""

    strides: tuple[int, ...]
    scalar_inputs: bool  # some input is 0-d (passed as a 1-element view)
    grid: tuple[int, ...]
    block: int
    warps: int
    numel: int
    block_m: int = 0  # column mode: rows per tile; column and rowcol: rows per chunk, chunks
    chunk: int = 0
    split: int = 1
    stages: int = 1  # column and rowcol: the row loop's pipeline depth (1: no prefetch)


def launch_target(dev: torch.device) -> tuple[bool, int]:
    """Whether launches on ``dev`` are planned for a GPU, and its SM count: the CPU interpreter
    counts as one SM (its programs: `per_sm`, each step one numpy op). bench/kernel_compile_check.py
    replaces it to plan GPU launches for kernels compiled on a machine without one."""
    if dev.type != "cuda":
        return False, 1
    return True, torch.cuda.get_device_properties(dev).multi_processor_count


def _row_warps(block: int) -> int:
    """Warps of a row or rowcol kernel by its row block: wide rows get more, so each thread holds a
    few dozen values and nothing spills."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _unique(configs: list[dict[str, int]]) -> list[dict[str, int]]:
    """``configs`` without repeats (a narrow shape clamps several to one), in order."""
    out: list[dict[str, int]] = []
    for c in configs:
        if c not in out:
            out.append(c)
    return out


def _strides(x: torch.Tensor, S: tuple[int, ...]) -> list[int]:
    """Strides of ``x`` broadcast to S's leading dims and its own width (a cat's input is narrower
    than S); a broadcast (size-1) last dim gets stride 0."""
    # plain Python on shape and stride tuples (no expand view): this runs for every input of
    # every launch, and launches must stay cheap next to the GPU work they queue
    st = [0] * len(S)
    off = len(S) - x.dim()
    for d, (n, s) in enumerate(zip(x.shape, x.stride(), strict=True)):
        st[off + d] = 0 if n == 1 else s
    return st


def triton_next_pow2(n: int) -> int:
    """Smallest power of two >= n."""
    return 1 << max(0, (n - 1).bit_length())


def triton_cdiv(a: int, b: int) -> int:
    """Ceil division."""
    return -(-a // b)


def compile_group(group: FusionGroup, cache_dir: Path) -> FusedKernel:
    """Generate, write (cached by source hash) and import the kernel for ``group``."""
    src, mode = generate_source(group, "fused")
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    name = f"k_{digest}"
    src = src.replace("def fused(", f"def {name}(")
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{name}.py"
    if not path.exists() or path.read_text() != src:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # (own name: writers may race)
        tmp.write_text(src)
        tmp.replace(path)
    return FusedKernel.of_group(_import(path, name), group, mode, src)


def _import(path: Path, name: str) -> Any:
    """The jitted function ``name`` of the generated source file ``path`` (imported once)."""
    mod_name = f"mtc_generated_{name.removeprefix('k_')}"
    mod = sys.modules.get(mod_name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    return getattr(mod, name)


def load_kernel(spec: dict[str, Any], cache_dir: Path) -> FusedKernel:
    """Rebuild a launcher from `FusedKernel.spec` and its cached source file, without generating.

    Raises FileNotFoundError if the source is missing and ValueError if it no longer hashes to the
    name it was saved under (the caller then regenerates).
    """
    name = spec["name"]
    path = cache_dir / f"{name}.py"
    src = path.read_text()
    if hashlib.sha256(src.replace(f"def {name}(", "def fused(").encode()).hexdigest()[:16] != name.removeprefix("k_"):
        raise ValueError(f"{path} does not hash to its name")
    out_specs = [(tuple(s), getattr(torch, dt)) for s, dt in spec["out_specs"]]
    strides = [None if st is None else tuple(st) for st in spec.get("out_strides", [None] * len(out_specs))]
    return FusedKernel(_import(path, name), spec["mode"], src, tuple(spec["shape"]), [tuple(s) for s in spec["in_shapes"]],
                       out_specs, spec["combine"], strides)


_ = operator  # getitem nodes never reach the generator: partition classifies them as views
