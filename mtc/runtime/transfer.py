"""Copies between host and device on their own streams, ordered by events, never by host syncs.

On CUDA the compute stream (the current one) is joined by a host-to-device and a device-to-host
stream per lane (`CopyEngine`: the visits' copies, and the optimizer's). A copy waits for a
`Marker` (an event recorded on the compute stream: "compute has finished reading/writing this
buffer") and returns a `Transfer` (an event recorded after the copy) that the compute stream or a
host thread can wait on. On the CPU the same interface runs each lane's and direction's copies on
a thread of its own, so the schedule, its overlaps and its buffer-reuse rules are exercised by the
CPU tests with real concurrency.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mtc.runtime.timeline import Timeline

__all__ = ["CONVERT_PIECE", "CopyEngine", "Marker", "Transfer", "converting_pieces"]


class Marker:
    """A point in the compute stream's work (CUDA: a recorded event; CPU: already reached)."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event


class Transfer:
    """A copy in flight: wait for it from the host, or make the compute stream wait for it."""

    __slots__ = ("event", "future", "nbytes")

    def __init__(self, *, event: torch.cuda.Event | None = None, future: Future[None] | None = None, nbytes: int = 0) -> None:
        self.event, self.future, self.nbytes = event, future, nbytes

    def done(self) -> bool:
        """Whether the copy has finished (non-blocking)."""
        if self.future is not None:
            return self.future.done()
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block this host thread until the copy has finished."""
        if self.future is not None:
            self.future.result()
        elif self.event is not None:
            self.event.synchronize()

    def wait_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Make ``stream`` (CUDA) wait for the copy without blocking the host; on the CPU, block."""
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)
        else:
            self.wait()


Copies = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (dst, src) pairs
# what a copy waits for before it starts: a point in the compute stream, another copy, or several
After = Marker | Transfer | Sequence[Marker | Transfer] | None


LANES = ("main", "act", "opt")

# A non-blocking copy that changes dtype across PCIe (a disk layer's fp32 master read from the
# store into a bf16 weight slot) lands in a device temporary of the source's size first (torch's
# copy kernel converts on the device): a whole 175B-shaped layer's would be 7 GB of GPU memory the
# planner does not count. Issued in pieces, the temporary is one piece (64 MB of fp32), reused.
CONVERT_PIECE = 1 << 24  # elements


def converting_pieces(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)`` as one copy, or as pieces of `CONVERT_PIECE` elements when the copy converts
    dtype between host and device (contiguous tensors of one shape)."""
    n = src.numel()
    if (dst.dtype == src.dtype or dst.device.type == src.device.type or n <= CONVERT_PIECE or dst.shape != src.shape
            or not (dst.is_contiguous() and src.is_contiguous())):
        return [(dst, src)]
    d, s = dst.view(-1), src.view(-1)
    return [(d[i : i + CONVERT_PIECE], s[i : i + CONVERT_PIECE]) for i in range(0, n, CONVERT_PIECE)]


class CopyEngine:
    """Host<->device copies for one device: CUDA streams and events, or threads on the CPU.

    Copies go in one of three lanes, each with its own stream (or thread) per direction: ``main``
    for what a visit waits on (weights, gradient slabs), ``act`` for the layer-boundary activations
    offloaded to host memory and brought back (each copy waits for the compute that wrote its
    activation, or for the kernels that may still read its memory: queued behind a weight fetch
    those waits would hold the fetch up), ``opt`` for the optimizer's state traffic (GPU-side
    updates of ram layers, disk-layer gradient chunks, gpu-tier staging for write-behind). A copy
    that waits (``after``) holds up everything queued behind it on its stream, so the optimizer's
    waits on its own kernels must not sit in front of the next layer's weights. Lanes are ordered with each other only through ``after`` and host futures.
    """

    def __init__(self, device: torch.device, timeline: Timeline, *, serialize: bool = False) -> None:
        self.device, self.timeline = device, timeline
        # serialize: every copy completes (and the device idles) before the call returns; the
        # reference schedule that the race tests compare the overlapped one with
        self.serialize = serialize
        self.cuda = device.type == "cuda"
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.d2d_bytes = 0  # CUDA: copies issued as h2d whose source is on the device (a resident owner's tied weights)
        self._count = threading.Lock()  # copies are issued from the fetch, optimizer and training threads
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(device)
            self._streams = {(lane, d): torch.cuda.Stream(device) for lane in LANES for d in ("h2d", "d2h")}
            self.h2d_stream, self.d2h_stream = self._streams[("main", "h2d")], self._streams[("main", "d2h")]
            self.act_d2h_stream = self._streams[("act", "d2h")]
        else:
            self.compute_stream = self.h2d_stream = self.d2h_stream = self.act_d2h_stream = None
            self._threads = {(lane, d): ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mtc-{lane}-{d}")
                             for lane in LANES for d in ("h2d", "d2h")}

    def marker(self) -> Marker:
        """A marker at the current end of the compute stream's work."""
        if not self.cuda:
            return Marker(None)
        ev = torch.cuda.Event()
        ev.record(self.compute_stream)
        return Marker(ev)

    def h2d(self, copies: Copies, *, after: After = None, layer: int = -1, stage: str = "h2d", lane: str = "main") -> Transfer:
        """Copy host -> device (or host -> host slot on the CPU) once ``after`` is reached."""
        return self._copy("h2d", copies, after, layer, stage, lane)

    def d2h(self, copies: Copies, *, after: After = None, layer: int = -1, stage: str = "d2h", lane: str = "main") -> Transfer:
        """Copy device -> host once ``after`` is reached (e.g. the gradient slab is final)."""
        return self._copy("d2h", copies, after, layer, stage, lane)

    def _copy(self, direction: str, copies: Copies, after: After, layer: int, stage: str, lane: str) -> Transfer:
        afters = [] if after is None else list(after) if isinstance(after, Sequence) else [after]
        nbytes = sum(s.numel() * s.element_size() for _, s in copies)
        # what crosses PCIe: on CUDA a copy whose source and destination are both on the device does
        # not (on the CPU device every copy stands for a crossing, as the engine's schedule has it,
        # but a "d2d" one: a visit's weights from an update's scratch set, `LayerState.device_copy`)
        local = nbytes if stage == "d2d" else sum(s.numel() * s.element_size() for d, s in copies
                                                  if s.device.type == "cuda" and d.device.type == "cuda")
        with self._count:
            self.d2d_bytes += local
            if direction == "h2d":
                self.h2d_bytes += nbytes - local
            else:
                self.d2h_bytes += nbytes - local
        if self.cuda:
            stream = self._streams[(lane, direction)]
            with self.timeline.span(stage, layer), torch.cuda.stream(stream):
                for a in afters:  # the copy stream waits on the device (a copy still to be enqueued: this thread waits)
                    if isinstance(a, Transfer):
                        a.wait_stream(stream)
                    elif a.event is not None:
                        stream.wait_event(a.event)
                for dst, src in copies:
                    for d, s in converting_pieces(dst, src):
                        d.copy_(s, non_blocking=True)
                ev = torch.cuda.Event(blocking=True)  # host threads wait on it: sleep, not spin a core
                ev.record(stream)
            if self.serialize:  # this copy only: a device-wide sync from this thread would break another's graph capture
                ev.synchronize()
            return Transfer(event=ev, nbytes=nbytes)
        step = self.timeline.step

        def run() -> None:
            for a in afters:  # a copy in the other direction must finish first (markers are reached)
                if isinstance(a, Transfer):
                    a.wait()
            with self.timeline.span(stage, layer, step=step):
                for dst, src in copies:
                    dst.copy_(src)

        fut = self._threads[(lane, direction)].submit(run)
        if self.serialize:
            fut.result()
        return Transfer(future=fut, nbytes=nbytes)

    def count(self, direction: str, nbytes: int) -> None:
        """Count a crossing issued outside the engine's streams (the step's token ids and targets,
        which the compute stream copies itself: it needs them first)."""
        with self._count:
            if direction == "h2d":
                self.h2d_bytes += nbytes
            else:
                self.d2h_bytes += nbytes

    def sync(self) -> None:
        """In a serialized schedule, wait for the device to finish everything issued so far."""
        if self.serialize and self.cuda:
            torch.cuda.synchronize(self.device)

    def wait_on_compute(self, transfer: Transfer) -> None:
        """Make the compute stream wait for ``transfer`` (the host blocks only on the CPU)."""
        transfer.wait_stream(self.compute_stream)

    def close(self) -> None:
        """Stop the CPU copy threads (CUDA streams need no shutdown)."""
        if not self.cuda:
            for t in self._threads.values():
                t.shutdown(wait=True)
