"""The streaming executor: runs a Program against a store, one layer's weights at a time.

For each micro-batch the layers are visited in the order

    embed, block 1..N (forward, no autograd; each block's input is kept),
    head (forward + backward at once),
    block N..1, embed (recompute forward with autograd, then backward).

Before a visit its weights are fetched from the store into a slot of a two-slot ring, and the
fetch of the next visit runs on a background thread while the current one computes. Parameter
gradients go to the optimizer as soon as a layer's backward returns; when a layer's gradient is
complete (last micro-batch, last reader of tied weights) the optimizer is told so it can update
it. Only the layer-boundary hidden states and the embed stage's auxiliary outputs stay alive
between visits, so memory does not grow with depth beyond one hidden state per block.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch

from mtc.errors import PlanError
from mtc.graphs.program import LayerCall, Program, Template
from mtc.runtime.buffers import LayerBufferPool, Slot
from mtc.store import TensorStore, state_array_name

if TYPE_CHECKING:  # the compiler pulls in Triton; the unfused path must not need it
    from mtc.compiler import CompiledTemplate

__all__ = ["GradSink", "LayerWeights", "StreamingExecutor"]


class GradSink(Protocol):
    """Where the executor sends gradients (the optimizer)."""

    def add_grad(self, key: str, grad: torch.Tensor) -> None:
        """Add one parameter's gradient."""

    def grads_final(self, layer: int) -> None:
        """Owner layer ``layer`` will receive no more gradient this step."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Segment:
    owner: int  # layer whose flat state holds the data
    start: int  # element offset in the owner's flat array
    numel: int
    slot_offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class _FetchPlan:
    segments: tuple[_Segment, ...]
    views: dict[str, tuple[int, tuple[int, ...]]]  # param key -> (slot offset, shape)
    numel: int


class LayerWeights:
    """One layer call's parameters, as views into a buffer slot (weak-referenceable for tests)."""

    __slots__ = ("__weakref__", "slot", "tensors")

    def __init__(self, slot: Slot, tensors: dict[str, torch.Tensor]) -> None:
        self.slot, self.tensors = slot, tensors


class StreamingExecutor:
    """Runs forward and backward of ``program`` with weights streamed from ``store``."""

    def __init__(
        self,
        program: Program,
        store: TensorStore,
        *,
        device: torch.device | str = "cpu",
        on_visit: Callable[[str, int], None] | None = None,
        compiled: dict[str, CompiledTemplate] | None = None,
    ) -> None:
        self.program, self.store = program, store
        self.device = torch.device(device)
        self.dtype = torch.float32 if program.meta.get("param_dtype", "float32") == "float32" else getattr(torch, program.meta["param_dtype"])
        self.kind = "master" if self.dtype == torch.float32 else "compute"
        self._plans = [self._fetch_plan(c) for c in program.layers]
        self.pool = LayerBufferPool(max(p.numel for p in self._plans), self.dtype, self.device, slots=2)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-fetch")
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._last_user = program.last_backward_user()
        self._consts = {k: v.to(self.device) for k, v in program.constant_values.items()}
        self._aux_needs_grad = _aux_param_dependence(program.template_of(0))
        self.compiled = compiled
        if compiled is not None:
            missing = [t for t in program.templates if t not in compiled]
            if missing:
                raise PlanError(f"the compiled plan lacks templates {missing}; recompile it (`mtc compile`)")
            if any(self._aux_needs_grad):
                raise PlanError("compiled plans do not yet support embed outputs that depend on parameters; run --unfused")
        self.live_weights: weakref.WeakSet[LayerWeights] = weakref.WeakSet()
        self.on_visit = on_visit  # test hook: called as (phase, layer) after each visit
        self.generation = 0
        for name, spec in program.batch.items():
            if name not in ("ids", "targets"):
                raise PlanError(f"unexpected batch input {name!r} in the plan")
        self.batch_shape = program.batch["ids"].shape

    # -- fetching -------------------------------------------------------------------------------

    def _fetch_plan(self, call: LayerCall) -> _FetchPlan:
        segs: list[_Segment] = []
        views: dict[str, tuple[int, tuple[int, ...]]] = {}
        own = self.program.layer_numel(call.index)
        if own:
            segs.append(_Segment(call.index, 0, own, 0))
        off = own
        for key in dict.fromkeys(call.param_keys()):
            p = self.program.params[key]
            if p.layer == call.index:
                views[key] = (p.offset, p.spec.shape)
            else:  # tied weight owned by another layer: fetch just its range
                segs.append(_Segment(p.layer, p.offset, p.numel, off))
                views[key] = (off, p.spec.shape)
                off += p.numel
        return _FetchPlan(tuple(segs), views, off)

    def _start_fetch(self, layer: int) -> Future[LayerWeights]:
        slot = self.pool.acquire()
        return self._io.submit(self._fetch, layer, slot)

    def _fetch(self, layer: int, slot: Slot) -> LayerWeights:
        plan = self._plans[layer]
        if slot.copied is not None:
            slot.copied.synchronize()  # the previous H2D from this pinned buffer must be done
        for s in plan.segments:
            name = state_array_name(s.owner, self.kind, self.generation)
            dst = slot.host[s.slot_offset : s.slot_offset + s.numel]
            if s.start == 0 and s.numel == self.program.layer_numel(s.owner):
                self.store.read_into(name, dst)
            else:
                self.store.read_rows_into(name, s.start, dst)
        if self._copy_stream is not None:
            with torch.cuda.stream(self._copy_stream):
                if slot.released is not None:
                    self._copy_stream.wait_event(slot.released)
                slot.device[: plan.numel].copy_(slot.host[: plan.numel], non_blocking=True)
                slot.copied = torch.cuda.Event()
                slot.copied.record(self._copy_stream)
        tensors = {k: slot.device[o : o + _numel(shape)].view(shape) for k, (o, shape) in plan.views.items()}
        return LayerWeights(slot, tensors)

    def _wait(self, fut: Future[LayerWeights]) -> LayerWeights:
        w = fut.result()
        if self._copy_stream is not None and w.slot.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(w.slot.copied)
        self.live_weights.add(w)
        return w

    # -- running --------------------------------------------------------------------------------

    def _args(
        self,
        call: LayerCall,
        tmpl: Template,
        weights: dict[str, torch.Tensor],
        batch: dict[str, torch.Tensor],
        carry: torch.Tensor | None,
        aux: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        args = []
        for inp in tmpl.inputs:
            src = call.bindings[inp.name]
            if src.kind == "param":
                args.append(weights[src.key])
            elif src.kind == "carry":
                args.append(carry)
            elif src.kind == "aux":
                args.append(aux[src.index])
            elif src.kind == "batch":
                args.append(batch[src.key])
            else:
                args.append(self._consts[src.key])
        return args

    def run(
        self,
        microbatches: list[tuple[torch.Tensor, torch.Tensor]],
        sink: GradSink,
        generation: int,
    ) -> list[float]:
        """Forward + backward over ``microbatches``; returns each micro-batch's mean loss.

        Weights are read from state generation ``generation``. The loss gradient of each
        micro-batch is scaled by 1 / len(microbatches), as ``(loss / n).backward()`` would.
        """
        self.generation = generation
        prog = self.program
        L = prog.n_layers
        n_mb = len(microbatches)
        visits = [(mb, phase, layer) for mb in range(n_mb) for phase, layer in _visit_order(L)]
        losses: list[float] = []
        fut = self._start_fetch(visits[0][2])
        state: dict[str, object] = {}
        try:
            for k, (mb, phase, layer) in enumerate(visits):
                w = self._wait(fut)
                fut = self._start_fetch(visits[k + 1][2]) if k + 1 < len(visits) else None
                if phase == "fwd" and layer == 0:
                    ids, targets = microbatches[mb]
                    if tuple(ids.shape) != self.batch_shape or tuple(targets.shape) != self.batch_shape:
                        raise PlanError(
                            f"micro-batch shape {tuple(ids.shape)} does not match the plan's {self.batch_shape}; "
                            "re-trace the model for this batch size and sequence length"
                        )
                    state = {"batch": {"ids": ids.to(self.device), "targets": targets.to(self.device)}, "saved": {}}
                last_mb = mb == n_mb - 1
                loss = self._visit(phase, layer, w, state, sink, 1.0 / n_mb)
                if loss is not None:
                    losses.append(loss)
                if phase != "fwd":
                    for owner, user in self._last_user.items():
                        if user == layer and last_mb:
                            sink.grads_final(owner)
                self.pool.release(w.slot)
                del w
                if self.on_visit is not None:
                    self.on_visit(phase, layer)
        finally:
            if fut is not None:  # an error mid-step: let the in-flight fetch finish, free its slot
                try:
                    self.pool.release(fut.result().slot)
                except Exception:
                    pass
        return losses

    def _visit(self, phase: str, layer: int, w: LayerWeights, st: dict, sink: GradSink, scale: float) -> float | None:
        prog = self.program
        call = prog.layers[layer]
        tmpl = prog.templates[call.template]
        gm = tmpl.module(self.device) if self.compiled is None else self.compiled[tmpl.id].module("forward", self.device)
        batch, saved = st["batch"], st["saved"]
        head = layer == prog.n_layers - 1
        if phase != "fwd" and self.compiled is not None:
            return self._visit_compiled(layer, w, st, sink, scale)
        if phase == "fwd":
            with torch.no_grad():
                if layer == 0:
                    out = gm(*self._args(call, tmpl, w.tensors, batch, None, []))
                    st["carry"], st["aux"] = out[0], list(out[1:])
                else:
                    saved[layer] = st["carry"]
                    st["carry"] = gm(*self._args(call, tmpl, w.tensors, batch, st["carry"], st["aux"]))[0]
            return None
        # backward visits: run the layer with autograd, then take gradients
        params = {k: t.detach().requires_grad_() for k, t in w.tensors.items()}
        aux = [a.detach().requires_grad_(need) for a, need in zip(st["aux"], self._aux_needs_grad)]
        if layer == 0:
            out = gm(*self._args(call, tmpl, params, batch, None, aux))
            outs = [out[0]] + [o for o, need in zip(out[1:], self._aux_needs_grad) if need]
            grads_out = [st.pop("grad_carry")] + [g for g, need in zip(st["grad_aux"], self._aux_needs_grad) if need]
            inputs: list[torch.Tensor] = list(params.values())
        else:
            carry_in = (st["carry"] if head else saved.pop(layer)).detach().requires_grad_()
            out = gm(*self._args(call, tmpl, params, batch, carry_in, aux))
            outs = [out[0]]
            grads_out = [torch.tensor(scale, dtype=out[0].dtype, device=self.device)] if head else [st.pop("grad_carry")]
            inputs = [carry_in, *params.values(), *[a for a in aux if a.requires_grad]]
        grads = torch.autograd.grad(outs, inputs, grads_out, allow_unused=True)
        if layer != 0:
            st["grad_carry"] = grads[0]
            pg = grads[1 : 1 + len(params)]
            ag = grads[1 + len(params) :]
            if head:
                st["grad_aux"] = [torch.zeros_like(a) if need else None for a, need in zip(st["aux"], self._aux_needs_grad)]
                st.pop("carry")
            gi = iter(ag)
            for j, need in enumerate(self._aux_needs_grad):
                if need:
                    g = next(gi)
                    if g is not None:
                        st["grad_aux"][j] += g
        else:
            pg = grads
        for key, g in zip(params, pg):
            if g is not None:
                sink.add_grad(key, g)
            else:
                sink.add_grad(key, torch.zeros(self.program.params[key].spec.shape))
        return float(out[0].detach()) if head else None

    def _visit_compiled(self, layer: int, w: LayerWeights, st: dict, sink: GradSink, scale: float) -> float | None:
        """Backward visit with the compiled joint graph: recompute + gradients in one call."""
        prog = self.program
        call = prog.layers[layer]
        tmpl = prog.templates[call.template]
        ct = self.compiled[tmpl.id]
        head = layer == prog.n_layers - 1
        if layer == 0:
            carry_in, gout = None, st.pop("grad_carry")
        elif head:
            carry_in, gout = st.pop("carry"), torch.tensor(scale, dtype=torch.float32, device=self.device)
        else:
            carry_in, gout = st["saved"].pop(layer), st.pop("grad_carry")
        args = self._args(call, tmpl, w.tensors, st["batch"], carry_in, st["aux"])
        with torch.no_grad():
            res = ct.module("joint", self.device)(*args, gout)
        n_out = 1 + tmpl.n_aux_out
        for k, g in zip(ct.diff, res[n_out:], strict=True):
            inp = tmpl.inputs[k]
            if inp.kind == "carry":
                st["grad_carry"] = g
            else:
                key = call.bindings[inp.name].key
                sink.add_grad(key, g if g is not None else torch.zeros(prog.params[key].spec.shape))
        return float(res[0]) if head else None

    def close(self) -> None:
        """Stop the fetch thread."""
        self._io.shutdown(wait=True)


def _visit_order(n_layers: int) -> list[tuple[str, int]]:
    fwd = [("fwd", i) for i in range(n_layers - 1)]
    return fwd + [("head", n_layers - 1)] + [("bwd", i) for i in range(n_layers - 2, -1, -1)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _aux_param_dependence(embed: Template) -> list[bool]:
    """For each aux output of the embed template: does it depend on a parameter input?"""
    params = {n for n in embed.graph.nodes if n.op == "placeholder" and n.name in set(embed.input_names("param"))}
    out_node = next(n for n in embed.graph.nodes if n.op == "output")
    result = []
    for o in out_node.args[0][1:]:
        todo, seen, dep = [o], set(), False
        while todo and not dep:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            dep = n in params
            todo.extend(n.all_input_nodes)
        result.append(dep)
    return result
