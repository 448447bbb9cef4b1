"""Where each layer's fp32 state lives, and the buffers the engine keeps per layer.

A layer's state is its flat fp32 master weights, Adam m and v (one 1-D tensor each, in the
program's flat-parameter order). The placement puts every layer in one tier:

- ``gpu``: master, m, v and a gradient buffer resident in GPU memory; the GPU updates them. In a
  data-parallel run (device collectives) only this rank's shard of master, m, v; the gradient and
  compute copy stay whole, padded to ``world`` shards for the reduce-scatter and all-gather.
- ``ram``: master, m, v in host RAM; the compute-dtype copy (bf16, or the master itself in fp32)
  in pinned memory, ready to cross PCIe; the gradient arrives in a pinned host buffer; the CPU
  updates the layer. Or the GPU does (``streamed``, when the cost model picks it), streaming
  master, m and v in and out: such a layer's gradient stays in a buffer on the device until then
  (outside data-parallel runs), instead of crossing PCIe down after its backward and up again.
- ``disk``: master, m, v in the store, read ahead into a bounded ring of host buffers for the
  update and written behind into the other generation (`mtc.runtime.disk_tier`); the gradient
  stays where it was accumulated (GPU memory on CUDA) until the update copies it into the ring, or,
  with ``spill_grads`` (when the budget cannot hold 4 B/param of gradients: RAM on the CPU
  device, GPU memory on CUDA), waits in a scratch array of the store (`mtc.runtime.grad_spill`; ``grad`` is None then);
  the compute copy is kept in pinned RAM (``disk_compute="ram"``) or read from the store at each
  visit (``"store"``: no host RAM per parameter at all).

Nothing here knows about streams or steps: the executor and the optimizer own the schedule and use
the per-layer handles (`LayerState.update`, `.write`, `.last_read`) to order themselves.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import torch

from mtc.errors import StoreError
from mtc.graphs.program import Program
from mtc.runtime.grad_spill import GradSpill
from mtc.runtime.pinned import host_buffer, host_nbytes
from mtc.runtime.transfer import Marker, Transfer
from mtc.store import LAYOUT_ATTR, STATE_DTYPE, TensorStore, state_array_name

__all__ = ["DISK_CHUNK_NUMEL", "DISK_COMPUTE", "DISK_SLOTS", "TIERS", "LayerState", "StateTiers", "state_kinds", "zero_moments"]

TIERS = ("gpu", "ram", "disk")
# a disk layer's update moves through host RAM this many elements at a time (16 MiB per fp32 array:
# the store's own chunk, which reads fastest; NOTES.md)
DISK_CHUNK_NUMEL = 4 * 2**20
DISK_SLOTS = 3  # chunk sets in the disk tier's read-ahead ring (`mtc.runtime.disk_tier.DiskRing`)
DISK_COMPUTE = ("ram", "store")  # where a disk layer's compute copy lives: pinned RAM, or read per visit


def _read_arrays(store: TensorStore, into: dict[str, torch.Tensor]) -> None:
    """Read each named array into its buffer, all side by side; every read ends before an error is raised."""
    futs = [store.read_into_async(name, out) for name, out in into.items()]
    errors = [e for e in (f.exception() for f in futs) if e is not None]
    if errors:
        raise errors[0]


def zero_moments(store: TensorStore, layer: int, generation: int) -> None:
    """A disk layer resumed from a commit without moments (durability ``weights``): its m and v in
    that generation are zeros, as a ram layer's start. The disk tier reads its state from the
    store, and what the arrays hold there is no commit's: an older step's moments, or chunks never
    written (the layer was in RAM then). The commit does not name these arrays, so a crash
    midway only makes the next resume write them again."""
    for kind in ("m", "v"):
        name = state_array_name(layer, kind, generation)
        info = store.array_info(name)
        rows = max(info.chunk_rows, 1) * max(1, (1 << 22) // max(info.chunk_rows, 1))  # whole chunks, ~16 MiB
        zeros = host_buffer(min(info.shape[0], rows), STATE_DTYPE, pinned=False)  # page-aligned: O_DIRECT writes
        for lo in range(0, info.shape[0], zeros.numel()):
            store.write_rows(name, lo, zeros[: min(zeros.numel(), info.shape[0] - lo)])


def state_kinds(tier: str, durability: str) -> tuple[str, ...]:
    """Which state arrays of a layer the store holds (both generations) for this tier and mode."""
    if tier == "disk" or durability == "full":
        return ("master", "m", "v")
    if durability == "weights":
        return ("master",)
    return ()


@dataclasses.dataclass(eq=False)
class LayerState:
    """One layer's state and buffers, and the handles that order work on them."""

    layer: int
    tier: str
    numel: int
    decay_numel: int
    master: torch.Tensor | None  # None on disk
    m: torch.Tensor | None
    v: torch.Tensor | None
    compute: torch.Tensor | None  # what the GPU reads: the compute-dtype copy (may alias master; None: read from the store)
    grad: torch.Tensor | None  # the step's final fp32 gradient (host pinned for `ram`; on the compute device for `gpu`,
    # `disk` and streamed `ram` layers: see `device_grad`; None for a disk layer whose gradient is spilled to the store)
    last_read: Transfer | None = None  # the last copy that read `compute` (an update waits for it)
    staged: Transfer | None = None  # gpu tier: a commit's copy of master, m, v to the host (the next update waits for it)
    grad_ready: Transfer | None = None  # the gradient's device-to-host copy
    update: Future[None] | None = None  # this step's update (the next fetch waits for it)
    # a GPU-updated ram layer's master, m and v back in host memory (None: `update` says so): its
    # new weights may come back first (`StreamingAdamW._update_streamed`)
    state_back: Future[None] | None = None
    # a GPU-updated ram layer loaded ahead: its new compute-dtype weights in its scratch set on the
    # device and the marker of the kernel that wrote them (None: read `compute` once `update` is
    # done). The set is rewritten only by the layer's next update, which waits for `last_read`, so
    # every visit until then copies from here within GPU memory (`StreamingAdamW._update_streamed`)
    device_copy: Future[tuple[torch.Tensor, Marker] | None] | None = None
    # the handed-over weights did not cross back: `compute` holds older ones until someone reads
    # them (`mtc.runtime.optimizer.refresh_host_compute`; `StreamingAdamW.wait` does for all)
    host_compute_stale: bool = False
    write: Future[None] | None = None  # write-behind in flight (the next update waits for it)
    staging: list[torch.Tensor] | None = None  # gpu tier: pinned host copies for write-behind
    # data parallel: the range [lo, hi) of the flat state this rank owns; master, m and v then hold
    # only it (padded to the common shard size), `compute` the whole layer (all-gathered), `grad`
    # the whole layer's gradient (reduced over the ranks); see mtc.runtime.collectives
    shard: tuple[int, int] | None = None
    # data parallel, gpu tier: the all-gather of this step's updated shards into `compute` (on the
    # comm stream); the compute stream waits for it before a visit reads the resident copy
    gathered: Transfer | None = None
    # the gradient accumulates straight into `grad` on the compute device and waits there for the
    # update (no gradient slab, no copy to the host)
    device_grad: bool = False


class StateTiers:
    """Every layer's `LayerState`, allocated once for the run (no allocation per step)."""

    disk_chunk_numel = DISK_CHUNK_NUMEL  # elements per disk-tier array chunk (the store's and the update's)

    def __init__(self, program: Program, placement: list[str], device: torch.device, compute_dtype: torch.dtype, *,
                 streamed: set[int] | None = None, disk_compute: str = "ram", spill_grads: bool = False, rank: int = 0,
                 world_size: int = 1, sharded: bool | None = None, streamed_grads_on_device: bool = True) -> None:
        if len(placement) != program.n_layers or any(t not in TIERS for t in placement):
            raise ValueError(f"placement must name one of {TIERS} per layer, got {placement}")
        if disk_compute not in DISK_COMPUTE:
            raise ValueError(f"disk_compute must be one of {DISK_COMPUTE}, got {disk_compute!r}")
        self.disk_compute = disk_compute
        # > 1 ranks: layers keep only this rank's shard of master, m, v (also at world size 1 when the
        # data-parallel engine is forced there: `mtc.dist.World.force`)
        self.sharded = world_size > 1 if sharded is None else sharded
        # data parallel: a disk layer's gradient is reduced over the ranks from a host buffer, never spilled
        self.spill_grads = spill_grads and any(t == "disk" for t in placement) and not self.sharded
        self.spill: GradSpill | None = None  # set by `create_arrays` when spilling
        self.store: TensorStore | None = None  # set by `create_arrays`: disk layers live there
        self.disk_generation = 0  # the generation holding disk layers' newest state (the optimizer flips it)
        # durability none: nothing resumes, so disk layers update their generation in place (one on
        # disk instead of two) except the one a durable commit still names (`disk_write_generation`)
        self.disk_in_place = False
        self.protected_generation: int | None = None
        self.pipeline_bytes: dict[str, int] = {}  # host buffers of the I/O pipeline (ring, staging), by owner
        self.program, self.placement, self.device, self.compute_dtype = program, placement, device, compute_dtype
        self.cuda = device.type == "cuda"
        self.streamed = streamed or set()  # ram layers the GPU updates: their state crosses PCIe, so it is pinned
        # ... and their gradient waits on the device (`placement.streamed_grads_on_device`; never sharded)
        self.streamed_grads_on_device = streamed_grads_on_device and not self.sharded
        self.rank, self.world_size = rank, world_size
        self._stage: list[torch.Tensor] = []  # start-up only: host buffers gpu layers' state passes through
        self.layers: list[LayerState] = []
        for i, tier in enumerate(placement):
            n = program.layer_numel(i)
            self.layers.append(self._allocate(i, tier, n, program.layer_decay_numel(i)))

    def _host(self, n: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        # pin only on CUDA: without it `pin_memory=True` raises (NOTES.md)
        return host_buffer(n, dtype, pinned=pinned and self.cuda)

    def _allocate(self, i: int, tier: str, n: int, nd: int) -> LayerState:
        fp32_compute = self.compute_dtype == STATE_DTYPE
        if tier == "gpu" and self.sharded:
            return self._allocate_gpu_shard(i, n, nd)
        if tier == "gpu":
            master = torch.zeros(n, dtype=STATE_DTYPE, device=self.device)
            m, v = torch.zeros_like(master), torch.zeros_like(master)
            compute = master if fp32_compute else torch.zeros(n, dtype=self.compute_dtype, device=self.device)
            grad = torch.zeros_like(master)
            return LayerState(i, tier, n, nd, master, m, v, compute, grad, device_grad=True)
        if tier == "ram" and self.sharded:
            return self._allocate_shard(i, n, nd)
        if tier == "ram":
            # the master itself is the PCIe source in fp32 compute, so it is the pinned buffer then
            streamed = i in self.streamed
            master = self._host(n, STATE_DTYPE, pinned=fp32_compute or streamed)
            m, v = self._host(n, STATE_DTYPE, pinned=streamed), self._host(n, STATE_DTYPE, pinned=streamed)
            compute = master if fp32_compute else self._host(n, self.compute_dtype, pinned=True)
            if streamed and self.streamed_grads_on_device:  # the gradient waits there (it would cross PCIe down and back up)
                return LayerState(i, tier, n, nd, master, m, v, compute, torch.zeros(n, dtype=STATE_DTYPE, device=self.device),
                                  device_grad=True)
            return LayerState(i, tier, n, nd, master, m, v, compute, self._host(n, STATE_DTYPE, pinned=True))
        if self.sharded:
            return self._allocate_disk_shard(i, n, nd)
        # disk: the gradient stays on the compute device (a bounded ring of host buffers takes it at the update)
        compute = self._host(n, self.compute_dtype, pinned=True) if self.disk_compute == "ram" else None
        grad = None if self.spill_grads else torch.zeros(n, dtype=STATE_DTYPE, device=self.device)
        return LayerState(i, tier, n, nd, None, None, None, compute, grad, device_grad=grad is not None)

    def _allocate_shard(self, i: int, n: int, nd: int) -> LayerState:
        """A ram layer of a data-parallel run: this rank's shard of the state, the whole compute copy."""
        per = -(-n // self.world_size)
        lo, hi = min(self.rank * per, n), min((self.rank + 1) * per, n)
        fp32_compute, streamed = self.compute_dtype == STATE_DTYPE, i in self.streamed
        # fp32: the master shard itself crosses to the device for the device all-gather, so it is
        # pinned; all three when the GPU updates the layer (`gpu_update`)
        master = self._host(per, STATE_DTYPE, pinned=fp32_compute or streamed)
        m, v = (self._host(per, STATE_DTYPE, pinned=streamed) for _ in range(2))
        compute = self._host(per * self.world_size, self.compute_dtype, pinned=True)  # every rank's shard, padded
        return LayerState(i, "ram", n, nd, master, m, v, compute, self._host(n, STATE_DTYPE, pinned=True), shard=(lo, hi))

    def _allocate_gpu_shard(self, i: int, n: int, nd: int) -> LayerState:
        """A gpu layer of a data-parallel run: this rank's shard of master, m, v on the device, the
        whole compute copy and gradient there too, both padded to ``world`` equal shards (what the
        device reduce-scatter reads and the all-gather writes; the views cover the layer)."""
        per = -(-n // self.world_size)
        lo, hi = min(self.rank * per, n), min((self.rank + 1) * per, n)
        master, m, v = (torch.zeros(per, dtype=STATE_DTYPE, device=self.device) for _ in range(3))
        compute = torch.zeros(per * self.world_size, dtype=self.compute_dtype, device=self.device)
        grad = torch.zeros(per * self.world_size, dtype=STATE_DTYPE, device=self.device)[:n]
        return LayerState(i, "gpu", n, nd, master, m, v, compute, grad, shard=(lo, hi), device_grad=True)

    def _allocate_disk_shard(self, i: int, n: int, nd: int) -> LayerState:
        """A disk layer of a data-parallel run: no state in RAM (this rank's shard of it lives in its
        shard store, `mtc.runtime.dp_disk`), the whole compute copy in pinned RAM, padded as a ram
        shard's (the all-gather fills it; a per-visit read from the store would need every rank's
        store), and a host gradient buffer (reduced over the ranks like a ram layer's)."""
        per = -(-n // self.world_size)
        lo, hi = min(self.rank * per, n), min((self.rank + 1) * per, n)
        compute = self._host(per * self.world_size, self.compute_dtype, pinned=True)
        return LayerState(i, "disk", n, nd, None, None, None, compute, self._host(n, STATE_DTYPE, pinned=True), shard=(lo, hi))

    def __getitem__(self, layer: int) -> LayerState:
        return self.layers[layer]

    def tier_numel(self) -> dict[str, int]:
        """Parameters per tier."""
        out = dict.fromkeys(TIERS, 0)
        for s in self.layers:
            out[s.tier] += s.numel
        return out

    # -- filling the state ----------------------------------------------------------------------

    def initial_master(self, layer: int) -> torch.Tensor | None:
        """The buffer a new run may flatten ``layer``'s initial weights into, then hand to
        `set_layer` as the master: a ram layer's master itself (no copy at all), a gpu layer's
        share of a host staging buffer (pinned on CUDA) that every gpu layer reuses (it is
        copied over at once), a disk layer's page-aligned buffer of its own (written to the store
        with O_DIRECT, then let go: through torch's allocator each write took a chunk-sized bounce
        buffer that every I/O thread kept for the run); None for data-parallel shards (a host copy).
        `release_staging` lets the staging buffer go once the state is filled."""
        s = self.layers[layer]
        if s.shard is not None:
            return None
        if s.tier == "disk":
            return self._host(s.numel, STATE_DTYPE, pinned=False)
        return s.master if s.tier == "ram" else self._staging(1)[0][: s.numel]

    def _staging(self, k: int) -> list[torch.Tensor]:
        """``k`` host buffers as large as the largest whole gpu layer, pinned on CUDA, kept until
        `release_staging`: a new run's weights and a resume's arrays reach gpu layers through them."""
        if len(self._stage) < k:
            most = max(x.numel for x in self.layers if x.tier == "gpu" and x.shard is None)
            self._stage += [self._host(most, STATE_DTYPE, pinned=True) for _ in range(k - len(self._stage))]
        return self._stage[:k]

    def release_staging(self) -> None:
        """Let the start-up staging buffers go (their pinned memory is not the run's)."""
        self._stage = []

    @torch.no_grad()
    def set_layer(self, layer: int, master: torch.Tensor, m: torch.Tensor | None = None, v: torch.Tensor | None = None,
                  *, fresh: bool = False) -> None:
        """Set a RAM/GPU layer's master (and moments; zeros when None) and refresh its compute copy.
        ``fresh``: the layer's buffers are as allocated (zero-filled), so pinned moments are left
        as they are (registering them faulted every page in: a zero pass is 8 B/param of writes
        for nothing). Unpinned ones are still zeroed: that pass is their first touch, and on the
        CPU VM here it ran faster in one tight pass than spread over the first update's threads
        (a 0.57B stateless run's state fill and first step: 20-21 s with the pass, 25-46 s without)."""
        s = self.layers[layer]
        s.device_copy = None  # new weights from outside: a GPU scratch set's copy of the old ones is stale
        s.host_compute_stale = False
        if s.tier == "disk":
            if s.compute is not None:
                s.compute[: s.numel].copy_(master)  # a data-parallel run's copy is padded
            return
        if s.shard is not None:  # data parallel: this rank's range of the state, the whole compute copy
            lo, hi = s.shard
            for dst, src in ((s.master, master), (s.m, m), (s.v, v)):
                dst.zero_()
                if src is not None:
                    dst[: hi - lo].copy_(src[lo:hi])
            s.compute[: s.numel].copy_(master)
            return
        s.master.copy_(master)  # nothing to copy when ``master`` is the buffer itself (`initial_master`)
        for dst, src in ((s.m, m), (s.v, v)):
            if src is not None:
                dst.copy_(src)
            elif not (fresh and dst.is_pinned()):
                dst.zero_()
        if s.compute is not s.master:
            s.compute.copy_(s.master)

    def disk_write_generation(self) -> int:
        """The generation disk layers' updates write this step: the other one, so that the one read
        stays whole until a commit names the new one; or, in place (``disk_in_place``), the one
        read, unless a commit names it (a run resumed from a durable commit flips once first)."""
        g = self.disk_generation
        return g if self.disk_in_place and g != self.protected_generation else 1 - g

    def create_arrays(self, store: TensorStore, durability: str) -> None:
        """Create both generations of the arrays this placement and durability keep on disk, and
        record the layout (what `mtc verify` expects of each layer)."""
        self.store = store
        if not store.read_only:
            store.set_attribute(LAYOUT_ATTR, {"numels": [s.numel for s in self.layers], "compute_dtype": None,
                                              "placement": list(self.placement)})
        for s in self.layers:
            if not s.numel:
                continue
            for kind in state_kinds(s.tier, durability):
                for g in (0, 1):
                    name = state_array_name(s.layer, kind, g)
                    if store.has_array(name):
                        info = store.array_info(name)
                        if info.shape != (s.numel,) or info.dtype != STATE_DTYPE:
                            raise StoreError(f"array {name} holds {info.shape} {info.dtype}, the plan needs ({s.numel},) float32")
                    else:
                        rows = None if self.disk_chunk_numel == DISK_CHUNK_NUMEL or s.tier != "disk" else self.disk_chunk_numel
                        store.create_array(name, (s.numel,), STATE_DTYPE, chunk_rows=rows)
        if self.spill_grads and not store.read_only:
            self.spill = GradSpill(store, {s.layer: s.numel for s in self.layers if s.tier == "disk"},
                                   chunk_numel=self.disk_chunk_numel, pinned=self.cuda,
                                   chunk_rows=None if self.disk_chunk_numel == DISK_CHUNK_NUMEL else self.disk_chunk_numel)
            self.pipeline_bytes["grad_spill"] = self.spill.staging_bytes

    def load(self, store: TensorStore, generation: int, durability: str) -> None:
        """Read the committed generation into RAM/GPU (and disk layers' compute copies), at a
        run's start (the buffers as allocated: moments the mode does not keep stay zeros).

        A ram layer's arrays are read straight into its own buffers; a gpu layer's into three
        staging buffers (pinned on CUDA) that every gpu layer reuses, then copied over. Either
        way the arrays of a layer are read side by side, and no host memory is allocated per
        layer (a 4.6B run's full resume: ~55 GB less to allocate and copy)."""
        for s in self.layers:
            if not s.numel:
                continue
            kinds = state_kinds(s.tier, durability)
            if s.tier == "disk":  # the store is its tier: only a compute copy kept in RAM is filled
                if s.compute is not None:
                    self.set_layer(s.layer, store.read(state_array_name(s.layer, "master", generation)))
                if durability != "full" and s.shard is None:
                    # (a sharded disk layer's moments are in the rank's shard store, where
                    # `mtc.shards` starts them at zero: ``store`` is then the run directory's, which
                    # the other ranks read, and only rank 0 may write)
                    zero_moments(store, s.layer, generation)
                continue
            if "master" not in kinds:
                raise StoreError(f"layer {s.layer}'s weights are not in the store (durability {durability!r}); "
                                 "a run with durability 'none' cannot be resumed: start it over with --overwrite")
            if s.shard is None:
                own = {"master": s.master, "m": s.m, "v": s.v}
                bufs = own if s.tier == "ram" else {k: t[: s.numel] for k, t in zip(own, self._staging(3), strict=True)}
                _read_arrays(store, {state_array_name(s.layer, k, generation): bufs[k] for k in kinds})
                if bufs is not own:
                    for k in kinds:
                        own[k].copy_(bufs[k], non_blocking=True)
                    if self.cuda:  # the staging buffers take the next gpu layer's arrays
                        torch.cuda.current_stream(self.device).synchronize()
                self.set_layer(s.layer, s.master, *(own[k] if k in kinds else None for k in ("m", "v")), fresh=True)
                continue
            vals = {k: store.read(state_array_name(s.layer, k, generation)) for k in kinds}
            self.set_layer(s.layer, vals["master"], vals.get("m"), vals.get("v"))
        self.release_staging()

    def write_arrays(self, store: TensorStore, layer: int, generation: int, durability: str) -> list[Future[None]]:
        """Start writing a RAM/GPU layer's state into ``generation`` (the caller keeps it unchanged until done)."""
        s = self.layers[layer]
        if s.tier == "disk" or not s.numel:
            return []  # disk layers are written by their update
        kinds = state_kinds(s.tier, durability)
        src = {"master": s.master, "m": s.m, "v": s.v}
        if s.tier == "gpu":
            assert s.staging is not None, "gpu-tier state must be staged to the host before write-behind"
            src = dict(zip(("master", "m", "v"), s.staging, strict=True))
        # in place: callers write only the generation the last durable commit does not name
        return [store.write_async(state_array_name(layer, k, generation), src[k], in_place=True) for k in kinds]

    def staging_for(self, layer: int) -> list[torch.Tensor]:
        """Pinned host buffers for a gpu-tier layer's write-behind (allocated at its first commit)."""
        s = self.layers[layer]
        if s.staging is None:
            s.staging = [self._host(s.numel, STATE_DTYPE, pinned=True) for _ in range(3)]
        return s.staging

    def host_bytes(self) -> int:
        """Host RAM held by the tiers (state, compute copies, gradient buffers, staging) and the
        I/O pipeline's buffers registered in `pipeline_bytes` (the disk ring, visit staging)."""
        total = sum(self.pipeline_bytes.values())
        for s in self.layers:
            held = [s.master, s.m, s.v, s.grad, *(s.staging or [])]
            if s.compute is not s.master:  # in fp32 the master is the compute copy: counted once, as the master
                held.append(s.compute)
            total += sum(host_nbytes(t) for t in held if t is not None and t.device.type == "cpu")
        return total
