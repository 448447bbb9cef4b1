"""Disk-tier state in flight: a bounded ring of host buffer sets, read ahead and written behind.

A `disk` layer's master, m and v live only in the store. For its update they are read into one
of ``slots`` buffer sets (plus, on CUDA, a host buffer for its gradient), updated there, and
written into the other generation; the set goes back to the ring once its writes are durable.
Host RAM for disk layers is therefore ``slots x 12-16 bytes x the largest disk layer``, whatever
the depth.

Reads are issued ahead, in the order the updates will consume them (forward order), by one
read-ahead thread as soon as a set is free and the layer's previous write has landed, at the
store's read-ahead priority: behind the reads a layer visit is waiting for, ahead of every
write-behind (`mtc.store.fastio.PriorityPool`). So the next step's first updates find their state
already in memory when the global gradient norm is known.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from concurrent.futures import Future

import numpy as np
import torch

from mtc.runtime.tiers import StateTiers
from mtc.store import STATE_DTYPE, TensorStore, state_array_name
from mtc.store.fastio import PRIORITY_READ_AHEAD, aligned_empty

__all__ = ["DiskRing", "StateSet"]

_KINDS = ("master", "m", "v")


@dataclasses.dataclass(eq=False)
class StateSet:
    """One layer's worth of host buffers: master, m, v (and the gradient's host copy on CUDA)."""

    index: int
    master: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor | None

    def views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """master, m, v cut to ``n`` elements."""
        return self.master[:n], self.m[:n], self.v[:n]


def _host_buffer(numel: int, pinned: bool) -> torch.Tensor:
    if pinned:  # cudaHostAlloc memory is page-aligned: the store reads it with O_DIRECT
        return torch.empty(numel, dtype=STATE_DTYPE, pin_memory=True)
    return torch.from_numpy(aligned_empty(numel * 4).view(np.float32))


class DiskRing:
    """``slots`` buffer sets for the disk layers of ``tiers`` and the thread that fills them ahead."""

    def __init__(self, tiers: StateTiers, store: TensorStore, *, slots: int = 3) -> None:
        if slots < 1:
            raise ValueError(f"the disk ring needs at least one slot, got {slots}")
        self.tiers, self.store = tiers, store
        self.layers = [s.layer for s in tiers.layers if s.tier == "disk" and s.numel]
        numel = max((tiers[i].numel for i in self.layers), default=0)
        cuda = tiers.device.type == "cuda"
        self.sets = [StateSet(k, *(_host_buffer(numel, cuda) for _ in range(3)), _host_buffer(numel, True) if cuda else None)
                     for k in range(slots if self.layers else 0)]
        tiers.pipeline_bytes["disk_ring"] = sum(t.numel() * 4 for st in self.sets
                                               for t in (st.master, st.m, st.v, st.grad) if t is not None)
        self._free: queue.Queue[StateSet] = queue.Queue()
        for st in self.sets:
            self._free.put(st)
        # per layer, the reads posted and not yet taken, oldest first (one per step posted)
        self._reads: dict[int, collections.deque[Future[tuple[StateSet, list[Future[None]]]]]] = {
            i: collections.deque() for i in self.layers}
        self._jobs: queue.Queue[tuple[int, dict, dict] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read_ahead, name="mtc-disk-readahead", daemon=True)
        self._thread.start()

    # -- the read-ahead ---------------------------------------------------------------------------

    def post(self, generation: int, after: dict[int, Future[None] | None]) -> None:
        """Read every disk layer's state of ``generation`` ahead, in forward order; layer i's read
        starts once ``after[i]`` (its previous write) is done and a set is free."""
        futs = {i: Future() for i in self.layers}
        for i, f in futs.items():
            self._reads[i].append(f)
        self._jobs.put((generation, dict(after), futs))

    def take(self, layer: int) -> tuple[StateSet, list[Future[None]]]:
        """The set holding ``layer``'s state, and the reads filling it (wait for them)."""
        return self._reads[layer].popleft().result()

    def release(self, st: StateSet) -> None:
        """Give a set back (its state is on disk, nothing reads it any more)."""
        self._free.put(st)

    def _read_ahead(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            gen, after, futs = job
            for i in self.layers:
                fut, st = futs[i], None
                try:
                    st = self._free.get()
                    dep = after.get(i)
                    if dep is not None:
                        dep.result()  # the layer's last write: its newest state is on disk
                    n = self.tiers[i].numel
                    reads = [self.store.read_into_async(state_array_name(i, k, gen), t, priority=PRIORITY_READ_AHEAD)
                             for k, t in zip(_KINDS, st.views(n), strict=True)]
                    fut.set_result((st, reads))
                except BaseException as e:  # noqa: BLE001 -- handed to the update that waits for this layer
                    if st is not None:
                        self._free.put(st)
                    fut.set_exception(e)

    def close(self) -> None:
        """Stop the read-ahead thread (reads already issued finish on the store's threads)."""
        self._jobs.put(None)
        self._thread.join(timeout=30)
