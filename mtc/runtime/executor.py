"""The streaming executor: runs one training step's forward and backward, layer-major.

A step's micro-batches form one group, and each layer is visited once per direction for the whole
group (weights cross PCIe twice per step, not twice per micro-batch):

    embed, block 1..N-1 (forward, no autograd; each block's input is kept per micro-batch),
    head (forward + backward at once, per micro-batch),
    block N-1..1, embed (recompute + backward per micro-batch).

Blocks in ``saves`` (compiled blocks with split graphs, as many as the plan found GPU memory for:
`mtc.train.plan_saves`) run their saving forward instead and keep, per micro-batch, the values
their backward reads (matmul and attention outputs: graphs/split.py) on the device until their
backward visit, which then runs the backward from them instead of recomputing the layer.

Before a visit its weights are copied from the layer's compute copy (pinned host, or resident on
the GPU) into a slot of a device ring, on the host-to-device stream, while the previous layer
computes; a fetch first waits for the layer's optimizer update of the previous step (updates run
between steps, in forward order, so layer i's update overlaps the forward of layers < i).
Gradients of each micro-batch are summed in fp32 into a flat per-layer slab on the device; when a
layer's gradient is final (last micro-batch, last user of tied weights) its per-parameter norms are
taken on the device and the slab is copied to the layer's pinned host buffer on the device-to-host
stream (`gpu`-tier, disk and GPU-updated `ram` layers accumulate into a buffer of their own on the
device and keep it there: `LayerState.device_grad`). In a data-parallel run with device
collectives the slab (or a gpu layer's gradient) goes to `reduce_grad` instead, which
reduce-scatters it on the device (`mtc.runtime.collectives`); the slab returns to the ring once
that has read it. Nothing in the layer loop synchronises the host with the GPU: the optimizer
reads the loss and the global norm once per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from mtc.errors import PlanError
from mtc.graphs.program import LayerCall, Program, Template, aux_param_dependence
from mtc.runtime.activations import ActivationStore
from mtc.runtime.buffers import DeviceRing, Slot
from mtc.runtime.pinned import host_buffer
from mtc.runtime.runners import AutogradRunner, LayerRunner
from mtc.runtime.tiers import StateTiers
from mtc.runtime.timeline import Timeline
from mtc.runtime.transfer import CopyEngine, Marker, Transfer
from mtc.store import state_array_name

__all__ = ["GradSink", "LayerWeights", "StepOutput", "StreamingExecutor", "aux_param_dependence"]

# targets the loss skips (padding, masked prompts): torch's cross_entropy default, as the traced
# head uses it and mtc.data.batches writes it
IGNORE_INDEX = -100


class GradSink(Protocol):
    """Where the executor reports final gradients (the optimizer)."""

    def grad_final(self, layer: int, norms: torch.Tensor) -> None:
        """Owner ``layer``'s gradient is complete; ``norms``: its per-parameter norms (device)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Segment:
    owner: int  # layer whose state holds the data
    start: int  # element offset in the owner's flat state
    numel: int
    slot_offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class _FetchPlan:
    segments: tuple[_Segment, ...]
    views: dict[str, tuple[int, tuple[int, ...]]]  # param key -> (offset in the buffer, shape)
    numel: int
    resident: bool  # all weights are the layer's own, resident on the device: no copy


class LayerWeights:
    """One layer call's parameters as views (weak-referenceable, so tests can count live sets)."""

    __slots__ = ("__weakref__", "slot", "tensors", "transfer")

    def __init__(self, slot: Slot | None, tensors: dict[str, torch.Tensor], transfer: Transfer | None) -> None:
        self.slot, self.tensors, self.transfer = slot, tensors, transfer


@dataclasses.dataclass(slots=True)
class _Group:
    """Per-step state of the micro-batch group (what flows between layer visits)."""

    batches: list[dict[str, torch.Tensor]]
    carry: list[torch.Tensor | None]
    aux: list[list[torch.Tensor]]
    grad_carry: list[torch.Tensor | None]
    grad_aux: list[list[torch.Tensor | None]]
    losses: list[torch.Tensor]
    saved: dict[tuple[int, int], Sequence[torch.Tensor]] = dataclasses.field(default_factory=dict)  # (layer, mb)


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step's forward + backward produced (device tensors: nothing was synchronised)."""

    loss: torch.Tensor  # the step's loss: sum over its targets (not ignore_index) / their count in the step


class StreamingExecutor:
    """Runs forward and backward of ``program`` with weights streamed from ``tiers``."""

    def __init__(
        self,
        program: Program,
        tiers: StateTiers,
        *,
        device: torch.device,
        engine: CopyEngine,
        timeline: Timeline,
        runners: dict[str, LayerRunner] | None = None,
        activation_budget_bytes: int | None = None,
        slots: int = 2,
        on_visit: Callable[[str, int], None] | None = None,
        saves: Collection[int] = (),
    ) -> None:
        self.program, self.tiers, self.device = program, tiers, torch.device(device)
        self.engine, self.timeline = engine, timeline
        self._aux_needs_grad = aux_param_dependence(program.template_of(0))
        if runners is None:
            runners = {}
            for call in program.layers:
                if call.template not in runners:
                    runners[call.template] = AutogradRunner(program.templates[call.template], call, self._aux_needs_grad)
        else:
            missing = [t for t in program.templates if t not in runners]
            if missing:
                raise PlanError(f"the compiled plan lacks templates {missing}; recompile it (`mtc compile`)")
        self.runners = runners
        for i in saves:
            call = program.layers[i] if 0 <= i < program.n_layers else None
            if call is None or program.templates[call.template].kind != "block" or not runners[call.template].saves:
                raise PlanError(f"layer {i} cannot keep its activations between visits: only blocks of a compiled plan "
                                "with split graphs can (`mtc compile`); leave --save-activations at auto or off")
        self.saves = frozenset(saves)
        self._plans = [self._fetch_plan(c) for c in program.layers]
        ring_numel = max((p.numel for p in self._plans if not p.resident), default=1)
        self.ring = DeviceRing(ring_numel, tiers.compute_dtype, self.device, slots=slots, name="weight")
        # slabs: the layer accumulating, the previous one draining to the host, plus owners of tied
        # weights whose accumulation spans other layers' visits
        tied = {program.params[k].layer for c in program.layers for k in c.param_keys() if program.params[k].layer != c.index}
        n_open = 2 + len(tied)
        # gpu, disk and GPU-updated ram layers accumulate into their own gradient buffer on the device
        # (`LayerState.device_grad`): slabs serve the other ram layers, and disk layers whose gradient
        # is spilled to the store (`mtc.runtime.grad_spill`)
        # (+ world - 1: data parallel reduce-scatters a slab padded to world equal shards; a
        # data-parallel disk layer's gradient goes to the host like a ram layer's: `mtc.runtime.dp_disk`)
        slab_numel = max((program.layer_numel(i) for i, s in enumerate(tiers.layers) if not s.device_grad),
                         default=1) + tiers.world_size - 1
        self.slabs = DeviceRing(slab_numel, torch.float32, self.device, slots=n_open, name="gradient slab")
        if self.device.type == "cuda":
            self.ring.preallocate()
            self.slabs.preallocate()
        self.acts = ActivationStore(engine, activation_budget_bytes)
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-fetch")
        self._last_user = program.last_backward_user()
        self._consts = {k: v.to(self.device) for k, v in program.constant_values.items()}
        self._stable: tuple[int, set[int]] = (-1, set())
        for r in self.runners.values():  # replayed CUDA graphs read these buffers in place (runtime/graph_replay.py)
            bind = getattr(r, "bind_stable", None)
            if bind is not None:
                bind(self.stable_buffer)
        self.live_weights: weakref.WeakSet[LayerWeights] = weakref.WeakSet()
        self.on_visit = on_visit  # test hook: called as (phase, layer) after each layer's group visit
        # data parallel: maps this rank's target count to the global one (the loss is normalised by it)
        self.reduce_count: Callable[[torch.Tensor], torch.Tensor] | None = None
        # data parallel with device collectives: takes a ram or gpu layer's final gradient on the
        # device and returns what its slab's next user (and the update) waits for
        self.reduce_grad: Callable[[int, torch.Tensor], Transfer] | None = None
        for name in program.batch:
            if name not in ("ids", "targets"):
                raise PlanError(f"unexpected batch input {name!r} in the plan")
        self.batch_shape = program.batch["ids"].shape
        self._open: dict[int, torch.Tensor] = {}  # owner layer -> its gradient accumulator (device)
        # per open accumulator, the parameters written so far: the first gradient of a parameter is
        # copied in, later ones added (no zeroing pass over the accumulator, no read of zeros:
        # 0 + g is g), and at the end the parameters nothing wrote are zeroed
        self._written: dict[int, set[str]] = {}
        self._open_slots: dict[int, Slot] = {}
        # disk layers whose compute copy is read from the store at each visit: host staging per ring slot
        self._staging: list[torch.Tensor] = []
        self._staging_read: list[Transfer | None] = [None] * slots
        # on the CPU in fp32 the weight slot itself is host memory of the store's dtype: read into it
        self._read_into_slot = self.device.type == "cpu" and self.ring.dtype == torch.float32
        if any(s.compute is None and s.numel for s in tiers.layers) and not self._read_into_slot:
            pin = self.device.type == "cuda"
            self._staging = [host_buffer(ring_numel, torch.float32, pinned=pin) for _ in range(slots)]
            tiers.pipeline_bytes["visit_staging"] = sum(t.numel() * 4 for t in self._staging)
        if self.device.type == "cpu":  # on the CPU the device buffers are host RAM too
            tiers.pipeline_bytes["device_rings"] = self.ring.numel * self.ring.dtype.itemsize * slots + self.slabs.numel * 4 * n_open

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
        # views of the layer's own resident copy only: a layer that reads another's (tied) weights,
        # even as its only parameters, fetches them through the ring
        resident = self.tiers[call.index].tier == "gpu" and all(sg.owner == call.index for sg in segs)
        return _FetchPlan(tuple(segs), views, off, resident)

    def _start_fetch(self, layer: int) -> Future[LayerWeights]:
        plan = self._plans[layer]
        if plan.resident:  # views on the resident compute copy; updates are ordered on the compute stream
            fut: Future[LayerWeights] = Future()
            st = self.tiers[layer]
            src = st.compute
            # data parallel: the compute stream waits for the all-gather of the updated shards
            fut.set_result(LayerWeights(None, {k: src[o : o + _numel(s)].view(s) for k, (o, s) in plan.views.items()},
                                        st.gathered))
            return fut
        slot = self.ring.acquire()
        if self.engine.serialize:  # the reference schedule: no fetch runs beside compute
            fut = Future()
            fut.set_result(self._fetch(layer, slot))
            return fut
        return self._fetcher.submit(self._fetch, layer, slot)

    def _fetch(self, layer: int, slot: Slot) -> LayerWeights:
        plan = self._plans[layer]
        owners = {s.owner for s in plan.segments}
        on_device: dict[int, tuple[torch.Tensor, Marker]] = {}  # owners whose new weights wait in a GPU scratch set
        with self.timeline.span("fetch_wait", layer):
            for o in owners:  # the weights must be this step's: wait for the owners' updates
                st = self.tiers[o]
                handed = st.device_copy.result() if st.device_copy is not None else None
                if handed is not None:  # the update's kernel is queued: copy after it, within the device
                    on_device[o] = handed
                    continue
                for dep in (st.update, st.write if st.compute is None else None):  # from the store: once written
                    if dep is not None:
                        dep.result()
        from_store = [s for s in plan.segments if self.tiers[s.owner].compute is None]
        if from_store:
            self._read_from_store(layer, slot, from_store)

        def source(s: _Segment) -> torch.Tensor:
            if s.owner in on_device:
                return on_device[s.owner][0][s.start : s.start + s.numel]
            if self.tiers[s.owner].compute is None:
                return self._stage(slot)[s.slot_offset : s.slot_offset + s.numel]
            return self.tiers[s.owner].compute[s.start : s.start + s.numel]

        copies = [(slot.device[s.slot_offset : s.slot_offset + s.numel], source(s))
                  for s in plan.segments if not (self._read_into_slot and self.tiers[s.owner].compute is None)]
        after = self.ring.ready_for_copy(slot)
        if any(self.tiers[o].tier == "gpu" for o in owners):
            # a resident owner is updated on the compute stream (data parallel: then all-gathered
            # on the comm stream, which the compute stream waits for first): copy only after that
            for o in owners:
                if self.tiers[o].gathered is not None:
                    self.engine.wait_on_compute(self.tiers[o].gathered)
            after = self.engine.marker()
        if on_device:  # and after the updates' kernels that wrote the scratch sets
            after = [*(a for a in (after,) if a is not None), *(m for _, m in on_device.values())]
        tr = self.engine.h2d(copies, after=after, layer=layer, stage="d2d" if len(on_device) == len(owners) else "h2d")
        for o in owners:
            self.tiers[o].last_read = tr  # the owner's next update waits until this copy has read it
        if from_store:
            self._staging_read[slot.index] = tr  # the next read into this staging buffer waits for it
        tensors = {k: slot.device[o : o + _numel(shape)].view(shape) for k, (o, shape) in plan.views.items()}
        return LayerWeights(slot, tensors, tr)

    def _read_from_store(self, layer: int, slot: Slot, segments: list[_Segment]) -> None:
        """Read disk owners' current masters into the slot's staging buffer (at the store's
        highest priority: this visit waits for it)."""
        store = self.tiers.store
        assert store is not None, "disk layers read per visit need the store"
        prev = self._staging_read[slot.index]
        if prev is not None:
            prev.wait()  # the last copy out of this staging buffer
        gen = self.tiers.disk_generation
        with self.timeline.span("visit_read", layer):
            futs = [store.read_rows_into_async(state_array_name(s.owner, "master", gen), s.start,
                                               self._stage(slot)[s.slot_offset : s.slot_offset + s.numel])
                    for s in segments]
            for f in futs:
                f.result()

    def _stage(self, slot: Slot) -> torch.Tensor:
        """Where a visit's reads from the store land: the slot's staging buffer, or the slot itself."""
        return slot.device if self._read_into_slot else self._staging[slot.index]

    def _wait(self, fut: Future[LayerWeights], layer: int) -> LayerWeights:
        with self.timeline.span("weights_wait", layer):
            w = fut.result()
            if w.transfer is not None:
                self.engine.wait_on_compute(w.transfer)
        self.live_weights.add(w)
        return w

    def _release(self, w: LayerWeights) -> None:
        if w.slot is not None:
            self.ring.release(w.slot, self.engine.marker())

    def stable_buffer(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in a buffer that keeps its address and role while the executor lives:
        a weight-ring slot, a resident compute copy or a constant."""
        slots = self.ring.buffers()
        if self._stable[0] != len(slots):  # ring slots are allocated on first use off CUDA
            ptrs = {b.untyped_storage().data_ptr() for b in slots}
            ptrs |= {c.untyped_storage().data_ptr() for c in self._consts.values()}
            ptrs |= {s.compute.untyped_storage().data_ptr() for s in self.tiers.layers if s.tier == "gpu" and s.compute is not None}
            self._stable = (len(slots), ptrs)
        return t.untyped_storage().data_ptr() in self._stable[1]

    # -- running --------------------------------------------------------------------------------

    def _args(self, call: LayerCall, tmpl: Template, weights: dict[str, torch.Tensor], g: _Group, mb: int,
              carry: torch.Tensor | None) -> list[torch.Tensor]:
        args = []
        for inp in tmpl.inputs:
            src = call.bindings[inp.name]
            if src.kind == "param":
                args.append(weights[src.key])
            elif src.kind == "carry":
                args.append(carry)
            elif src.kind == "aux":
                args.append(g.aux[mb][src.index])
            elif src.kind == "batch":
                args.append(g.batches[mb][src.key])
            else:
                args.append(self._consts[src.key])
        return args

    def run_step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], sink: GradSink) -> StepOutput:
        """Forward + backward over the group ``microbatches``; final gradients go to ``sink``.

        The step's loss is the sum of the losses of all its targets that are not ``IGNORE_INDEX``
        (padding, masked prompts) divided by their count in the whole step, not a mean of the
        micro-batches' means: micro-batch ``i``'s head computes the mean over its own ``c_i``
        targets, so its loss gradient is scaled by ``c_i / sum(c)``, as
        ``(loss_i * c_i / sum(c)).backward()`` would (``1 / n`` when nothing is ignored).
        """
        L, n = self.program.n_layers, len(microbatches)
        for ids, targets in microbatches:
            if tuple(ids.shape) != self.batch_shape or tuple(targets.shape) != self.batch_shape:
                raise PlanError(f"micro-batch shape {tuple(ids.shape)} does not match the plan's {self.batch_shape}; "
                                "re-trace the model for this batch size and sequence length")
        self.engine.count("h2d", sum(i.numel() * i.element_size() + t.numel() * t.element_size() for i, t in microbatches))
        g = _Group(
            batches=[{"ids": i.to(self.device, non_blocking=True), "targets": t.to(self.device, non_blocking=True)}
                     for i, t in microbatches],
            carry=[None] * n, aux=[[] for _ in range(n)], grad_carry=[None] * n,
            grad_aux=[[None] * len(self._aux_needs_grad) for _ in range(n)], losses=[],
        )
        visits = [("fwd", i) for i in range(L - 1)] + [("head", L - 1)] + [("bwd", i) for i in range(L - 2, -1, -1)]
        # counted on the device from the targets already copied there: no host synchronisation
        counts = torch.stack([(b["targets"] != IGNORE_INDEX).sum() for b in g.batches]).to(torch.float32)
        total = counts.sum() if self.reduce_count is None else self.reduce_count(counts.sum())
        scales = counts / total.clamp_min(1.0)  # no target at all: zero gradients, and a NaN loss skips the step
        fut: Future[LayerWeights] | None = self._start_fetch(visits[0][1])
        try:
            for k, (phase, layer) in enumerate(visits):
                w = self._wait(fut, layer)
                fut = self._start_fetch(visits[k + 1][1]) if k + 1 < len(visits) else None
                if phase == "fwd":
                    self._forward(layer, w, g)
                else:
                    if phase == "bwd" and layer > 0:  # bring the next layer's offloaded inputs back early
                        for mb in range(n):
                            self.acts.prefetch((layer - 1, mb))
                    self._backward(layer, w, g, scales, sink)
                self._release(w)
                del w
                self.engine.sync()
                if self.on_visit is not None:
                    self.on_visit(phase, layer)
        except BaseException:
            # let the in-flight fetch finish and free its slot; its own failure would only hide the first
            with contextlib.suppress(Exception):
                if fut is not None:
                    w = fut.result()
                    if w.transfer is not None:
                        w.transfer.wait()
                    self._release(w)
            self.acts.clear()
            for layer in list(self._open):
                self._close_slab(layer, None)
            raise
        # a micro-batch without targets has a NaN mean (0 / 0) and weight 0: leave it out of the sum
        losses = torch.where(counts > 0, torch.stack(g.losses), 0.0)
        return StepOutput(loss=(losses * counts).sum() / total)

    def _forward(self, layer: int, w: LayerWeights, g: _Group) -> None:
        call = self.program.layers[layer]
        tmpl = self.program.templates[call.template]
        runner = self.runners[call.template]
        save = layer in self.saves
        fwd = runner.save(self.device) if save else runner.forward(self.device)
        with torch.no_grad():
            for mb in range(len(g.batches)):
                with self.timeline.span("compute", layer, mb):
                    if layer == 0:
                        out = fwd(*self._args(call, tmpl, w.tensors, g, mb, None))
                        g.carry[mb], g.aux[mb] = out[0], list(out[1:])
                    else:
                        self.acts.put((layer, mb), g.carry[mb])
                        out = fwd(*self._args(call, tmpl, w.tensors, g, mb, g.carry[mb]))
                        g.carry[mb] = out[0]
                        if save:  # kept on the device until this layer's backward visit
                            g.saved[(layer, mb)] = out[runner.n_out:]

    def _backward(self, layer: int, w: LayerWeights, g: _Group, scales: torch.Tensor, sink: GradSink) -> None:
        prog = self.program
        call = prog.layers[layer]
        tmpl = prog.templates[call.template]
        runner = self.runners[call.template]
        save = layer in self.saves
        joint = runner.backward(self.device) if save else runner.joint(self.device)
        head = layer == prog.n_layers - 1
        for mb in range(len(g.batches)):
            with self.timeline.span("compute", layer, mb):
                if layer == 0:
                    carry_in = None
                    gouts = [g.grad_carry[mb]] + [
                        ga if ga is not None else torch.zeros_like(g.aux[mb][j])  # no block took its gradient
                        for j, (ga, need) in enumerate(zip(g.grad_aux[mb], self._aux_needs_grad)) if need
                    ]
                elif head:
                    carry_in, gouts = g.carry[mb], [scales[mb]]
                    g.carry[mb] = None
                else:
                    carry_in, gouts = self.acts.take((layer, mb)), [g.grad_carry[mb]]
                saved = g.saved.pop((layer, mb)) if save else ()
                res = joint(*self._args(call, tmpl, w.tensors, g, mb, carry_in), *saved, *gouts)
                del saved
                if head:
                    g.losses.append(res[0].detach().float())
                for k, grad in zip(runner.diff, res[runner.n_out :], strict=True):
                    src = call.bindings[tmpl.inputs[k].name]
                    if src.kind == "carry":
                        g.grad_carry[mb] = grad
                    elif src.kind == "aux":
                        if grad is not None:
                            prev = g.grad_aux[mb][src.index]
                            g.grad_aux[mb][src.index] = grad if prev is None else prev + grad
                    elif grad is not None:
                        p = prog.params[src.key]
                        acc = self._accumulator(p.layer)[p.offset : p.offset + p.numel]
                        written = self._written[p.layer]
                        if src.key in written:
                            acc.add_(grad.reshape(-1))
                        else:
                            acc.copy_(grad.reshape(-1))
                            written.add(src.key)
                    else:
                        self._accumulator(prog.params[src.key].layer)  # unused parameter: zeroed when final
            if layer == 0:
                g.grad_carry[mb] = None
                g.grad_aux[mb] = [None] * len(self._aux_needs_grad)
        for owner, user in self._last_user.items():
            if user == layer:
                self._finalise(owner, sink)

    def _accumulator(self, owner: int) -> torch.Tensor:
        acc = self._open.get(owner)
        if acc is None:
            st = self.tiers[owner]
            if st.device_grad:  # its own buffer on the device, kept until the update
                acc = st.grad
            else:
                slot = self.slabs.acquire()
                self.slabs.ready_for_compute(slot, self.engine)  # its previous copy out has finished
                self._open_slots[owner] = slot
                acc = slot.device[: st.numel]
            self._open[owner] = acc
            self._written[owner] = set()
        return acc

    def _finalise(self, owner: int, sink: GradSink) -> None:
        """The owner's gradient is complete: norms on the device, then the copy to its host buffer."""
        st = self.tiers[owner]
        if not st.numel:
            return
        acc = self._accumulator(owner)
        written = self._written.get(owner, set())
        # what no gradient reached (unused, or no visit) is zero; so is a frozen parameter's: with a
        # zero gradient and no decay AdamW leaves it exactly as it is (its moments stay zero), and the
        # clipping norm counts it as torch counts a parameter without .grad
        for p in self.program.layer_params(owner):
            if p.key not in written or p.frozen:
                acc[p.offset : p.offset + p.numel].zero_()
        with self.timeline.span("grad_norms", owner):
            views = [acc[p.offset : p.offset + p.numel] for p in self.program.layer_params(owner)]
            if self.device.type == "cuda":
                norms = torch.stack(torch._foreach_norm(views))
            else:  # as clip_grad_norm_ takes them on the CPU, so the global norm rounds the same
                norms = torch.stack([torch.linalg.vector_norm(v) for v in views])
        # to the host buffer (data parallel disk: as ram); a device-held gradient waits where it is:
        # the update starts after the step's host read of the global norm, which all of backward precedes
        host_reduced = (st.tier == "ram" and not st.device_grad) or (st.tier == "disk" and st.shard is not None)
        if self.reduce_grad is not None and (host_reduced or st.tier == "gpu"):  # reduce-scattered on the device
            st.grad_ready = self.reduce_grad(owner, acc)
        elif host_reduced:
            st.grad_ready = self.engine.d2h([(st.grad, acc)], after=self.engine.marker(), layer=owner, stage="grad_d2h")
        elif st.grad is None:  # spilled to the store; the slab is free again once copied out
            assert self.tiers.spill is not None
            st.grad_ready = Transfer(future=self.tiers.spill.write(owner, acc, self.engine, self.engine.marker()))
        self._close_slab(owner, st.grad_ready)
        sink.grad_final(owner, norms)

    def _close_slab(self, owner: int, transfer: Transfer | None) -> None:
        self._open.pop(owner, None)
        self._written.pop(owner, None)
        slot = self._open_slots.pop(owner, None)
        if slot is not None:
            self.slabs.release(slot, transfer if transfer is not None else self.engine.marker())

    def close(self) -> None:
        """Stop the fetch thread."""
        self._fetcher.shutdown(wait=True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
