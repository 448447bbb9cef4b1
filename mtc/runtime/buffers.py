"""A bounded ring of layer weight buffers: staging on the host, compute copies on the device.

The executor never holds more than ``slots`` layers' weights at once (two: the layer being
computed and the one being prefetched). On CUDA a slot is a pinned host buffer plus a device
buffer with events that order the copy stream against compute; on the CPU the host buffer is the
compute buffer. The pool keeps byte counts so tests can check the bound instead of trusting it.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

__all__ = ["LayerBufferPool", "Slot"]


@dataclasses.dataclass(eq=False)
class Slot:
    """One layer's worth of buffer space."""

    index: int
    host: torch.Tensor
    device: torch.Tensor
    # CUDA only: set when the H2D copy into ``device`` has finished / compute has stopped reading it.
    copied: torch.cuda.Event | None = None
    released: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the compute copy (device side)."""
        return self.device.numel() * self.device.element_size()


class LayerBufferPool:
    """``slots`` buffers of ``numel`` elements of ``dtype``; acquire/release with accounting."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, *, slots: int = 2) -> None:
        self.numel, self.dtype, self.device = max(1, numel), dtype, device
        self.cuda = device.type == "cuda"
        self._free: list[Slot] = []
        self._all: list[Slot] = []
        self._slots = slots
        self._lock = threading.Lock()
        self.bytes_in_use = 0
        self.peak_bytes_in_use = 0

    def acquire(self) -> Slot:
        """Take a free slot (allocated on first use); error if all are held (a scheduling bug)."""
        with self._lock:
            if self._free:
                slot = self._free.pop()
            elif len(self._all) < self._slots:
                slot = self._allocate(len(self._all))
                self._all.append(slot)
            else:
                raise RuntimeError(f"all {self._slots} layer buffers are in use; the executor held a layer too long")
            self.bytes_in_use += slot.nbytes
            self.peak_bytes_in_use = max(self.peak_bytes_in_use, self.bytes_in_use)
            return slot

    def release(self, slot: Slot) -> None:
        """Give a slot back; on CUDA, later copies into it wait until compute is done with it."""
        if self.cuda:
            slot.released = torch.cuda.Event()
            slot.released.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self.bytes_in_use -= slot.nbytes
            self._free.append(slot)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of all slots allocated so far (device side)."""
        return sum(s.nbytes for s in self._all)

    def _allocate(self, index: int) -> Slot:
        if not self.cuda:
            buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            return Slot(index, buf, buf)
        host = torch.empty(self.numel, dtype=self.dtype, pin_memory=True)
        dev = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return Slot(index, host, dev)
