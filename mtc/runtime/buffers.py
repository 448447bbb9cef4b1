"""Bounded rings of device buffers: layer weight slots and gradient slabs.

The executor never holds more than ``slots`` layers' weights on the device at once (the layer
being computed and the ones being prefetched), and never more than a few layers' fp32 gradient
slabs. A buffer goes back to its ring with a `Marker` (weights: compute has finished reading it)
or a `Transfer` (a gradient slab: its device-to-host copy), and the next user of that buffer waits
on it on the device, never on the host. Byte counts let tests check the bound instead of trusting it.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from mtc.runtime.pinned import host_buffer
from mtc.runtime.transfer import CopyEngine, Marker, Transfer

__all__ = ["DeviceRing", "Slot"]


@dataclasses.dataclass(eq=False)
class Slot:
    """One layer's worth of device buffer space."""

    index: int
    device: torch.Tensor
    released: Marker | Transfer | None = None  # what a new user must wait for

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer."""
        return self.device.numel() * self.device.element_size()


class DeviceRing:
    """``slots`` buffers of ``numel`` elements of ``dtype`` on ``device``, with accounting."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, *, slots: int, name: str = "buffer") -> None:
        self.numel, self.dtype, self.device, self.name = max(1, numel), dtype, device, name
        self._free: list[Slot] = []
        self._all: list[Slot] = []
        self._slots = slots
        self._lock = threading.Lock()
        self.bytes_in_use = 0
        self.peak_bytes_in_use = 0

    def _buffer(self) -> torch.Tensor:
        # on the CPU device the slots are host memory that disk layers' visits read the store into
        # (disk_compute store): page-aligned, the store reads them with O_DIRECT; from torch's
        # allocator each read went through a chunk-sized bounce buffer that every I/O thread then
        # kept for the run (4 x 11.5 MiB of host RAM beyond the plan at dim 512), and a second copy
        if self.device.type == "cpu":
            return host_buffer(self.numel, self.dtype, pinned=False)
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def preallocate(self) -> None:
        """Allocate every slot now. On CUDA this must happen before any compute: a block the caching
        allocator hands out later may still be in use by kernels queued on the compute stream, and
        the copy streams would write into it unordered."""
        with self._lock:
            while len(self._all) < self._slots:
                slot = Slot(len(self._all), self._buffer())
                self._all.append(slot)
                self._free.append(slot)

    def acquire(self) -> Slot:
        """Take a free slot (allocated on first use); error if all are held (a scheduling bug)."""
        with self._lock:
            if self._free:
                slot = self._free.pop(0)
            elif len(self._all) < self._slots:
                slot = Slot(len(self._all), self._buffer())
                self._all.append(slot)
            else:
                raise RuntimeError(f"all {self._slots} {self.name} slots are in use; the executor held one too long")
            self.bytes_in_use += slot.nbytes
            self.peak_bytes_in_use = max(self.peak_bytes_in_use, self.bytes_in_use)
            return slot

    def release(self, slot: Slot, after: Marker | Transfer | None) -> None:
        """Give a slot back; its next user waits for ``after`` first."""
        slot.released = after
        with self._lock:
            self.bytes_in_use -= slot.nbytes
            self._free.append(slot)

    def ready_for_copy(self, slot: Slot) -> Marker | None:
        """What a copy into ``slot`` must wait for (as a copy's ``after``)."""
        r = slot.released
        if isinstance(r, Transfer):
            r.wait()  # a previous copy out of this buffer: finished long ago in practice
            return None
        return r

    def ready_for_compute(self, slot: Slot, engine: CopyEngine) -> None:
        """Make compute wait until ``slot``'s previous use (a copy out of it) has finished."""
        r = slot.released
        if isinstance(r, Transfer):
            engine.wait_on_compute(r)

    def buffers(self) -> list[torch.Tensor]:
        """The device buffer of every slot allocated so far."""
        with self._lock:
            return [s.device for s in self._all]

    @property
    def allocated_bytes(self) -> int:
        """Bytes of all slots allocated so far."""
        return sum(s.nbytes for s in self._all)
