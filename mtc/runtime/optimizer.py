"""Exact AdamW over the tiers' flat fp32 state, overlapped with the GPU, with global-norm clipping.

Clipping needs the norm of the whole step's gradient, known only when the embed layer's backward
ends. So updates do not run during backward: `finish_step` reads the loss and the global norm (the
one host synchronisation of a step), then hands every layer's update out in forward order, and
returns at once. The next step's forward fetches layer i only once layer i's update is done, so
the update of layer i runs while the GPU computes layers < i: the optimizer is never a serial phase
and clipping stays exact. Per layer, by tier:

- ``gpu``: the Triton AdamW kernel, enqueued on the compute stream (ordered before the next forward).
- ``ram``: the host AdamW on all cores (chunks over a thread pool), writing the new compute copy in
  the same pass; or, for the layers ``gpu_update`` names, on the GPU: state and gradient stream
  over PCIe through pinned buffers on the copy streams, the kernel runs, the state streams back.
  The state does not depend on the gradient, so the first ``prefetch`` of them (in forward order)
  load theirs during the backward, into sets of device buffers of their own: after the norm only
  their kernel and the copy back remain, and the window between the norm and the next forward,
  where every update runs, carries 12 bytes per parameter less of their PCIe traffic.
- ``disk``: master, m, v of the current generation were read ahead, chunk by chunk, into buffer
  sets of the disk ring (`mtc.runtime.disk_tier`, started at `begin_step`, during the forward); the
  gradient's chunk is copied from the compute device into the set (or was read back from the
  store's scratch array it was spilled to), the host updates the chunk, and the new state is
  written behind into the other generation while the next chunks update; a set returns to the
  ring once its writes are durable.

A step whose loss or gradient norm is not finite updates nothing (its batches are consumed and
it counts as a step of the schedule, but not as one of Adam's: bias correction counts the updates
that reached the moments, as torch's AdamW does when a non-finite step skips ``optimizer.step()``);
`StepStats.skipped` says so. Write-behind: on a commit step each layer's new
state is written to the store right after its update, into the generation that the previous
commit made stale, and the commit record follows once every layer is on disk; the next update of
a layer waits for its write. The AdamW math is `mtc.kernels.adamw`'s (one implementation).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from mtc.config import OptimConfig
from mtc.graphs.program import Program
from mtc.runtime.disk_tier import DiskRing
from mtc.runtime.host_adamw import TUNE_MIN_NUMEL, HostStrategy, adamw_flat_, host_pool, tune_strategy
from mtc.runtime.placement import scratch_set, scratch_sets
from mtc.runtime.tiers import DISK_SLOTS, LayerState, StateTiers, state_kinds
from mtc.runtime.timeline import Timeline
from mtc.runtime.transfer import CopyEngine, Marker, Transfer
from mtc.store import TensorStore, state_array_name

if TYPE_CHECKING:
    from mtc.runtime.collectives import DataParallel

__all__ = ["StepStats", "StreamingAdamW"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepStats:
    """What one optimizer step did."""

    loss: float
    lr: float
    grad_norm: float
    clip_coef: float
    skipped: bool


def _done() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f


class StreamingAdamW:
    """AdamW for every layer of ``program``, over the state in ``tiers``."""

    def __init__(
        self,
        program: Program,
        tiers: StateTiers,
        cfg: OptimConfig,
        *,
        engine: CopyEngine,
        timeline: Timeline,
        threads: int = 0,
        host_impl: str = "auto",
        gpu_update: set[int] | None = None,
        store: TensorStore | None = None,
        durability: str = "full",
        disk_slots: int = DISK_SLOTS,
        dp: DataParallel | None = None,
        prefetch: int = 0,
        handoff: bool = True,
    ) -> None:
        self.program, self.tiers, self.cfg = program, tiers, cfg
        # the step Adam's moments started from (0; a resume of a commit without moments: its step),
        # plus the steps skipped before this process started: bias correction counts the updates
        # since then that reached the moments
        self.moments_from = 0
        self._skipped: list[int] = []  # steps skipped in this process, ascending (`note_skipped`)
        self.engine, self.timeline, self.store, self.durability = engine, timeline, store, durability
        self.device = tiers.device
        self.gpu_update = {i for i in (gpu_update or set()) if tiers[i].tier == "ram" and tiers[i].numel}
        if self.gpu_update - tiers.streamed:
            raise ValueError(f"gpu_update layers {sorted(self.gpu_update - tiers.streamed)} were not allocated for it (their "
                             "state must be pinned to stream): build StateTiers with streamed=gpu_update, as mtc.train does")
        # the cores this process may use: a rank of a data-parallel run has its share of the host's
        self.threads = threads if threads > 0 else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                    else os.cpu_count() or 1)
        self.dp = dp  # data parallel: gradients reduced over the ranks, this rank's shards updated
        # one dispatcher per engine keeps updates in forward order; chunks fan out over `_chunks`
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-adamw")
        self._gpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-gpu-adamw")
        # the GPU-side updates' copies back are waited for here, not on `_gpu`: the next step's
        # loads ahead queue on `_gpu` and must not wait on the host for every layer's state to land
        # (each waits on the copy engine for its own set's last copy out: `_prefetch_states`)
        self._landing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-state-back")
        self._landing_error: BaseException | None = None  # a copy back that failed: every later landing fails with it
        self._chunks = host_pool(self.threads)
        # host_impl "auto": torch's fused CPU kernel runs ~2x the exact op-by-op math
        # (bench/bench_adamw.py) and stays within the parity tolerance, but not bit-identical to
        # torch.optim.AdamW: CUDA runs take the faster one, CPU runs keep the bit-exact contract
        if host_impl not in ("auto", "exact", "fused"):
            raise ValueError(f"host_impl must be 'auto', 'exact' or 'fused', got {host_impl!r}")
        self.host_impl = host_impl if host_impl != "auto" else "fused" if self.device.type == "cuda" else "exact"
        # how the host updates use the cores, timed here on this machine where it matters
        biggest = max((s.numel for s in tiers.layers if s.tier in ("ram", "disk") and s.layer not in self.gpu_update), default=0)
        self.host_strategy = (tune_strategy(self.host_impl, self._chunks, self.threads, min(biggest, 1 << 23),
                                            compute_dtype=tiers.compute_dtype)
                              if biggest >= TUNE_MIN_NUMEL else HostStrategy())
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-commit")
        self._norms: dict[int, torch.Tensor] = {}
        self._step: int | None = None
        self._scratch: list[list[torch.Tensor]] = []  # GPU-side update of ram layers: sets of device buffers
        # GPU-updated layers whose state loads during the backward (not in a data-parallel run:
        # its shards' updates wait on the reduction, `mtc.runtime.collectives`)
        self.prefetch = min(max(0, prefetch), len(self.gpu_update)) if dp is None else 0
        self._prefetched: dict[int, tuple[int, Transfer]] = {}  # scratch set -> (layer, its state's copy in)
        # a deferred layer's new weights stay in its set until its next update: the visits copy them
        # from there (`LayerState.device_copy`). Not in fp32, where the weights are the master,
        # which the next backward's load ahead overwrites while that backward still reads them
        self.handoff = handoff and tiers.compute_dtype != torch.float32
        self._prefetch_due = False
        self._prefetching: Future[None] | None = None  # the step's state loads (read by the update: their errors surface)
        self._dropped_error: BaseException | None = None  # a failed load of a skipped step's, raised by the next update or `wait`
        self._opt_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self.gpu_update:  # now, before any compute: see DeviceRing.preallocate for why
            n = max(self.tiers[j].numel for j in self.gpu_update)
            # master, m, v, the compute copy (none in fp32: the master is it), and the gradient only
            # for layers whose gradient is on the host (data parallel: this rank's reduced shard)
            host_grads = any(not self.tiers[j].device_grad for j in self.gpu_update)
            copy = n if self.tiers.compute_dtype != torch.float32 else 0
            self._scratch = [[torch.empty(n, dtype=torch.float32, device=self.device) for _ in range(3)]
                             + [torch.empty(copy, dtype=self.tiers.compute_dtype, device=self.device)]
                             + ([torch.empty(n, dtype=torch.float32, device=self.device)] if host_grads else [])
                             for _ in range(scratch_sets(self.prefetch))]
        self._scratch_free: list[Transfer | None] = [None] * len(self._scratch)  # the last copy out of each scratch set
        if self.device.type == "cuda" and (self.gpu_update or any(s.tier == "gpu" and s.numel for s in tiers.layers)):
            _warm_device_adamw(self.device, self.tiers.compute_dtype)
        self.commit_future: Future[None] = _done()  # the last commit record's write
        # a data-parallel run's disk shards are read from the rank's shard store: `mtc.dist.attach` sets `disk` then
        has_disk = any(s.tier == "disk" and s.numel and s.shard is None for s in tiers.layers)
        if has_disk and store is None:
            raise ValueError("disk-tier layers need the store")
        self.disk = DiskRing(tiers, store, slots=disk_slots, spill=tiers.spill) if has_disk else None

    @property
    def disk_generation(self) -> int:
        """The generation disk-tier layers read this step (holding their newest state)."""
        return self.tiers.disk_generation

    @disk_generation.setter
    def disk_generation(self, gen: int) -> None:
        self.tiers.disk_generation = gen

    # -- the step -------------------------------------------------------------------------------

    def begin_step(self, step: int, lr: float) -> None:
        """Start optimizer step ``step`` (0-based) with learning rate ``lr``."""
        if self._step is not None:
            raise RuntimeError("begin_step called twice without finish_step")
        self._step, self._lr = step, lr
        self._norms.clear()
        self._prefetch_due = self.prefetch > 0
        if self._prefetch_due and self.handoff:
            # the loaded layers' visits copy their weights within the device (the handoff), so the
            # link to the device is free during the forward: load from the step's start (behind the
            # last step's updates on the optimizer's thread, each set after its last copy back)
            self._start_prefetch()
        if self.disk is not None:  # read this step's disk state ahead while forward and backward run
            self.disk.post(self.disk_generation, {i: self.tiers[i].write for i in self.disk.layers})

    def grad_final(self, layer: int, norms: torch.Tensor) -> None:
        """The executor's report: ``layer``'s gradient is complete, with these per-parameter norms."""
        self._norms[layer] = norms
        if self._prefetch_due:  # the backward has begun: the forward's weight copies are done with the link
            self._start_prefetch()
        if self.dp is not None:
            self.dp.grad_final(layer)

    def _start_prefetch(self) -> None:
        """Queue the step's state loads of the first GPU-updated layers on the optimizer's thread:
        behind the last step's updates (which wrote that state back to the host; each load waits
        on the device for its set's last copy out)."""
        self._prefetch_due = False
        first = sorted(self.gpu_update)[: self.prefetch]
        self._prefetching = self._gpu.submit(self._prefetch_states, first)

    def adam_step(self, step: int) -> int:
        """AdamW's step count (from 1) for the update of training step ``step`` (from 0): the updates
        since Adam's moments started (`moments_from`) less the skipped steps, which its bias
        correction counts (a skipped step leaves m and v as they were)."""
        return step + 1 - self.moments_offset(step)

    def moments_offset(self, steps_done: int) -> int:
        """`moments_from` as a commit after ``steps_done`` steps records it: the steps before
        ``steps_done`` that did not update Adam's moments."""
        return self.moments_from + bisect.bisect_left(self._skipped, steps_done)

    def note_skipped(self, step: int) -> None:
        """Training step ``step`` (from 0) was skipped: later updates do not count it (called
        before the step's commit is queued, which records `moments_offset`)."""
        self._skipped.append(step)

    def finish_step(
        self,
        loss: torch.Tensor,
        *,
        commit: Callable[[int], None] | None = None,
        write_generation: int | None = None,
    ) -> StepStats:
        """Read loss and global norm (one sync), start every update, and return without waiting.

        With ``commit`` set this is a commit step: every layer's new state is written into
        ``write_generation`` after its update, then ``commit(write_generation)`` runs on the
        commit thread once all are on disk.
        """
        if self.dp is not None:
            return self.dp.finish_step(self, loss, commit=commit, write_generation=write_generation)
        owners = [i for i in range(self.program.n_layers) if self.tiers[i].numel]
        missing = [i for i in owners if i not in self._norms]
        if missing:
            raise RuntimeError(f"layers {missing} never received final gradients this step")
        # torch.nn.utils.clip_grad_norm_: the norm of the per-tensor norms, coef clamped at 1
        total = torch.linalg.vector_norm(torch.cat([self._norms[i] for i in owners]))
        clip = self.cfg.clip_norm
        coef_dev = torch.clamp(clip / (total + 1e-6), max=1.0) if clip is not None else torch.ones((), device=total.device)
        with self.timeline.span("norm_sync", step=self._step):  # its end: the backward has ended, the updates start
            host = torch.stack([loss.float().to(total.device), total, coef_dev]).cpu()  # the step's one sync
        loss_f, total_f = float(host[0]), float(host[1])
        coef = host[2] if clip is not None else None  # a 0-dim fp32 tensor, as clip_grad_norm_ multiplies by
        self._step, step = None, self._step
        skipped = not (math.isfinite(loss_f) and math.isfinite(total_f))
        if skipped:
            self.note_skipped(step)
        stats = StepStats(loss=loss_f, lr=self._lr, grad_norm=total_f, clip_coef=float(host[2]), skipped=skipped)
        # A skipped step changes no state, but is a step like any other: a commit it was due
        # still writes the (unchanged) state into the next generation and records the step.
        writes: list[Future[None]] = []
        # all of backward precedes this point of the compute stream: a gradient kept on the device is
        # final here (the host read above orders it today; the copies that read one say so themselves)
        grads_final = self.engine.marker()
        prev_commit = self.commit_future
        w_gen = write_generation
        w_disk = self.tiers.disk_write_generation()
        streamed: list[tuple[int, Future[None], dict, tuple]] = []
        for i in range(self.program.n_layers):
            s = self.tiers[i]
            if not s.numel:
                s.update = _done()
                continue
            hp = dict(lr=self._lr, step=self.adam_step(step), decay_numel=s.decay_numel)
            deps = (s.write, s.grad_ready, s.last_read)  # captured now: the fields are reassigned below
            if s.tier == "gpu":
                if not skipped:
                    self._update_on_device(i, coef, hp)
                s.update = _done()
                if commit is not None and state_kinds("gpu", self.durability):
                    if s.write is not None:
                        # the store reads the staging buffers in place until the last commit's write of
                        # this layer ends: refill them only then (a guard: with the commit pacing the
                        # write ended long ago; with a disk slower than a step, training waits here)
                        with self.timeline.span("staging_wait", i), contextlib.suppress(Exception):
                            s.write.result()  # a failed write is reported by its own commit
                    staged = self.engine.d2h(list(zip(self.tiers.staging_for(i), (s.master, s.m, s.v))),
                                             after=self.engine.marker(), layer=i, stage="stage_out", lane="opt")
                    s.staged = staged  # the next device update waits for it (ordered on the compute stream)
                    s.write = self._writer.submit(self._write_staged, i, staged, w_gen, prev_commit, step)
                    writes.append(s.write)
            elif s.tier == "disk":
                s.write = Future()
                s.update = self._cpu.submit(self._update_disk, i, coef, hp, (s.grad_ready, s.last_read), w_disk, prev_commit,
                                            step, skipped, s.write, grads_final)
                writes.append(s.write)
            elif i in self.gpu_update and not skipped:
                s.update, s.state_back, s.device_copy = Future(), Future(), Future()
                streamed.append((i, s.update, hp, deps))
            else:
                s.update = self._cpu.submit(self._update_host, i, coef, hp, deps, prev_commit, step, skipped)
            if s.tier == "ram" and commit is not None and state_kinds("ram", self.durability):
                s.write = self._writer.submit(self._write_after_update, i, s.state_back or s.update, w_gen, prev_commit, step)
                writes.append(s.write)
        # this step's loads ahead, queued on the optimizer's thread before the update that uses them
        # (the next step's begin_step may queue the next loads before that update has run)
        prefetching, self._prefetching = self._prefetching, None
        if streamed:
            # device gradients are final once the compute stream gets here: the GPU-side updates read
            # them on their own stream (ordered by the device, not by the host read above)
            self._gpu.submit(self._update_streamed, streamed, coef, step, after=grads_final, prefetching=prefetching)
        else:
            self._gpu.submit(self._drop_loads, prefetching)
        if any(s.tier == "disk" for s in self.tiers.layers):
            self.disk_generation = w_disk
        if commit is not None:
            self.commit_future = self._writer.submit(self._commit_when_written, writes, commit, w_gen, step)
        if self.engine.serialize:  # the reference schedule: nothing overlaps the next step
            self.wait()
        return stats

    def wait(self) -> None:
        """Block until every update, write and commit started so far has finished (re-raising
        errors), and the host copy of every layer's weights is current (a handed-over layer's
        comes back from its scratch set now: `LayerState.device_copy`)."""
        for s in self.tiers.layers:
            for f in (s.update, s.state_back, s.write):
                if f is not None:
                    f.result()
        self._gpu.submit(self._raise_dropped).result()  # behind everything queued on the optimizer's thread
        self.commit_future.result()
        for s in self.tiers.layers:
            if s.host_compute_stale:
                refresh_host_compute(s)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def settle(self) -> None:
        """Block until every update, write and commit started so far has ended, whatever its outcome
        (a stopped run's close, before its store is released). It waits on the work itself, not on
        the threads: a join that Ctrl-C interrupted marks a thread that still runs as stopped
        (CPython 3.11's `Thread._wait_for_tstate_lock`), and later joins return at once."""
        futs = [f for s in self.tiers.layers for f in (s.update, s.state_back, s.write) if f is not None]
        wait([*futs, self.commit_future])

    # -- updates --------------------------------------------------------------------------------

    def host_adamw(self, param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, **kw: object) -> None:
        """`adamw_flat_` with this run's hyper-parameters, implementation and way over the cores."""
        self.host_strategy.run(param, grad, m, v, pool=self._chunks, threads=self.threads, impl=self.host_impl,
                               **kw, **self._hyper())

    def _hyper(self) -> dict[str, float]:
        c = self.cfg
        return dict(beta1=c.beta1, beta2=c.beta2, eps=c.eps, weight_decay=c.weight_decay)

    def _update_host(self, i: int, coef: torch.Tensor | None, hp: dict, deps: tuple, prev_commit: Future[None], tstep: int,
                     skip: bool = False) -> None:
        s = self.tiers[i]
        _wait_all(self.timeline, i, deps, tstep)  # state on its way to disk, gradient in flight, H2D still reading
        if skip:
            return
        with self.timeline.span("update", i, step=tstep):
            compute_out = None if s.compute is s.master else s.compute
            self.host_adamw(s.master, s.grad, s.m, s.v, grad_scale=coef, compute_out=compute_out, **hp)

    def _update_disk(self, i: int, coef: torch.Tensor | None, hp: dict, deps: tuple, w_gen: int, prev_commit: Future[None],
                     tstep: int, skip: bool, written: Future[None], grads_final: Marker) -> None:
        """Update a disk layer chunk by chunk in its read-ahead sets and start writing each chunk
        behind; ``written`` completes once the whole new state is durable in ``w_gen`` (each set
        goes back to the ring as soon as its chunk is)."""
        s = self.tiers[i]
        assert self.disk is not None

        def update(st: object, lo: int, hi: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
            n = hi - lo
            if s.grad is None:  # spilled: the read-ahead brought it back with the state
                assert st.grad is not None
                grad = st.grad[:n]
            elif s.grad.device.type != "cpu":  # the gradient waited on the GPU: into the set's pinned buffer now
                assert st.grad is not None
                tr = self.engine.d2h([(st.grad[:n], s.grad[lo:hi])], after=grads_final, layer=i, stage="grad_d2h", lane="opt")
                tr.wait()
                grad = st.grad[:n]
            else:
                grad = s.grad[lo:hi]
            if not skip:  # a skipped step only carries the state over into the next generation
                with self.timeline.span("update", i, step=tstep):
                    # AdamW is element-wise: a chunk's result is the whole layer's, bit for bit
                    self.host_adamw(master, grad, m, v, grad_scale=coef,
                                    compute_out=s.compute[lo:hi] if s.compute is not None else None,
                                    **dict(hp, decay_numel=min(max(s.decay_numel - lo, 0), n)))

        update_disk_chunks(self.disk, self.store, i, update, deps=deps, w_gen=w_gen, prev_commit=prev_commit,
                           timeline=self.timeline, tstep=tstep, written=written)

    def _update_on_device(self, i: int, coef: torch.Tensor | None, hp: dict) -> None:
        s = self.tiers[i]
        # a staging copy of the last commit, and a fetch of a tied weight it owns, may still read the
        # state: two fields, since a fetch would overwrite the other's transfer
        for tr in (s.staged, s.last_read):
            if tr is not None:
                self.engine.wait_on_compute(tr)
        s.staged = s.last_read = None
        with self.timeline.span("update_gpu", i):
            _device_adamw(s.master, s.grad, s.m, s.v, coef=coef, compute_out=None if s.compute is s.master else s.compute,
                          **hp, **self._hyper())

    def _prefetch_states(self, layers: list[int]) -> None:
        """Copy master, m and v of ``layers`` (the first GPU-updated ones in forward order) into
        scratch sets 0, 1, ... ahead of the update. On the optimizer's thread, so the last step's
        updates, which write this host state back, have all been issued; each load waits on the
        copy engine for its set's last copy out (that layer's state, or a later one behind it on
        the same stream), not on the host for every layer's: the H200's P1-16 stateless steps
        (2026-11-27) alternated 0.93 and 2.62 s while the loads queued behind the wait for the
        whole 51 GB of the last step's state to land, and so crossed the link after it, not beside it."""
        for j, i in enumerate(layers):
            s = self.tiers[i]
            assert s.master is not None and s.m is not None and s.v is not None
            n = s.numel
            p, m, v = (t[:n] for t in self._scratch[j][:3])
            tr = self.engine.h2d([(p, s.master), (m, s.m), (v, s.v)], after=self._scratch_free[j], layer=i,
                                 stage="opt_prefetch", lane="opt")
            self._prefetched[j] = (i, tr)

    def _drop_loads(self, prefetching: Future[None] | None) -> None:
        """A skipped step: what was loaded ahead is not used (the next step loads it again), but a
        load that failed still fails the run, at the next update or `wait`."""
        self._prefetched.clear()
        if prefetching is not None and prefetching.exception() is not None:  # done: it ran before, on this thread
            self._dropped_error = self._dropped_error or prefetching.exception()

    def _raise_dropped(self) -> None:
        """Raise (once) the error of a skipped step's failed loads ahead (`_drop_loads`)."""
        e, self._dropped_error = self._dropped_error, None
        if e is not None:
            raise e

    def _update_streamed(self, jobs: list[tuple[int, Future[None], dict, tuple]], coef: torch.Tensor | None, tstep: int,
                         views: dict[int, tuple[torch.Tensor, ...]] | None = None, after: Marker | None = None,
                         prefetching: Future[None] | None = None) -> None:
        """Ram layers updated on the GPU, pipelined over the scratch sets: layer j's state crosses
        PCIe in while layer j-1's kernel runs and its state crosses back (each direction on its
        own stream); a layer's future completes once its state is back in host memory.

        A layer whose state was loaded ahead and whose set no later layer of the step reuses
        sends its new weights (the compute copy; the master in fp32) back first, and completes
        its future (`LayerState.update`: what the next forward's fetch waits for) with them; the
        rest of its state (`LayerState.state_back`) follows after every layer's weights, so the
        next forward waits on 2 bytes per parameter, not 14, and the other 12 cross while it
        and the next backward run (the next step's load of the layer waits for them). With
        ``handoff`` (compute dtype not fp32) such a layer's weights do not cross back at all: its
        `LayerState.device_copy` names them in the set, every visit until its next update copies
        them from there within the device once the kernel is done, its future completes with the
        kernel, and its host copy is refreshed only where read (`wait`, `TierWeights`). The H200's
        P1-16 stateless step (2026-11-27) waited 1.08 s in its forward for the weights to cross
        back, and its visits sent them over again: 18 of the step's 75 GB to the device, and
        8.6 of its 61 GB back, queued ahead of the state the next step loads.

        ``views``: per layer, the (master, m, v, grad, compute) host tensors to update instead of
        the layer's own (data parallel: this rank's shard; compute may be master itself).
        ``after``: where the compute stream stood when the gradients were final. ``prefetching``:
        this step's loads ahead (`_prefetch_states`), queued on this thread before this update.

        This thread only issues: the copies back are waited for on `_landing` (`_land`, in the
        order issued), which completes the futures, so the next step's loads ahead can be issued
        at once, and a layer's future does not wait for the issue of a later layer (which may
        wait for its own last write behind)."""
        deferred: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]], Marker | None, int]] = []
        backs: list[tuple[str, int, Future[None], Transfer]] = []  # (span, layer, state_back future, the copy it completes with)
        if self._opt_stream is not None and after is not None and after.event is not None:
            self._opt_stream.wait_event(after.event)
        try:
            self._raise_dropped()
            if prefetching is not None:  # done (the same thread ran it first): raise what it raised
                prefetching.result()
            sets = len(self._scratch)
            reused = {scratch_set(j, len(jobs), sets) for j in range(sets, len(jobs))}
            loaded, self._prefetched = self._prefetched, {}
            for j, (i, fut, hp, deps) in enumerate(jobs):
                s = self.tiers[i]
                hm, hmo, hv, hg, hc = views[i] if views is not None else (s.master, s.m, s.v, s.grad, s.compute)
                n = hm.numel()
                _wait_all(self.timeline, i, deps, tstep)
                with self.timeline.span("update_streamed", i, step=tstep):
                    k = scratch_set(j, len(jobs), sets)
                    p, m, v, c, *g = (t[:n] for t in self._scratch[k])
                    cast = hc is not hm
                    ahead = loaded.get(k) if views is None and j < sets else None
                    ahead_tr = ahead[1] if ahead is not None and ahead[0] == i else None
                    ins = [] if ahead_tr is not None else [(p, hm), (m, hmo), (v, hv)]
                    if views is None and s.device_grad:  # the gradient is on the device already
                        g = hg
                    else:
                        g = g[0]
                        ins.append((g, hg))
                    tr_in = (self.engine.h2d(ins, after=[t for t in (self._scratch_free[k], ahead_tr) if t is not None],
                                             layer=i, stage="opt_h2d", lane="opt") if ins else ahead_tr)
                    if self._opt_stream is not None:
                        self._opt_stream.wait_event(tr_in.event)
                        with torch.cuda.stream(self._opt_stream):
                            _device_adamw(p, g, m, v, coef=coef, compute_out=c if cast else None, **hp, **self._hyper())
                            ev = torch.cuda.Event(blocking=True)
                            ev.record(self._opt_stream)
                        after: Marker | None = Marker(ev)
                    else:
                        tr_in.wait()
                        _device_adamw(p, g, m, v, coef=coef, compute_out=c if cast else None, **hp, **self._hyper())
                        after = None
                    weights = [(hc, c)] if cast else [(hm, p)]
                    state = ([(hm, p)] if cast else []) + [(hmo, m), (hv, v)]
                    back_fut = s.state_back if views is None else None
                    # (the rule `mtc.runtime.placement.deferred_layers` plans with)
                    handed = False
                    if ahead_tr is not None and k not in reused and back_fut is not None:
                        handed = self.handoff and cast and s.device_copy is not None
                        if handed:
                            # the visits read the weights here until the layer's next update: they do
                            # not cross back (the host copy is refreshed when read: `wait`, TierWeights)
                            s.device_copy.set_result((c, after if after is not None else Marker(None)))
                            s.host_compute_stale = True
                        else:
                            tr_out = self.engine.d2h(weights, after=after, layer=i, stage="opt_d2h_weights", lane="opt")
                            s.host_compute_stale = False
                        deferred.append((i, state, after, k))
                    else:
                        tr_out = self.engine.d2h(state + weights, after=after, layer=i, stage="opt_d2h", lane="opt")
                        self._scratch_free[k] = tr_out
                        if back_fut is not None:
                            backs.append(("state_back", i, back_fut, tr_out))
                            s.host_compute_stale = False  # (read only once the update's future says the copy landed)
                if views is None and s.device_copy is not None and not s.device_copy.done():
                    s.device_copy.set_result(None)  # its set is reused (or no handoff): from the host copy
                if handed:  # done as far as the visits go; its state follows with the other deferred layers'
                    fut.set_result(None)
                    continue
                self._landing.submit(self._land, "streamed_back", i, fut, tr_out, tstep)
            # the deferred layers' master, m and v: behind every layer's weights on the copy stream
            for i, state, kernel_done, k in deferred:
                tr = self.engine.d2h(state, after=kernel_done, layer=i, stage="opt_d2h", lane="opt")
                self._scratch_free[k] = tr
                backs.append(("state_back", i, self.tiers[i].state_back, tr))
        except BaseException as e:
            for i, fut, _, _ in jobs:
                for f in (fut, *((self.tiers[i].state_back, self.tiers[i].device_copy) if views is None else ())):
                    if f is not None:
                        _settle(f, e)  # (a landing may have completed it meanwhile)
            raise
        # master, m and v, behind every layer's weights: then this thread is free for the next step's loads ahead
        for span, i, done, tr in backs:
            self._landing.submit(self._land, span, i, done, tr, tstep)

    def _land(self, span: str, layer: int, done: Future[None], tr: Transfer, tstep: int) -> None:
        """Complete ``done`` once ``tr``, a copy back, is in host memory (the span's end is when):
        first each layer's new weights (``streamed_back``: what the next forward of a layer not
        handed over waits for), then master, m and v (``state_back``). After a failed copy, every
        later landing fails with its error."""
        err = self._landing_error
        if err is None:
            try:
                with self.timeline.span(span, layer, step=tstep):
                    tr.wait()
            except BaseException as e:
                self._landing_error = err = e
        _settle(done, err)

    # -- write-behind and commits ---------------------------------------------------------------

    def _write_after_update(self, i: int, update: Future[None], gen: int, prev_commit: Future[None], tstep: int) -> None:
        update.result()
        prev_commit.result()
        with self.timeline.span("write_behind", i, step=tstep):
            for f in self.tiers.write_arrays(self.store, i, gen, self.durability):
                f.result()

    def _write_staged(self, i: int, staged: object, gen: int, prev_commit: Future[None], tstep: int) -> None:
        staged.wait()
        prev_commit.result()
        with self.timeline.span("write_behind", i, step=tstep):
            for f in self.tiers.write_arrays(self.store, i, gen, self.durability):
                f.result()

    def _commit_when_written(self, writes: list[Future[None]], commit: Callable[[int], None], gen: int, tstep: int) -> None:
        for f in writes:
            f.result()
        with self.timeline.span("commit", step=tstep):
            commit(gen)

    def close(self) -> None:
        """Stop the worker threads (after finishing what was started)."""
        for pool in (self._cpu, self._gpu, self._landing, self._writer, self._chunks):
            pool.shutdown(wait=True)
        if self.dp is not None:
            self.dp.close()
        if self.disk is not None:
            self.disk.close()
        if self.tiers.spill is not None:
            self.tiers.spill.close()


def _settle(fut: Future[None], error: BaseException | None) -> None:
    """Complete ``fut`` with ``error`` (or its result), unless another thread completed it first."""
    with contextlib.suppress(InvalidStateError):
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)


def handed_weights(s: LayerState) -> torch.Tensor | None:
    """``s``'s current compute-dtype weights in its GPU scratch set, once the update that wrote
    them has run (the reader's stream waits for it), or None when its host copy is current. Valid
    until the layer's next update: copy what must outlive it."""
    if not s.host_compute_stale or s.device_copy is None:
        return None
    handed = s.device_copy.result()
    if handed is None:
        return None
    c, marker = handed
    if marker.event is not None:
        torch.cuda.current_stream(c.device).wait_event(marker.event)
    return c


def refresh_host_compute(s: LayerState) -> None:
    """Bring a handed-over layer's weights back into its host copy (blocking)."""
    c = handed_weights(s)
    if c is not None:
        s.compute.copy_(c)
        if c.device.type == "cuda":
            torch.cuda.current_stream(c.device).synchronize()
    s.host_compute_stale = False


def _when_all(futs: list[Future[None]], then: Callable[[BaseException | None], None]) -> None:
    """Call ``then(first error or None)`` once every future in ``futs`` is done."""
    left = [len(futs)]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def one(f: Future[None]) -> None:
        with lock:
            if f.exception() is not None:
                errors.append(f.exception())
            left[0] -= 1
            last = left[0] == 0
        if last:
            then(errors[0] if errors else None)

    for f in futs:
        f.add_done_callback(one)


def update_disk_chunks(ring: DiskRing, store: TensorStore, i: int,
                       update: Callable[[object, int, int, torch.Tensor, torch.Tensor, torch.Tensor], None], *, deps: tuple,
                       w_gen: int, prev_commit: Future[None], timeline: Timeline, tstep: int, written: Future[None]) -> None:
    """Disk layer ``i``'s update, chunk by chunk in the read-ahead sets of ``ring`` (one process's
    whole layer, or a data-parallel rank's shard: `mtc.runtime.dp_disk`): once ``deps`` are done,
    each chunk's rows ``[lo, hi)`` are read, ``update(set, lo, hi, master, m, v)`` updates them in
    place, and they are written behind into generation ``w_gen`` of ``store`` (after the last
    commit, ``prev_commit``, has landed: it may name only the other generation); each set goes
    back to the ring once its chunk is written, and ``written`` completes once the whole new state
    is durable (or with the first error)."""
    try:
        chunks: list[Future | None] = list(ring.take(i))
    except BaseException as e:
        written.set_exception(e)
        raise
    left = [len(chunks)]
    lock = threading.Lock()
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def chunk_done(st: object | None, error: BaseException | None) -> None:
        with lock:
            if error is not None:
                errors.append(error)
            left[0] -= 1
            last = left[0] == 0
        if st is not None:
            ring.release(st)
        if last:
            timeline.add("write_behind", i, t0, time.perf_counter(), step=tstep)
            if errors:
                written.set_exception(errors[0])
            else:
                written.set_result(None)

    try:
        _wait_all(timeline, i, deps, tstep)  # the last H2D read of its compute copy
        for k, cf in enumerate(chunks):
            with timeline.span("disk_read_wait", i, step=tstep):
                st, lo, hi, reads = cf.result()
                for f in reads:
                    f.result()
            master, m, v = st.views(hi - lo)
            update(st, lo, hi, master, m, v)
            prev_commit.result()  # never overwrite the generation the last durable commit names
            futs = [store.write_rows_async(state_array_name(i, kind, w_gen), lo, t, in_place=True)  # no commit names w_gen
                    for kind, t in zip(("master", "m", "v"), (master, m, v), strict=True)]
            _when_all(futs, lambda err, st=st: chunk_done(st, err))
            chunks[k] = None  # taken: an error from here on must not count it twice
    except BaseException as e:
        for cf in chunks:  # the chunks not reached: their sets go back once their reads end
            if cf is not None:
                cf.add_done_callback(lambda f: _release_after_reads(ring, f))
                chunk_done(None, e)
        raise


def _release_after_reads(ring: DiskRing, chunk: Future) -> None:
    """A chunk the update never reached: its set goes back to the ring once its reads are done."""
    if chunk.exception() is not None:
        return  # the read-ahead gave its set back itself
    st, _lo, _hi, reads = chunk.result()
    _when_all(reads, lambda _err: ring.release(st))


def _wait_all(timeline: Timeline, layer: int, deps: tuple, step: int) -> None:
    with timeline.span("update_wait", layer, step=step):
        for dep in deps:
            if isinstance(dep, Future):
                dep.result()
            elif dep is not None:
                dep.wait()


def _warm_device_adamw(device: torch.device, compute_dtype: torch.dtype) -> None:
    """Compile the Triton AdamW's variants (with and without the compute copy) now, at start-up:
    otherwise the first step compiles them, on the training thread (gpu tier) and on the
    GPU-update thread (streamed ram layers) at once. Sizes divisible by 16, as layers' are, so
    the specialisation is the one they launch."""
    n = 4096
    p, g, m, v = (torch.zeros(n, dtype=torch.float32, device=device) for _ in range(4))
    copies = [None] + ([torch.empty(n, dtype=compute_dtype, device=device)] if compute_dtype != torch.float32 else [])
    for c in copies:
        _device_adamw(p, g, m, v, coef=None, compute_out=c, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                      step=1, decay_numel=n // 2)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_adamw(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  coef: torch.Tensor | None, compute_out: torch.Tensor | None, **hp: float) -> None:
    """The fused Triton AdamW (CUDA, or the interpreter on the CPU); the host math otherwise."""
    if param.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        adamw_flat_(param, grad, exp_avg, exp_avg_sq, grad_scale=coef, compute_out=compute_out, pool=None, **hp)
        return
    from mtc.kernels.adamw import adamw_step_

    # Triton's interpreter casts to bf16 wrongly (NOTES.md): on the CPU the copy is made by torch
    in_kernel = compute_out if param.device.type == "cuda" else None
    # the clip coefficient is already on the host (read with the norm): pass its fp32 value
    adamw_step_(param, grad, exp_avg, exp_avg_sq, grad_scale=float(coef) if coef is not None else 1.0,
                compute_copy=in_kernel, **hp)
    if compute_out is not None and in_kernel is None:
        compute_out.copy_(param)
