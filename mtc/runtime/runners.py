"""How the executor runs a layer template: one interface for compiled and unfused templates.

A runner gives two callables per device:

- ``forward(*args) -> outputs`` (no autograd),
- ``joint(*args, *grad_outputs) -> (*outputs, *grads)``: the layer recomputed and differentiated
  in one call, with gradients for the template inputs listed in ``diff``, in that order; the
  outputs are None except a head's (`graphs.program.joint_keeps_outputs`: the executor reads
  only the head's loss, and a compiled block then skips its last matmul).

A runner whose ``saves`` is true (a compiled block with split graphs: graphs/split.py; an unfused
block) has two more, for layers the executor keeps values of between their visits instead of
recomputing them:

- ``save(*args) -> (*outputs, *saved)``: the forward, also returning what its backward reads,
- ``backward(*args, *saved, *grad_outputs) -> (*None, *grads)``: the joint's result without the
  recomputed forward.

An unfused block's saved value is its autograd graph (`_Kept`): the tensors autograd keeps,
except those that are views of the layer's weights, which live in a weight-ring slot that later
layers overwrite: those are kept as their place in the slot and read from the backward visit's
weights (same layout, fetched again) when the backward unpacks them.

Compiled templates (`mtc.compiler.CompiledTemplate`: generated kernels, joint graph from the
compiler) already have this shape; `AutogradRunner` gives it to an unfused ATen template through
``torch.autograd.grad``. The executor therefore has one backward path for both, and never imports
the compiler. On CUDA, `mtc.runtime.graph_replay.GraphRunner` wraps a compiled template's runner
and replays its callables as CUDA graphs, behind the same interface (plus ``bind_stable``, through
which the executor names the buffers a graph may read in place).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from mtc.graphs.program import LayerCall, Template, joint_keeps_outputs

__all__ = ["AutogradRunner", "CompiledRunner", "LayerRunner"]


class LayerRunner(Protocol):
    """What the executor needs of a template."""

    diff: list[int]  # template input indices whose gradients `joint` returns, in order
    n_out: int  # outputs before the gradients in `joint`'s result
    saves: bool  # `save` and `backward` exist

    def forward(self, device: torch.device) -> Callable[..., Any]:
        """The forward callable on ``device``."""

    def joint(self, device: torch.device) -> Callable[..., Any]:
        """The recompute + backward callable on ``device``."""

    def save(self, device: torch.device) -> Callable[..., Any]:
        """The forward that also returns the values `backward` reads (``saves`` only)."""

    def backward(self, device: torch.device) -> Callable[..., Any]:
        """The backward from saved values (``saves`` only)."""


class CompiledRunner:
    """Adapts a compiled template (anything with ``module(which, device)`` and ``diff``)."""

    def __init__(self, compiled: Any, template: Template) -> None:
        self.compiled, self.diff, self.n_out = compiled, list(compiled.diff), 1 + template.n_aux_out
        self.saves = getattr(compiled, "save_graph", None) is not None

    def forward(self, device: torch.device) -> Callable[..., Any]:
        """The compiled forward graph."""
        return self.compiled.module("forward", device)

    def joint(self, device: torch.device) -> Callable[..., Any]:
        """The compiled joint graph."""
        return self.compiled.module("joint", device)

    def save(self, device: torch.device) -> Callable[..., Any]:
        """The compiled forward that saves."""
        return self.compiled.module("save", device)

    def backward(self, device: torch.device) -> Callable[..., Any]:
        """The compiled backward from saved values."""
        return self.compiled.module("backward", device)


class AutogradRunner:
    """An unfused template: forward as traced, joint through ``torch.autograd.grad``.

    ``aux_needs_grad[j]`` says whether the embed stage's aux output j depends on a parameter (then
    blocks take its gradient and the embed stage receives it as an extra grad output).
    """

    def __init__(self, template: Template, call: LayerCall, aux_needs_grad: Sequence[bool]) -> None:
        self.template = template
        self.saves = template.kind == "block"
        self.embed = template.kind == "embed"
        self.n_out = 1 + template.n_aux_out
        self.diff = []
        for k, inp in enumerate(template.inputs):
            src = call.bindings[inp.name]
            if src.kind in ("param", "carry") or (src.kind == "aux" and not self.embed and aux_needs_grad[src.index]):
                self.diff.append(k)
        # which outputs get a grad output: the carried state, plus aux outputs that depend on params
        self._grad_outs = [0] + ([1 + j for j, need in enumerate(aux_needs_grad) if need] if self.embed else [])
        self._joints: dict[str, Callable[..., Any]] = {}

    def module(self, device: torch.device) -> Callable[..., Any]:
        """The callable both `forward` and `joint` run: the traced ATen template (a subclass may
        wrap it, e.g. in torch.compile, to compare the same schedule with another backend)."""
        return self.template.module(device)

    def forward(self, device: torch.device) -> Callable[..., Any]:
        """The traced ATen template, run as it is (no autograd)."""
        return self.module(device)

    def joint(self, device: torch.device) -> Callable[..., Any]:
        """Recompute with autograd and return outputs then gradients of the ``diff`` inputs."""
        key = str(device)
        fn = self._joints.get(key)
        if fn is None:
            gm, n_in, diff, outs_idx = self.module(device), len(self.template.inputs), self.diff, self._grad_outs
            keep = joint_keeps_outputs(self.template)  # as a compiled joint graph: only a head's outputs are read

            def fn(*a: torch.Tensor) -> tuple[Any, ...]:
                args, gouts = list(a[:n_in]), list(a[n_in:])
                with torch.enable_grad():
                    for k in diff:
                        args[k] = args[k].detach().requires_grad_()
                    out = gm(*args)
                    outs = [out[i] for i in outs_idx]
                    gouts = [go.to(o.dtype) if go.dtype != o.dtype else go for go, o in zip(gouts, outs, strict=True)]
                    grads = torch.autograd.grad(outs, [args[k] for k in diff], gouts, allow_unused=True)
                return (*[o.detach() if keep else None for o in out], *grads)

            self._joints[key] = fn
        return fn

    def save(self, device: torch.device) -> Callable[..., Any]:
        """The forward under autograd, returning the detached outputs and the graph (`_Kept`)."""
        gm, diff, outs_idx = self.module(device), self.diff, self._grad_outs
        params = [k for k, i in enumerate(self.template.inputs) if i.kind == "param"]

        def fn(*a: torch.Tensor) -> tuple[Any, ...]:
            args = list(a)
            kept = _Kept({args[k].untyped_storage().data_ptr(): k for k in params})
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(kept.pack, kept.unpack):
                for k in diff:
                    args[k] = args[k].detach().requires_grad_()
                out = gm(*args)
            kept.outs, kept.leaves = [out[i] for i in outs_idx], [args[k] for k in diff]
            return (*[o.detach() for o in out], kept)

        return fn

    def backward(self, device: torch.device) -> Callable[..., Any]:
        """Gradients of the ``diff`` inputs from the forward visit's graph (outputs None)."""
        n_in, n_out = len(self.template.inputs), self.n_out

        def fn(*a: Any) -> tuple[Any, ...]:
            kept: _Kept = a[n_in]
            kept.weights = list(a[:n_in])  # this visit's weights: where the graph's weight views are read
            gouts = [go.to(o.dtype) if go.dtype != o.dtype else go for go, o in zip(a[n_in + 1:], kept.outs, strict=True)]
            grads = torch.autograd.grad(kept.outs, kept.leaves, gouts, allow_unused=True)
            kept.outs = kept.leaves = kept.weights = []  # the graph goes now, not when the executor drops the tuple
            return (*[None] * n_out, *grads)

        return fn


class _Kept:
    """An unfused block's autograd graph between its forward and its backward visit.

    ``pack`` replaces every saved tensor that lies in the storage of one of the layer's weights
    (keyed by that storage's address: a ring slot, or a resident layer's compute copy) with its
    place there; ``unpack`` reads that place in ``weights``, the backward visit's arguments."""

    __slots__ = ("leaves", "outs", "storages", "weights")

    def __init__(self, storages: dict[int, int]) -> None:
        self.storages = storages  # storage address -> index of a weight argument in it
        self.outs: list[torch.Tensor] = []
        self.leaves: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []

    def pack(self, t: torch.Tensor) -> Any:
        """What the graph keeps of ``t``."""
        k = self.storages.get(t.untyped_storage().data_ptr())
        return t if k is None else (k, tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(self, x: Any) -> torch.Tensor:
        """The tensor ``pack`` kept, in this visit's weights where it was a weight view."""
        if isinstance(x, torch.Tensor):
            return x
        k, shape, stride, offset = x
        return self.weights[k].as_strided(shape, stride, offset)
