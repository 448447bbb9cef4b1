"""Generate a Triton kernel for a fusion group, from the group's FX nodes.

Two kernel shapes cover what `mtc.graphs.partition` groups:

* ``pointwise``: one program per BLOCK elements of the iteration shape S; every input is read
  through its strides after broadcasting to S (so transposed or expanded inputs need no copy);
* ``row``: groups with last-dimension reductions (norms, softmax pieces): one program per row of
  S, the row in one block of next_pow2(N) columns; a reduction yields a per-row scalar that later
  nodes broadcast against full rows.

Every value is computed in fp32 (loads are cast up, stores cast to the node's dtype); offsets are
int64; every load and store is masked. The source is written to a file (Triton's JIT reads kernel
source with `inspect`) in a cache directory and imported from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import operator
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from mtc.errors import KernelInputError
from mtc.graphs.partition import REDUCTIONS, FusionGroup

__all__ = ["CodegenError", "generate_source", "FusedKernel", "compile_group", "MAX_ROW"]

aten = torch.ops.aten
MAX_ROW = 16384  # widest row a row kernel holds in one block

_TL_DTYPE = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.bool: "tl.int1", torch.int64: "tl.int64", torch.int32: "tl.int32",
}


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
        e = a[1]
        if e == 2:
            return f"({v(a[0])} * {v(a[0])})"
        if e == 1:
            return v(a[0])
        if e == 0.5:
            return f"tl.sqrt({v(a[0])})"
        if e == -0.5:
            return f"(1.0 / tl.sqrt({v(a[0])}))"
        if isinstance(e, int) and 2 < e <= 4:
            return "(" + " * ".join([v(a[0])] * e) + ")"
        return f"tl.exp({_lit(e)} * tl.log({v(a[0])}))"
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


def generate_source(group: FusionGroup, name: str) -> tuple[str, str]:
    """(Triton source defining ``name``, mode) for ``group``; raises CodegenError if unsupported."""
    S = group.shape
    if not S:
        raise CodegenError("scalar groups are left to ATen")
    mode = "row" if group.reduces else "pointwise"
    rows_shape = S[:-1]
    for o in group.outputs:
        s = _shape(o)
        if s != S and not (mode == "row" and s == (*rows_shape, 1)):
            raise CodegenError(f"output {o.name} has shape {s}, not the iteration shape {S}")
        if _dtype(o) not in _TL_DTYPE:
            raise CodegenError(f"output dtype {_dtype(o)}")
    if mode == "row" and S[-1] > MAX_ROW:
        raise CodegenError(f"row of {S[-1]} elements exceeds {MAX_ROW}")
    R = len(S)
    ins = [f"in{i}" for i in range(len(group.inputs))]
    outs = [f"out{i}" for i in range(len(group.outputs))]
    strides = [f"s{i}_{d}" for i in range(len(ins)) for d in range(R)]
    L = ["import triton", "import triton.language as tl", "", "", "@triton.jit"]
    L.append(f"def {name}({', '.join(ins + outs + strides)}, NUMEL, BLOCK: tl.constexpr):")
    body: list[str] = []
    if mode == "pointwise":
        body += ["pid = tl.program_id(0).to(tl.int64)", "offs = pid * BLOCK + tl.arange(0, BLOCK)", "mask = offs < NUMEL",
                 "rem = offs"]
        for d in reversed(range(R)):
            body += [f"i{d} = rem % {S[d]}", f"rem = rem // {S[d]}"]
        idx = {i: " + ".join(f"i{d} * s{i}_{d}" for d in range(R)) for i in range(len(ins))}
        out_off = "offs"
    else:
        N = S[-1]
        body += ["row = tl.program_id(0).to(tl.int64)", "cols = tl.arange(0, BLOCK)", f"mask = cols < {N}", "rem = row"]
        for d in reversed(range(R - 1)):
            body += [f"i{d} = rem % {S[d]}", f"rem = rem // {S[d]}"]
        idx = {
            i: " + ".join([f"i{d} * s{i}_{d}" for d in range(R - 1)] + [f"cols * s{i}_{R - 1}"]) for i in range(len(ins))
        }
        out_off = f"row * {N} + cols"
    names: dict[fx.Node, str] = {}
    scalar: set[fx.Node] = set()  # per-row values (reductions, per-row inputs, and what only they feed)
    for i, inp in enumerate(group.inputs):
        names[inp] = f"x{i}"
        # masked lanes load 1.0, not 0: keeps rsqrt/log/div of padding finite (reductions mask them)
        other = "0" if _dtype(inp) in (torch.bool, torch.int64, torch.int32) else "1.0"
        cast = "" if _dtype(inp) == torch.bool else ".to(tl.float32)"
        shp = _shape(inp)
        if mode == "row" and (not shp or shp[-1] == 1) and S[-1] != 1:
            # a per-row input (…, 1): one scalar per row, so values computed from it stay per-row
            row_idx = " + ".join([f"i{d} * s{i}_{d}" for d in range(R - 1)]) or "0"
            body.append(f"x{i} = tl.load({ins[i]} + ({row_idx})){cast}")
            scalar.add(inp)
            continue
        body.append(f"x{i} = tl.load({ins[i]} + ({idx[i]}), mask=mask, other={other}){cast}")

    def v(a: Any) -> str:
        return names[a] if isinstance(a, fx.Node) else _lit(a)

    for k, n in enumerate(group.nodes):
        var = f"v{k}"
        if n.target in REDUCTIONS:
            src = v(n.args[0])
            if n.target is aten.amax.default:
                body.append(f"{var} = tl.max(tl.where(mask, {src}, float('-inf')), axis=0)")
            else:
                body.append(f"{var} = tl.sum(tl.where(mask, {src}, 0.0), axis=0)")
                if n.target is aten.mean.dim:
                    body.append(f"{var} = {var} / {S[-1]}")
            scalar.add(n)
        else:
            body.append(f"{var} = {_expr(n, v)}")
            # per-row if computed only from per-row values (group inputs load as full rows)
            if n.all_input_nodes and all(a in scalar for a in n.all_input_nodes):
                scalar.add(n)
        names[n] = var
    for j, o in enumerate(group.outputs):
        dt = _TL_DTYPE[_dtype(o)]
        if mode == "row" and (o in scalar) != (_shape(o) != S):
            raise CodegenError(f"output {o.name}: per-row value and shape {_shape(o)} disagree")
        if o in scalar and mode == "row":
            body.append(f"tl.store({outs[j]} + row, ({names[o]}).to({dt}))")
        else:
            body.append(f"tl.store({outs[j]} + ({out_off}), ({names[o]}).to({dt}), mask=mask)")
    L += ["    " + line for line in body]
    return "\n".join(L) + "\n", mode


class FusedKernel:
    """Callable that launches one generated kernel: ``kernel(*inputs) -> tuple(outputs)``."""

    def __init__(self, fn: Any, group: FusionGroup, mode: str, source: str) -> None:
        self.fn, self.mode, self.source = fn, mode, source
        self.shape = group.shape
        self.in_shapes = [_shape(i) for i in group.inputs]
        self.out_specs = [(_shape(o), _dtype(o)) for o in group.outputs]
        self.__name__ = fn.__name__

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        S = self.shape
        if len(inputs) != len(self.in_shapes):
            raise KernelInputError(f"{self.__name__}: expected {len(self.in_shapes)} inputs, got {len(inputs)}")
        dev = inputs[0].device
        strides: list[int] = []
        for x, shp in zip(inputs, self.in_shapes, strict=True):
            if tuple(x.shape) != shp or x.device != dev:
                raise KernelInputError(f"{self.__name__}: input of shape {tuple(x.shape)} on {x.device}, expected {shp} on {dev}")
            strides += list(x.expand(S).stride()) if x.dim() else [0] * len(S)
        outs = [torch.empty(s, dtype=dt, device=dev) for s, dt in self.out_specs]
        numel = math.prod(S)
        if self.mode == "row":
            block = triton_next_pow2(S[-1])
            grid = (max(1, numel // S[-1]),)
        else:
            block = 1024 if dev.type == "cuda" else 256
            grid = (triton_cdiv(numel, block),)
        ins = [x if x.dim() else x.reshape(1) for x in inputs]
        self.fn[grid](*ins, *outs, *strides, numel, BLOCK=block)
        return tuple(outs)


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
        tmp = path.with_suffix(".tmp")
        tmp.write_text(src)
        tmp.replace(path)
    mod_name = f"mtc_generated_{digest}"
    mod = sys.modules.get(mod_name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    return FusedKernel(getattr(mod, name), group, mode, src)


_ = operator  # getitem nodes never reach the generator: partition classifies them as views
