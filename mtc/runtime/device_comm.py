"""Collectives on device tensors for data parallelism: a comm stream, its events, the probes.

On CUDA the comm thread (`mtc.runtime.collectives`) issues every device collective of a rank on
one NCCL group while one CUDA stream of its own, the comm stream, is current: NCCL's internal
stream first waits for the comm stream, and a synchronous NCCL call (``async_op=False``) makes the
comm stream wait for NCCL's work, without blocking the host. So whatever the comm thread enqueues
on the comm stream (the shard's copy to the host, its squared norm, the next layer's collective)
runs after the collective, and one set of scratch buffers per direction is reused safely from
layer to layer. What the comm stream needs from the compute stream (a gradient slab is final, a
gpu layer's update is done) it waits for with an event (`Marker`); what others need from it
(the slab may be reused, the shard is on the host, the compute copy is gathered) they wait for
with a `CommTransfer`, whose event the comm thread records once it has enqueued the work.

On the CPU device the very same code runs with gloo on CPU tensors: there are no streams or
events, the calls block the comm thread until done, and a `CommTransfer` completes with them.

Needs a GPU to verify: the stream and event ordering (NCCL with the comm stream current), the
comm thread's device binding, and that nothing here synchronises the training thread with the GPU
(tests/mtc/test_dp_device.py::test_nccl_device_path_world_one_under_torchrun is marked gpu).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from mtc.runtime.transfer import Marker, Transfer

__all__ = ["CommTransfer", "DeviceComm", "tensor_collectives"]



# torch 2.13 renamed the flat-tensor collectives (*_single); the old names remain, deprecated
_NAMES = (("reduce_scatter_single", "reduce_scatter_tensor"), ("all_gather_single", "all_gather_into_tensor"))


def tensor_collectives(dist: object, *, probe_group: object = None) -> tuple[Callable | None, Callable | None]:
    """torch's flat-tensor (reduce-scatter, all-gather), each None where this torch lacks it or,
    with ``probe_group``, where a one-element call on that group fails: gloo builds without them
    raise "not supported" (RuntimeError / NotImplementedError), and the caller then uses
    all-reduce / a list all-gather. The probe is itself a collective: every rank calls it alike."""
    fns = [next((getattr(dist, a) for a in pair if hasattr(dist, a)), None) for pair in _NAMES]
    if probe_group is None:
        return fns[0], fns[1]
    n, found = dist.get_world_size(probe_group), []
    for fn, out, inp in ((fns[0], torch.empty(1), torch.zeros(n)), (fns[1], torch.empty(n), torch.zeros(1))):
        try:
            if fn is not None:
                fn(out, inp, group=probe_group)
        except (RuntimeError, NotImplementedError):  # a backend without it: the caller's fallback runs
            fn = None
        found.append(fn)
    return found[0], found[1]

class CommTransfer(Transfer):
    """Work the comm thread will enqueue: ``future`` resolves to the CUDA event recorded after it
    (None on the CPU, where the future completes when the work has finished)."""

    __slots__ = ()

    def __init__(self, future: Future[torch.cuda.Event | None]) -> None:
        super().__init__(future=future)

    def done(self) -> bool:
        """Whether the work has finished (non-blocking)."""
        if not self.future.done():
            return False
        ev = self.future.result()
        return ev is None or ev.query()

    def wait(self) -> None:
        """Block this host thread until the work has finished."""
        ev = self.future.result()
        if ev is not None:
            ev.synchronize()

    def wait_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Make ``stream`` wait for the work (the host waits only until it is enqueued); CPU: block."""
        ev = self.future.result()
        if ev is not None and stream is not None:
            stream.wait_event(ev)
        elif ev is not None:
            ev.synchronize()


class DeviceComm:
    """One rank's device collectives on ``group`` (NCCL on CUDA, gloo on the CPU device), issued
    by one thread (the comm thread) on its own stream."""

    def __init__(self, dist: object, group: object, device: torch.device, world_size: int) -> None:
        self.dist, self.group, self.device, self.world_size = dist, group, device, world_size
        self.cuda = device.type == "cuda"
        # "cuda" names no index: the rank's GPU is the constructing (training) thread's current
        # device (`mtc.dist.init_world` set it to LOCAL_RANK); a new thread's would be GPU 0
        self.index = (device.index if device.index is not None else torch.cuda.current_device()) if self.cuda else None
        self.stream = torch.cuda.Stream(self.index) if self.cuda else None
        self.nccl = dist.get_backend(group) == "nccl"
        self._scatter, self._gather = self._probe()

    def _probe(self) -> tuple[Callable | None, Callable | None]:
        """reduce_scatter_tensor / all_gather_into_tensor where the backend has them (NCCL does;
        gloo in recent torch), else None: all-reduce / all-gather of a list instead."""
        if self.nccl:
            return tensor_collectives(self.dist)
        return tensor_collectives(self.dist, probe_group=self.group)

    def bind_thread(self) -> None:
        """Make this (the comm) thread's current CUDA device the rank's: the CUDA runtime keeps
        it per thread, and NCCL and the comm stream must run on the rank's GPU."""
        if self.cuda:
            torch.cuda.set_device(self.index)

    @contextlib.contextmanager
    def on_stream(self, after: Marker | None = None) -> Iterator[None]:
        """Enqueue on the comm stream, after ``after`` (an event of the compute stream)."""
        if self.stream is None:
            yield
            return
        if after is not None and after.event is not None:
            self.stream.wait_event(after.event)
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event after everything enqueued on the comm stream so far (None on the CPU)."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event(blocking=True)
        ev.record(self.stream)
        return ev

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        """``out`` (one shard) = this rank's shard of the sum over the ranks of ``inp`` (world shards)."""
        from mtc.runtime.collectives import collective

        if self._scatter is not None:
            collective(what, self._scatter, out, inp, group=self.group)
            return
        collective(what, self.dist.all_reduce, inp, group=self.group)
        per = out.numel()
        rank = self.dist.get_rank(self.group)
        out.copy_(inp[rank * per : (rank + 1) * per])

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        """``out`` (world shards) = every rank's ``inp`` (one shard), in rank order."""
        from mtc.runtime.collectives import collective

        if self._gather is not None:
            collective(what, self._gather, out, inp, group=self.group)
            return
        per = inp.numel()
        collective(what, self.dist.all_gather, [out[r * per : (r + 1) * per] for r in range(self.world_size)], inp,
                   group=self.group)

    def synchronize(self) -> None:
        """Wait until the comm stream has finished everything (end of the run)."""
        if self.stream is not None:
            self.stream.synchronize()
