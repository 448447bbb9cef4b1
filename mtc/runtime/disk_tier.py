"""Disk-tier state in flight: a bounded ring of host buffer sets, read ahead and written behind.

A `disk` layer's master, m and v live only in the store. For its update they are read, one chunk
of at most ``DISK_CHUNK_NUMEL`` elements at a time (a whole number of the store's chunks), into one
of ``slots`` buffer sets (plus a host buffer for the chunk's gradient on CUDA, where it waits on
the GPU, or when gradients are spilled to the store: `mtc.runtime.grad_spill`), updated there, and
written into the other generation; the set goes back to the ring once its writes are durable.
AdamW is element-wise, so a chunked update is bit-identical to a whole-layer one. Host RAM for
disk layers is therefore ``slots x 12-16 bytes x min(largest disk layer, DISK_CHUNK_NUMEL)``,
whatever the depth and the layer size (at h=4096 a Llama layer has 218M parameters: whole-layer
sets would be 3.5 GB each).

Reads are issued ahead, in the order the updates will consume them (forward order, chunk by
chunk), by one read-ahead thread as soon as a set is free and the layer's previous write has
landed, at the store's read-ahead priority: behind the reads a layer visit is waiting for, ahead of
every write-behind (`mtc.store.fastio.PriorityPool`). So the next step's first updates find their
state already in memory when the global gradient norm is known.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

import torch

from mtc.runtime.grad_spill import GradSpill
from mtc.runtime.tiers import DISK_CHUNK_NUMEL, DISK_SLOTS, StateTiers
from mtc.runtime.pinned import host_buffer
from mtc.store import STATE_DTYPE, TensorStore, state_array_name
from mtc.store.fastio import PRIORITY_READ_AHEAD

__all__ = ["DISK_CHUNK_NUMEL", "ChunkRead", "DiskRing", "StateSet", "layer_chunks"]

_KINDS = ("master", "m", "v")


@dataclasses.dataclass(eq=False)
class StateSet:
    """One chunk's worth of host buffers: master, m, v (and the gradient's host copy on CUDA, or
    read back from the store when gradients are spilled)."""

    index: int
    master: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor | None

    def views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """master, m, v cut to ``n`` elements."""
        return self.master[:n], self.m[:n], self.v[:n]



def layer_chunks(numel: int, chunk: int) -> list[tuple[int, int]]:
    """The [lo, hi) element ranges a layer of ``numel`` is updated in, ``chunk`` at a time."""
    return [(lo, min(lo + chunk, numel)) for lo in range(0, numel, max(1, chunk))]


# one chunk of a layer, read into a set: (the set, lo, hi, the reads filling it)
ChunkRead = tuple[StateSet, int, int, list[Future[None]]]


class DiskRing:
    """``slots`` buffer sets for the disk layers of ``tiers`` and the thread that fills them ahead.

    ``spill``: the layers' gradients are in the store's scratch arrays; each set gets a gradient
    buffer that the read-ahead fills once the step's gradient has landed there. ``numels``: each
    disk layer's array length in ``store`` (default: the whole layer; a data-parallel rank's shard
    store holds its shard only). ``grad_buffers``: whether each set carries a gradient buffer
    (default: on CUDA or when spilling).
    """

    def __init__(self, tiers: StateTiers, store: TensorStore, *, slots: int = DISK_SLOTS, spill: GradSpill | None = None,
                 numels: dict[int, int] | None = None, grad_buffers: bool | None = None) -> None:
        if slots < 1:
            raise ValueError(f"the disk ring needs at least one slot, got {slots}")
        self.tiers, self.store, self.spill = tiers, store, spill
        # the length of each disk layer's arrays in `store`: the whole layer, or (data parallel) this
        # rank's shard of it (`mtc.runtime.dp_disk`); layers of length 0 have nothing to read
        self.numels = numels if numels is not None else {s.layer: s.numel for s in tiers.layers if s.tier == "disk"}
        self.layers = [i for i, n in sorted(self.numels.items()) if n]
        # per layer, its chunk: a whole number of the store's chunks (direct I/O, one writer per chunk)
        self.chunk: dict[int, int] = {}
        for i in self.layers:
            rows = store.array_info(state_array_name(i, "master", 0)).chunk_rows
            self.chunk[i] = min(self.numels[i], max(1, tiers.disk_chunk_numel // rows) * rows)
        numel = max(self.chunk.values(), default=0)
        cuda = tiers.device.type == "cuda"
        # a set needs a gradient buffer unless the update reads the gradient from host memory
        # (CPU device; data parallel: this rank's reduced shard)
        grad_buf = (cuda or spill is not None) if grad_buffers is None else grad_buffers

        def buf() -> torch.Tensor:
            return host_buffer(numel, STATE_DTYPE, pinned=cuda)

        self.sets = [StateSet(k, buf(), buf(), buf(), buf() if grad_buf else None)
                     for k in range(slots if self.layers else 0)]
        tiers.pipeline_bytes["disk_ring"] = sum(t.numel() * 4 for st in self.sets
                                               for t in (st.master, st.m, st.v, st.grad) if t is not None)
        self._free: queue.Queue[StateSet | None] = queue.Queue()  # None: closed (see `close`)
        for st in self.sets:
            self._free.put(st)
        # per layer, the reads posted and not yet taken, oldest step first (one list of chunks per step)
        self._reads: dict[int, collections.deque[list[Future[ChunkRead]]]] = {i: collections.deque() for i in self.layers}
        self._posted = 0  # steps posted: the n-th post reads the n-th gradient spilled
        self._jobs: queue.Queue[tuple[int, int, dict, dict] | None] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read_ahead, name="mtc-disk-readahead", daemon=True)
        self._thread.start()

    # -- the read-ahead ---------------------------------------------------------------------------

    def post(self, generation: int, after: dict[int, Future[None] | None]) -> None:
        """Read every disk layer's state of ``generation`` ahead, in forward order; layer i's read
        starts once ``after[i]`` (its previous write) is done and a set is free."""
        futs = {i: [Future() for _ in layer_chunks(self.numels[i], self.chunk[i])] for i in self.layers}
        for i, f in futs.items():
            self._reads[i].append(f)
        self._jobs.put((generation, self._posted, dict(after), futs))
        self._posted += 1

    def take(self, layer: int) -> list[Future[ChunkRead]]:
        """``layer``'s chunks in order: each the set holding it and the reads filling it (wait for them)."""
        return self._reads[layer].popleft()

    def release(self, st: StateSet) -> None:
        """Give a set back (its state is on disk, nothing reads it any more)."""
        self._free.put(st)

    def _read_ahead(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            gen, seq, after, futs = job
            for i in self.layers:
                landed = self.spill.landed(i, seq) if self.spill is not None else None
                for fut, (lo, hi) in zip(futs[i], layer_chunks(self.numels[i], self.chunk[i]), strict=True):
                    st = None
                    try:
                        st = self._free.get()
                        if st is None:  # closed while waiting for a set (see `close`)
                            self._abandon(futs)
                            return
                        dep = after.get(i)
                        if dep is not None:
                            # the layer's last write: its newest state is on disk (a write's own
                            # error, whatever its type, goes to the update that waits for this chunk)
                            while not dep.done() and not self._closed.is_set():
                                futures_wait([dep], timeout=0.1)
                            if not dep.done():  # closed while waiting for a write never issued
                                self._free.put(st)
                                self._abandon(futs)
                                return
                            dep.result()
                        n = hi - lo
                        reads = [self.store.read_rows_into_async(state_array_name(i, k, gen), lo, t, priority=PRIORITY_READ_AHEAD)
                                 for k, t in zip(_KINDS, st.views(n), strict=True)]
                        if landed is not None:
                            assert st.grad is not None
                            reads.append(self.spill.read_rows_async(i, lo, st.grad[:n], landed))
                        fut.set_result((st, lo, hi, reads))
                    except BaseException as e:  # noqa: BLE001 -- handed to the update that waits for this layer
                        if st is not None:
                            self._free.put(st)
                        fut.set_exception(e)

    def _abandon(self, futs: dict[int, list[Future[ChunkRead]]]) -> None:
        """Fail every chunk of a job not handed out yet: the ring was closed under it."""
        for fs in futs.values():
            for f in fs:
                if not f.done():
                    f.set_exception(RuntimeError("the disk tier's read-ahead was stopped (the run is closing)"))

    def close(self) -> None:
        """Stop the read-ahead thread (reads already issued finish on the store's threads).

        After a failed step the thread may be waiting for a set that the failed update never gives
        back, or for a layer's write that will never be issued: both waits end here, so a rank
        whose peer died stops at once instead of after the join's timeout."""
        self._closed.set()
        self._jobs.put(None)
        self._free.put(None)  # wakes a wait for a free set
        self._thread.join(timeout=30)
