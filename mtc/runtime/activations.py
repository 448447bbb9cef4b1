"""Layer-boundary activations of a micro-batch group: on the GPU within a budget, else pinned host.

The forward keeps each block's input for every micro-batch of the group (the backward recomputes
the block from it). Up to ``budget_bytes`` stay on the device; the rest are copied to pinned host
buffers on a device-to-host stream of their own (the copy engine's ``act`` lane) and brought back
on its host-to-device stream one layer ahead of their backward visit, so GPU memory stays flat in
depth. Host buffers are allocated on first use and reused every step (same shapes each step): no
pinned allocation in the steady state.
"""

from __future__ import annotations

import torch

from mtc.runtime.pinned import host_buffer
from mtc.runtime.transfer import CopyEngine, Transfer

__all__ = ["ActivationStore"]

Key = tuple[int, int]  # (layer, micro-batch)


class ActivationStore:
    """Saved block inputs, keyed by (layer, micro-batch)."""

    def __init__(self, engine: CopyEngine, budget_bytes: int | None) -> None:
        self.engine, self.budget = engine, budget_bytes
        self._dev: dict[Key, torch.Tensor] = {}
        self._host: dict[Key, torch.Tensor] = {}  # reused pinned buffers
        self._out: dict[Key, Transfer] = {}  # device -> host copies in flight
        self._back: dict[Key, tuple[torch.Tensor, Transfer]] = {}  # host -> device prefetches
        self.device_bytes = 0
        self.peak_device_bytes = 0
        self.offloaded_bytes = 0

    def put(self, key: Key, t: torch.Tensor) -> None:
        """Keep ``t`` (the caller will not modify it) until `take`."""
        nb = t.numel() * t.element_size()
        if self.budget is None or self.device_bytes + nb <= self.budget:
            self._dev[key] = t
            self.device_bytes += nb
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
            return
        host = self._host.get(key)
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            host = self._host[key] = host_buffer(t.numel(), t.dtype, pinned=self.engine.cuda).view(t.shape)
        self._out[key] = self.engine.d2h([(host, t)], after=self.engine.marker(), layer=key[0], stage="act_out", lane="act")
        if self.engine.cuda:
            # drop `t` now (that is the point of offloading) without letting the allocator hand its
            # memory out before the copy stream has read it
            t.record_stream(self.engine.act_d2h_stream)
        self.offloaded_bytes += nb

    def prefetch(self, key: Key) -> None:
        """Start bringing an offloaded activation back (no-op when it stayed on the device)."""
        if key not in self._out or key in self._back:
            return
        host = self._host[key]
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.engine.device)
        # the copy back waits, on the device (the host never blocks here), for the copy out to the
        # same host buffer, and for the kernels queued on the compute stream: `dev` may reuse memory
        # they still read
        after = [self.engine.marker(), self._out[key]]
        self._back[key] = (dev, self.engine.h2d([(dev, host)], after=after, layer=key[0], stage="act_in", lane="act"))

    def take(self, key: Key) -> torch.Tensor:
        """Remove and return the activation, on the device (waits for its copy back if needed)."""
        t = self._dev.pop(key, None)
        if t is not None:
            self.device_bytes -= t.numel() * t.element_size()
            return t
        self.prefetch(key)
        dev, tr = self._back.pop(key)
        del self._out[key]
        self.engine.wait_on_compute(tr)
        return dev

    def clear(self) -> None:
        """Drop everything held for the step (after an error); keep the reusable host buffers."""
        for tr in self._out.values():
            tr.wait()
        for _dev, tr in self._back.values():  # copies back may still write the device tensors dropped here
            tr.wait()
        self._dev.clear()
        self._out.clear()
        self._back.clear()
        self.device_bytes = 0
