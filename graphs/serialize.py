"""Program <-> JSON: templates as lists of ATen calls, so a plan directory is readable and portable.

The format names ops by their qualified overload (``aten.linear.default``) and encodes arguments
as JSON with tagged objects for the few non-JSON values ATen takes (dtypes, devices, layouts,
memory formats, tuples). Loading resolves every op through ``torch.ops`` and fails with a clear
error for an op this torch build lacks. Only JSON text is produced here; writing files, and the
constants' tensor values, are the plan writer's job (``mtc.plan``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from mtc.graphs.program import (
    LayerCall,
    ParamSpec,
    Program,
    Source,
    Template,
    TemplateInput,
    TensorSpec,
)
from torch import fx

__all__ = ["FORMAT_VERSION", "SerializeError", "graph_from_dict", "graph_to_dict", "program_from_dict", "program_to_dict"]

FORMAT_VERSION = 1


class SerializeError(ValueError):
    """A Program or plan document cannot be encoded or decoded (graphs/ raises plain errors;
    mtc wraps them into PlanError with the file name)."""


_LAYOUTS = {str(v): v for v in (torch.strided, torch.sparse_coo)}
_FORMATS = {str(v): v for v in (torch.contiguous_format, torch.channels_last, torch.preserve_format)}


def _target_name(target: Any) -> str:
    if target is operator.getitem:
        return "operator.getitem"
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target._schema.name.split("::")
        return f"{ns}.{name}.{target._overloadname or 'default'}"
    raise SerializeError(f"cannot serialise call target {target!r}: only ATen/torch.ops overloads and getitem are supported")


def _resolve_target(name: str) -> Any:
    if name == "operator.getitem":
        return operator.getitem
    try:
        ns, op, overload = name.split(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (ValueError, AttributeError, RuntimeError):
        raise SerializeError(f"op {name!r} does not exist in torch {torch.__version__}; re-trace the model with this torch") from None


def _enc(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return {"node": arg.name}
    if isinstance(arg, bool) or arg is None or isinstance(arg, (int, str)):
        return arg
    if isinstance(arg, float):
        return arg if math.isfinite(arg) else {"float": repr(arg)}
    if isinstance(arg, tuple):
        return {"tuple": [_enc(a) for a in arg]}
    if isinstance(arg, list):
        return [_enc(a) for a in arg]
    if isinstance(arg, torch.dtype):
        return {"dtype": str(arg).removeprefix("torch.")}
    if isinstance(arg, torch.device):
        return {"device": str(arg)}
    if isinstance(arg, torch.layout):
        return {"layout": str(arg)}
    if isinstance(arg, torch.memory_format):
        return {"memory_format": str(arg)}
    raise SerializeError(f"cannot serialise argument {arg!r} of type {type(arg).__name__}")


def _dec(obj: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(obj, list):
        return [_dec(a, env) for a in obj]
    if not isinstance(obj, dict):
        return obj
    (tag, val), = obj.items()
    if tag == "node":
        return env[val]
    if tag == "tuple":
        return tuple(_dec(a, env) for a in val)
    if tag == "float":
        return float(val)
    if tag == "dtype":
        return getattr(torch, val)
    if tag == "device":
        return torch.device(val)
    if tag == "layout":
        return _LAYOUTS[val]
    if tag == "memory_format":
        return _FORMATS[val]
    raise SerializeError(f"unknown argument tag {tag!r}")


def _val_spec(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return {"shape": list(val.shape), "dtype": str(val.dtype).removeprefix("torch.")}
    if isinstance(val, (tuple, list)):
        return [_val_spec(v) for v in val]
    return None


def _spec_enc(s: TensorSpec) -> dict[str, Any]:
    return {"shape": list(s.shape), "dtype": s.dtype}


def _spec_dec(d: dict[str, Any]) -> TensorSpec:
    return TensorSpec(tuple(d["shape"]), d["dtype"])


def _val_dec(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, list):
        return [_val_dec(x) for x in v]
    return torch.empty(v["shape"], dtype=getattr(torch, v["dtype"]), device="meta")


def graph_to_dict(graph: fx.Graph, name_target: Callable[[Any], str | None] = lambda _t: None) -> list[dict[str, Any]]:
    """Every node of ``graph`` (placeholders included) as JSON rows. ``name_target`` names call
    targets this module does not know (the compiler's generated kernels); None: not one of those."""
    rows = []
    for n in graph.nodes:
        row: dict[str, Any] = {"name": n.name, "op": n.op, "args": _enc(n.args), "kwargs": {k: _enc(v) for k, v in n.kwargs.items()}}
        if n.op == "call_function":
            row["target"] = name_target(n.target) or _target_name(n.target)
        if n.op in ("call_function", "placeholder"):
            row["val"] = _val_spec(n.meta.get("val"))
        rows.append(row)
    return rows


def graph_from_dict(rows: list[dict[str, Any]], resolve_target: Callable[[str], Any] = lambda _n: None) -> fx.Graph:
    """Inverse of `graph_to_dict`; ``resolve_target`` returns the callable for a name it gave out
    (None for ATen/torch.ops names, resolved here)."""
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    for row in rows:
        args, kwargs = _dec(row["args"], env), {k: _dec(v, env) for k, v in row["kwargs"].items()}
        if row["op"] == "placeholder":
            node = g.placeholder(row["name"])
        elif row["op"] == "output":
            g.output(args[0])
            continue
        elif row["op"] == "call_function":
            target = resolve_target(row["target"])
            target = _resolve_target(row["target"]) if target is None else target
            node = g.create_node("call_function", target, tuple(args), kwargs, name=row["name"])
        else:
            raise SerializeError(f"unsupported node kind {row['op']!r}")
        node.meta["val"] = _val_dec(row.get("val"))
        env[row["name"]] = node
    g.lint()
    return g


def template_to_dict(t: Template) -> dict[str, Any]:
    """A template as a JSON-able dict (nodes in order, each with its output spec)."""
    nodes = []
    for n in t.graph.nodes:
        if n.op == "placeholder":
            continue
        row: dict[str, Any] = {"name": n.name, "op": n.op, "args": _enc(n.args), "kwargs": {k: _enc(v) for k, v in n.kwargs.items()}}
        if n.op == "call_function":
            row["target"] = _target_name(n.target)
            row["val"] = _val_spec(n.meta.get("val"))
        nodes.append(row)
    return {
        "id": t.id,
        "kind": t.kind,
        "n_aux_out": t.n_aux_out,
        "inputs": [{"name": i.name, "kind": i.kind, "role": i.role, **_spec_enc(i.spec)} for i in t.inputs],
        "nodes": nodes,
    }


def template_from_dict(d: dict[str, Any]) -> Template:
    """Inverse of `template_to_dict`; node ``meta['val']`` comes back as meta tensors."""
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    inputs = []
    for i in d["inputs"]:
        ph = g.placeholder(i["name"])
        spec = TensorSpec(tuple(i["shape"]), i["dtype"])
        ph.meta["val"] = torch.empty(spec.shape, dtype=spec.torch_dtype, device="meta")
        # nodes refer to a placeholder by its node name, which fx may have made from the input's
        # name ("param_A_log" -> "param_a_log"), the same way when the graph was traced as now
        env[ph.name] = ph
        inputs.append(TemplateInput(name=i["name"], kind=i["kind"], spec=spec, role=i["role"]))
    for i, ph in zip(d["inputs"], g.nodes, strict=True):
        env.setdefault(i["name"], ph)
    for row in d["nodes"]:
        args, kwargs = _dec(row["args"], env), {k: _dec(v, env) for k, v in row["kwargs"].items()}
        if row["op"] == "output":
            g.output(args[0])
            continue
        if row["op"] != "call_function":
            raise SerializeError(f"unsupported node kind {row['op']!r} in template {d['id']}")
        node = g.create_node("call_function", _resolve_target(row["target"]), tuple(args), kwargs, name=row["name"])
        node.meta["val"] = _val_dec(row.get("val"))
        env[row["name"]] = node
    g.lint()
    t = Template(kind=d["kind"], graph=g, inputs=inputs, n_aux_out=d["n_aux_out"], id=d["id"])
    return t


def program_to_dict(p: Program) -> dict[str, Any]:
    """The whole Program as a JSON-able dict (no tensor values)."""
    return {
        "format": "mtc-program",
        "version": FORMAT_VERSION,
        "torch": torch.__version__,
        "model_name": p.model_name,
        "meta": p.meta,
        "batch": {k: _spec_enc(v) for k, v in p.batch.items()},
        "carry": _spec_enc(p.carry),
        "aux": [_spec_enc(a) for a in p.aux],
        "constants": {k: _spec_enc(v) for k, v in p.constants.items()},
        "params": [
            {"key": s.key, "layer": s.layer, "offset": s.offset, "decay": s.decay, **({"frozen": True} if s.frozen else {}),
             **_spec_enc(s.spec)} for s in p.params.values()
        ],
        "templates": [template_to_dict(t) for t in p.templates.values()],
        "layers": [
            {
                "index": c.index,
                "name": c.name,
                "template": c.template,
                "bindings": {k: {"kind": s.kind, "key": s.key, "index": s.index} for k, s in c.bindings.items()},
            }
            for c in p.layers
        ],
    }


def program_from_dict(d: dict[str, Any]) -> Program:
    """Inverse of `program_to_dict`; raises SerializeError for a foreign or newer document."""
    if d.get("format") != "mtc-program":
        raise SerializeError(f"not an mtc program document (format={d.get('format')!r})")
    if d.get("version") != FORMAT_VERSION:
        raise SerializeError(f"program format version {d.get('version')} is not supported (this mtc reads {FORMAT_VERSION})")
    templates = {t["id"]: template_from_dict(t) for t in d["templates"]}
    params = {
        r["key"]: ParamSpec(key=r["key"], spec=_spec_dec(r), layer=r["layer"], offset=r["offset"], decay=r["decay"],
                            frozen=bool(r.get("frozen", False)))
        for r in d["params"]
    }
    layers = [
        LayerCall(
            index=c["index"],
            name=c["name"],
            template=c["template"],
            bindings={k: Source(kind=s["kind"], key=s["key"], index=s["index"]) for k, s in c["bindings"].items()},
        )
        for c in d["layers"]
    ]
    return Program(
        templates=templates,
        layers=layers,
        params=params,
        constants={k: _spec_dec(v) for k, v in d["constants"].items()},
        batch={k: _spec_dec(v) for k, v in d["batch"].items()},
        carry=_spec_dec(d["carry"]),
        aux=[_spec_dec(a) for a in d["aux"]],
        model_name=d["model_name"],
        meta=d["meta"],
    )
