"""The Program: a traced decoder language model as a chain of per-layer calls of stateless templates.

A Program has three kinds of stage, run in order: one ``embed`` call, N ``block`` calls and one
``head`` call (which ends in the loss). Each call runs a *template*, an ATen-level FX graph whose
weights are explicit inputs, and binds every template input to a source: a parameter in the
model's flat state, a constant, a field of the batch, the hidden state carried from the previous
stage, or an auxiliary value the embed stage computed once for all blocks (RoPE tables, masks).
Blocks that are structurally identical share one template (same graph hash), so a 80-layer model
holds one block graph and 80 bindings.

This module knows nothing of files or devices; `graphs.serialize` turns a Program into JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import fx

__all__ = [
    "COMPUTE_DEVICE", "LayerCall", "ParamSpec", "Program", "Source", "Template", "TemplateInput", "TensorSpec",
    "aux_param_dependence", "devices_to_marker", "dtype_from_name", "dtype_name", "external_inputs", "instantiate",
    "joint_keeps_outputs",
]

InputKind = Literal["carry", "aux", "batch", "param", "const"]
StageKind = Literal["embed", "block", "head"]

# Device arguments inside templates (arange(..., device=...)) are replaced by this marker when a
# template is built, and bound to the executor's device when it is instantiated; a plan traced on
# the meta device or the CPU then runs unchanged on CUDA.
COMPUTE_DEVICE = "mtc:compute"


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.float32' -> 'float32'."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """'float32' -> torch.float32 (raises ValueError for an unknown name)."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """Static shape and dtype of a tensor crossing a template boundary."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        """Spec of a (real, fake or meta) tensor."""
        return cls(tuple(int(s) for s in t.shape), dtype_name(t.dtype))

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a torch.dtype."""
        return dtype_from_name(self.dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class TemplateInput:
    """One placeholder of a template: its graph name, kind and spec.

    ``role`` is a readable name: the parameter's path inside the stage's module for params
    (``attn.wq.weight``), the batch field for batch inputs (``ids``, ``targets``).
    """

    name: str
    kind: InputKind
    spec: TensorSpec
    role: str


@dataclasses.dataclass(slots=True)
class Template:
    """A stateless layer template: an ATen FX graph with explicit weight inputs.

    Outputs: embed -> (carry, *aux), block -> (carry,), head -> (loss,).
    """

    kind: StageKind
    graph: fx.Graph
    inputs: list[TemplateInput]
    n_aux_out: int = 0
    id: str = ""
    _modules: dict[str, fx.GraphModule] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{self.kind}-{graph_hash(self.graph, self.inputs)}"

    def module(self, device: torch.device | str) -> fx.GraphModule:
        """A runnable GraphModule with device arguments bound to ``device`` (cached per device)."""
        key = str(torch.device(device))
        gm = self._modules.get(key)
        if gm is None:
            gm = self._modules[key] = instantiate(self.graph, device)
        return gm

    def count_ops(self) -> int:
        """Number of ATen op calls in the graph (not counting getitem)."""
        return sum(1 for n in self.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))

    def input_names(self, kind: InputKind) -> list[str]:
        """Names of the inputs of one kind, in graph order."""
        return [i.name for i in self.inputs if i.kind == kind]


def aux_param_dependence(embed: Template) -> tuple[bool, ...]:
    """For each aux output of the embed template (after the carried hidden state): does it depend
    on a parameter input? Those outputs need gradients flowing back into the embed stage."""
    params = set(embed.input_names("param"))
    out_node = next(n for n in embed.graph.nodes if n.op == "output")
    result = []
    for o in out_node.args[0][1:]:
        todo, seen, dep = [o], set(), False
        while todo and not dep:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            dep = n.op == "placeholder" and n.name in params
            todo.extend(n.all_input_nodes)
        result.append(dep)
    return tuple(result)


def _map_devices(arg: Any, fn: Any) -> Any:
    if isinstance(arg, torch.device) or (isinstance(arg, str) and arg == COMPUTE_DEVICE):
        return fn(arg)
    if isinstance(arg, (tuple, list)):
        return type(arg)(_map_devices(a, fn) for a in arg)
    if isinstance(arg, dict):
        return {k: _map_devices(v, fn) for k, v in arg.items()}
    return arg


def devices_to_marker(arg: Any) -> Any:
    """Replace every torch.device inside a node's args/kwargs by the COMPUTE_DEVICE marker."""
    return _map_devices(arg, lambda _d: COMPUTE_DEVICE)


def instantiate(graph: fx.Graph, device: torch.device | str) -> fx.GraphModule:
    """A runnable copy of ``graph`` with every device argument (or marker) bound to ``device``."""
    dev = torch.device(device)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        new = g.node_copy(node, lambda n: env[n])
        new.args = _map_devices(new.args, lambda _d: dev)
        new.kwargs = _map_devices(new.kwargs, lambda _d: dev)
        env[node] = new
    return fx.GraphModule(torch.nn.Module(), g)


def external_inputs(nodes: list[fx.Node]) -> list[fx.Node]:
    """Values that ``nodes`` read but do not compute, in first-use order."""
    inside = set(nodes)
    ext: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                ext.setdefault(a)
    return list(ext)


def _canon_arg(arg: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(arg, fx.Node):
        return f"%{index[arg]}"
    if isinstance(arg, (list, tuple)):
        return [type(arg).__name__, [_canon_arg(a, index) for a in arg]]
    if isinstance(arg, dict):
        return {k: _canon_arg(v, index) for k, v in sorted(arg.items())}
    if isinstance(arg, float):
        return ["float", repr(arg)]
    if isinstance(arg, (int, bool, str)) or arg is None:
        return arg
    return repr(arg)


def graph_hash(graph: fx.Graph, inputs: list[TemplateInput]) -> str:
    """A structural hash: ops, their wiring and constants, and the inputs' kinds and specs.

    Node names are left out, so two blocks that compute the same thing on the same shapes hash
    alike whatever their parameters are called.
    """
    index: dict[fx.Node, int] = {}
    rows: list[Any] = [[i.kind, list(i.spec.shape), i.spec.dtype] for i in inputs]
    for k, node in enumerate(graph.nodes):
        index[node] = k
        if node.op == "placeholder":
            continue
        rows.append([node.op, str(node.target), _canon_arg(node.args, index), _canon_arg(node.kwargs, index)])
    blob = json.dumps(rows, separators=(",", ":"), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclasses.dataclass(frozen=True, slots=True)
class Source:
    """Where a template input's value comes from in one layer call.

    kind: "param" / "const" (key names it), "batch" (key is the field), "aux" (index into the
    embed stage's aux outputs), "carry" (the previous stage's hidden state).
    """

    kind: InputKind
    key: str = ""
    index: int = -1


@dataclasses.dataclass(slots=True)
class LayerCall:
    """One stage of the program: a template and the binding of each of its inputs."""

    index: int
    name: str
    template: str
    bindings: dict[str, Source]

    def param_keys(self) -> list[str]:
        """Keys of the parameters this call reads, in template input order (may repeat none)."""
        return [s.key for s in self.bindings.values() if s.kind == "param"]


@dataclasses.dataclass(frozen=True, slots=True)
class ParamSpec:
    """A parameter: its place in its owner layer's flat state, whether it decays, and whether it is
    frozen (``requires_grad=False`` on the traced module: its gradient is zeroed where it is made,
    so it neither moves nor counts in the clipping norm, and it never decays)."""

    key: str
    spec: TensorSpec
    layer: int
    offset: int
    decay: bool
    frozen: bool = False

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.spec.numel


@dataclasses.dataclass(slots=True)
class Program:
    """A traced model: templates, the chain of layer calls, and the flat parameter layout."""

    templates: dict[str, Template]
    layers: list[LayerCall]
    params: dict[str, ParamSpec]
    constants: dict[str, TensorSpec]
    batch: dict[str, TensorSpec]
    carry: TensorSpec
    aux: list[TensorSpec]
    model_name: str = "model"
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Values of the constants (non-trainable buffers) named in ``constants``; kept beside the
    # structure because graphs/ does no tensor I/O: mtc's plan writer saves them.
    constant_values: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def n_layers(self) -> int:
        """Number of layer calls (embed + blocks + head)."""
        return len(self.layers)

    def template_of(self, layer: int) -> Template:
        """The template layer ``layer`` runs."""
        return self.templates[self.layers[layer].template]

    def layer_params(self, layer: int) -> list[ParamSpec]:
        """Parameters owned by ``layer``, in flat-state order (decayed ones first)."""
        return sorted((p for p in self.params.values() if p.layer == layer), key=lambda p: p.offset)

    def layer_numel(self, layer: int) -> int:
        """Elements in ``layer``'s flat state (0 for a layer that owns no parameter)."""
        return sum(p.numel for p in self.params.values() if p.layer == layer)

    def layer_decay_numel(self, layer: int) -> int:
        """Length of the weight-decayed prefix of ``layer``'s flat state."""
        return sum(p.numel for p in self.params.values() if p.layer == layer and p.decay)

    def n_params(self) -> int:
        """Total trainable parameters (tied ones once)."""
        return sum(p.numel for p in self.params.values())

    def last_backward_user(self) -> dict[int, int]:
        """For each owner layer, the layer whose backward is the last to produce its gradient.

        Backward runs from the head down to the embedding, so that is the lowest-indexed call
        reading any of the owner's parameters (tied weights make it differ from the owner).
        """
        out: dict[int, int] = {}
        for call in self.layers:
            for key in call.param_keys():
                owner = self.params[key].layer
                out[owner] = min(out.get(owner, call.index), call.index)
        return out

    def iter_blocks(self) -> Iterator[LayerCall]:
        """The block calls, in order."""
        return (c for c in self.layers if self.templates[c.template].kind == "block")

    def summary(self) -> str:
        """A few lines describing the program."""
        blocks = list(self.iter_blocks())
        lines = [
            f"program {self.model_name}: {len(blocks)} blocks, {len(self.templates)} templates, "
            f"{self.n_params():,} parameters, batch {dict((k, v.shape) for k, v in self.batch.items())}",
        ]
        for t in self.templates.values():
            users = sum(1 for c in self.layers if c.template == t.id)
            lines.append(f"  {t.id}: {t.count_ops()} ATen ops, {len(t.input_names('param'))} weights, {users} call(s)")
        return "\n".join(lines)


def joint_keeps_outputs(t: Template) -> bool:
    """Whether the joint graph a training step runs returns the template's outputs: only the
    head's (its loss is read); a block's or the embed stage's recomputed outputs are already
    held (the next layer's saved input), and computing them in the backward costs a block its
    last matmul (Llama's down projection: a quarter of its forward FLOPs)."""
    return t.kind == "head"
