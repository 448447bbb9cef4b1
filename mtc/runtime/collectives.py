"""Data parallelism over the streaming engine: gradient reduction, sharded AdamW, all-gather, commits.

Every rank streams the same layers over its own micro-batches (`mtc.train` splits the step's
global batch contiguously by rank). Each layer's flat fp32 state of ``n`` elements is split into
``world`` contiguous shards of ``S = ceil(n / world)`` (the last ones shorter, possibly empty):
rank ``r`` owns ``[r*S, min((r+1)*S, n))`` of the master weights, Adam's m and v, and updates only
that range. Two paths move the gradients and weights (config field ``dp_collectives``,
`mtc.dist.device_collectives`):

- device (CUDA with NCCL by default; gloo on the CPU device when forced, so the CPU tests run this
  very code): the executor hands each layer's final summed gradient (its slab, or a gpu layer's
  own buffer) to `reduce_on_device`; the comm thread reduce-scatters it on the comm stream
  (`mtc.runtime.device_comm`) into a device shard, takes the shard's squared norm there and, for
  a ``ram`` layer, copies only the shard (1/N) to the host. The slab goes back to the executor's
  ring once the collective has read it. ``gpu`` layers keep their shard of master, m, v on the
  device and are updated there (the device AdamW), ``ram`` layers on the host; then the updated
  compute-dtype shards are all-gathered on the device: into the gpu layer's resident compute copy,
  or, for a ram layer, into the host compute copy the next fetch reads (see `_init_device` for
  why there and the PCIe bytes). ``gpu_update`` (ram layers updated on the GPU) is not sharded.
- host (``dp_collectives host``; ram tier only): the gradient's copy to its host buffer, then gloo
  reduce-scatters it in host memory on the comm thread and all-gathers the updated shards there.

Per layer and step, either way:

1. backward: once the layer's gradient is final, the comm thread reduce-scatters it over the
   ranks, so each rank receives the sum of its shard only (gloo gained reduce-scatter in recent
   torch; where it is missing, an all-reduce, each rank reading its shard), and takes the
   squared norm of that shard. The layer loop does not wait for it.
2. `finish_step`: one all-reduce of [loss share, sum of squared shard norms] on the training thread
   gives the step's loss and the exact global gradient norm, so clipping is the single-process
   clipping (up to the reduction order).
3. the update of this rank's shard writes its compute-dtype copy, and the comm thread all-gathers
   the shards into every rank's full compute copy; the layer's next fetch waits for that
   (`LayerState.update`, and for a resident gpu layer `LayerState.gathered`).
4. on a commit step the commit thread writes the layer's updated master, m and v shards (a gpu
   layer's through pinned staging) into this rank's own shard store (its stale generation, once
   the last global commit has landed); once every layer is written it runs the global commit
   protocol of `mtc.shards` (per-rank record, agreement of all ranks, rank 0's global record,
   barrier).

Store layout: one shard store per rank (``RUN/ranks/rank-R-of-N/``) and one global commit record in
the run directory, which names each shard's digest (see `mtc.shards`): commit I/O is spread over
the ranks, nothing is gathered to rank 0, a missing or stale shard is refused on resume, and
``mtc reshard`` rewrites the state for another world size (the stored arrays are the same for a
gpu or a ram layer). A ``disk`` layer's shard is read from and written to the rank's shard store
each step (`mtc.runtime.dp_disk`); its gradient is reduced like a ram layer's, on either path, and
its weights are all-gathered in host memory (gloo) on either path.

All collectives of the comm thread are enqueued by the training thread in a fixed order (the
executor's finalisation order, then `finish_step`'s forward order), so every rank issues the same
sequence on one group (``comm`` on the host path, ``device`` on the device path); the training
thread's own collectives use a separate group (`mtc.dist`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from mtc.errors import MTCError
from mtc.runtime.device_comm import CommTransfer, DeviceComm, tensor_collectives
from mtc.runtime.optimizer import StepStats, _device_adamw, _done, _wait_all, _when_all
from mtc.runtime.pinned import host_buffer
from mtc.runtime.tiers import state_kinds
from mtc.store import state_array_name

if TYPE_CHECKING:
    from mtc.runtime.dp_disk import DiskShards
    from mtc.runtime.optimizer import StreamingAdamW
    from mtc.runtime.tiers import StateTiers
    from mtc.runtime.transfer import CopyEngine, Marker, Transfer
    from mtc.store import TensorStore

__all__ = ["DataParallel", "PeerLostError", "collective", "shard_range"]


class PeerLostError(MTCError):
    """A collective failed: another rank died, hung past the timeout, or left the run."""


def collective(what: str, fn: Callable, *args: object, **kw: object) -> object:
    """Run the torch.distributed call ``fn``; a failure (gloo and NCCL report a dead or hung peer
    as a RuntimeError) becomes one `PeerLostError` line that says how to go on."""
    try:
        return fn(*args, **kw)
    except RuntimeError as e:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else "?"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise PeerLostError(f"rank {rank}: {what} failed ({first}): another rank stopped or did not answer within "
                            "dist_timeout_s; this rank stops too. Relaunch the same command on every rank to resume "
                            "from the last commit") from e


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """``(lo, hi, padded)``: rank ``rank``'s contiguous range of a ``numel``-element flat state and
    the padded shard size ``ceil(numel / world_size)`` every rank allocates."""
    per = -(-numel // world_size)
    return min(rank * per, numel), min((rank + 1) * per, numel), per


class DataParallel:
    """The collectives of one rank: the comm thread, gradient reductions, sharded updates.

    ``device_group`` set: the device path (`mtc.runtime.device_comm`); else the host path."""

    def __init__(self, tiers: StateTiers, *, rank: int, world_size: int, sync_group: object, comm_group: object,
                 device_group: object = None, copies: CopyEngine | None = None) -> None:
        import torch.distributed as dist

        self.dist, self.tiers, self.rank, self.world_size = dist, tiers, rank, world_size
        self.sync_group, self.comm_group = sync_group, comm_group
        self.copies = copies
        allowed = ("ram", "disk", "gpu") if device_group is not None else ("ram", "disk")
        for s in tiers.layers:
            if s.numel and s.tier not in allowed:
                raise ValueError(f"data parallel runs shard the {', '.join(allowed)} tiers here, layer {s.layer} is {s.tier!r}")
        self.disk: DiskShards | None = None  # the disk layers' shards (mtc.runtime.dp_disk), set by mtc.dist.attach
        self.dev = DeviceComm(dist, device_group, tiers.device, world_size) if device_group is not None else None
        self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-comm",
                                        initializer=self.dev.bind_thread if self.dev is not None else None)
        self._reduced: dict[int, Future[float]] = {}  # layer -> its reduction (squared norm of this rank's shard)
        # bf16 compute: the update writes this rank's compute-dtype shard here, then it is all-gathered
        self._out: dict[int, torch.Tensor] = {}
        self.shard_store: TensorStore | None = None  # this rank's shard store (mtc.shards), set by mtc.dist.attach
        self._gshard: dict[int, torch.Tensor] = {}
        if self.dev is not None:
            self._init_device()
            return
        self._scatter = tensor_collectives(dist, probe_group=comm_group)[0]  # None: all-reduce instead
        # reduce-scatter needs world equal parts: the gradient buffer is padded to world * shard
        # size (the executor sees its first numel elements), and this rank's summed shard lands in
        # a buffer of its own
        self._gpad: dict[int, torch.Tensor] = {}
        for s in tiers.layers:
            if not s.numel:
                continue
            per = -(-s.numel // world_size)  # (a disk layer has no master in RAM)
            pad = host_buffer(per * world_size, torch.float32, pinned=s.grad.is_pinned())
            s.grad = pad[: s.numel]
            self._gpad[s.layer], self._gshard[s.layer] = pad, torch.zeros(per, dtype=torch.float32)

    def _init_device(self) -> None:
        """The device path's buffers, allocated now, before any compute (as `DeviceRing.preallocate`
        says why), and never freed during the run.

        PCIe per rank and step, for a ram layer of n parameters, shard s = n / N, compute dtype of
        c bytes: the gradient shard down (4 s) instead of the whole gradient (4 n); the updated
        compute-dtype shard up (c s) and the gathered layer down (c n) into the host compute copy,
        from which the next step's two visits fetch it (2 c n up, as on one GPU). The gathered
        layer is landed in the host copy, not straight into the weight ring slot of the next
        fetch: a slot is held only for a visit, so gathering there would mean an all-gather per
        visit (forward and backward, tied weights of other owners) issued by the fetch thread,
        and a host that keeps only shards of the compute copy; that saves the c n down and 2 c n
        (N-1)/N up but is not built (`mtc.dist_plan` models what is). bf16 at N = 8: 4 n down and
        4 n up on the host path become 2.5 n down and 4.25 n up; the reduction itself moves off
        the host (gloo, the host path's bottleneck) onto NCCL.
        """
        dev, W, cdt = self.tiers.device, self.world_size, self.tiers.compute_dtype
        pin = dev.type == "cuda"
        # ram and (data-parallel) disk layers: only the gradient shard comes to the host
        ram = [s for s in self.tiers.layers if s.numel and s.tier in ("ram", "disk")]
        self._gdev: dict[int, torch.Tensor] = {}  # gpu layers: the reduce-scatter's output, resident
        self._cdev: dict[int, torch.Tensor] = {}  # gpu layers in bf16: the updated shard's compute copy
        for s in self.tiers.layers:
            if not s.numel:
                continue
            per = -(-s.numel // W)  # (a disk layer has no master in RAM)
            if s.tier in ("ram", "disk"):
                s.grad = None  # only the shard comes to the host
                self._gshard[s.layer] = host_buffer(per, torch.float32, pinned=pin)
            else:
                self._gdev[s.layer] = torch.zeros(per, dtype=torch.float32, device=dev)
                if cdt != s.master.dtype:
                    self._cdev[s.layer] = torch.zeros(per, dtype=cdt, device=dev)
        # ram layers pass through one scratch set on the device: all its users are ordered on the comm stream
        big = max((-(-s.numel // W) for s in ram), default=1)
        self._scr_g = torch.zeros(big, dtype=torch.float32, device=dev)
        self._scr_c = torch.zeros(big, dtype=cdt, device=dev)
        self._scr_full = torch.zeros(big * W, dtype=cdt, device=dev)
        self._sq = torch.zeros(max(1, self.tiers.program.n_layers), dtype=torch.float32, device=dev)
        # gpu layers: pinned host copies of the shard for commits (two sets), the set used last, each set's last write
        self._staging: dict[int, list[list[torch.Tensor]]] = {}
        self._stage_next: dict[int, int] = {}
        self._stage_write: dict[tuple[int, int], Future[None]] = {}

    # -- the training thread's collectives -----------------------------------------------------

    def reduce_count(self, count: torch.Tensor) -> torch.Tensor:
        """The global number of target tokens of the step, from this rank's ``count``."""
        t = count.detach().to("cpu", torch.float64).reshape(1).clone()
        collective("the target-count all-reduce", self.dist.all_reduce, t, group=self.sync_group)
        return t.to(count.device, torch.float32).reshape(())

    # -- backward ------------------------------------------------------------------------------

    def grad_final(self, layer: int) -> None:
        """``layer``'s local gradient is final (its copy to the host buffer may still be in flight):
        reduce it over the ranks on the comm thread (the host path; the device path's executor
        hook, `reduce_on_device`, has already handed it over)."""
        if self.dev is not None:
            return
        s = self.tiers[layer]
        self._reduced[layer] = self._comm.submit(self._reduce, layer, s.grad_ready)

    def reduce_on_device(self, layer: int, acc: torch.Tensor) -> Transfer:
        """The executor's hook (training thread): ``layer``'s summed gradient ``acc`` (a slab, or
        a gpu layer's own buffer, on the device) is final on the compute stream. Returns what its
        next user waits for: the reduce-scatter has read it (and, for a ram layer, the shard is
        in host memory). Nothing here waits for the device."""
        s = self.tiers[layer]
        per = -(-s.numel // self.world_size)
        # both buffers are allocated with room for world equal shards (the executor's slabs, the
        # tiers' gpu gradients): the padding lands in the last shards' unused tail
        assert acc.untyped_storage().nbytes() >= (acc.storage_offset() + per * self.world_size) * acc.element_size()
        padded = acc.as_strided((per * self.world_size,), (1,), acc.storage_offset())
        if per * self.world_size > s.numel:  # whatever an earlier layer left there: zeros keep the sum finite
            padded[s.numel :].zero_()
        fut: Future[torch.cuda.Event | None] = Future()
        self._comm.submit(self._reduce_device, layer, padded, self.copies.marker(), fut)
        tr = CommTransfer(fut)
        self._reduced[layer] = tr
        return tr

    def _reduce_device(self, layer: int, padded: torch.Tensor, after: Marker, fut: Future) -> None:
        """Comm thread: reduce-scatter on the comm stream, the shard's squared norm on the device,
        and (ram) the shard's copy into its pinned host buffer; ``fut`` gets the event after them."""
        try:
            s = self.tiers[layer]
            per = -(-s.numel // self.world_size)
            k = s.shard[1] - s.shard[0]
            out = self._gdev[layer] if s.tier == "gpu" else self._scr_g[:per]
            with self.dev.on_stream(after):
                self.dev.reduce_scatter(out, padded, f"layer {layer}'s gradient reduce-scatter")
                self._sq[layer] = torch.dot(out[:k], out[:k])
                if s.tier in ("ram", "disk"):
                    self._gshard[layer].copy_(out, non_blocking=True)
                fut.set_result(self.dev.record())
        except BaseException as e:
            fut.set_exception(e)
            raise

    def _reduce(self, layer: int, ready: object) -> float:
        s = self.tiers[layer]
        if ready is not None:
            ready.wait()
        lo, hi = s.shard
        out = self._gshard[layer]
        if self._scatter is not None:
            collective(f"layer {layer}'s gradient reduce-scatter", self._scatter, out, self._gpad[layer], group=self.comm_group)
        else:
            collective(f"layer {layer}'s gradient all-reduce", self.dist.all_reduce, s.grad, group=self.comm_group)
            out[: hi - lo].copy_(s.grad[lo:hi])
        g = out[: hi - lo]
        return float(torch.dot(g, g)) if g.numel() else 0.0

    # -- the step ------------------------------------------------------------------------------

    def finish_step(self, opt: StreamingAdamW, loss: torch.Tensor, *, commit: Callable[[int], None] | None,
                    write_generation: int | None) -> StepStats:
        """`StreamingAdamW.finish_step` for a sharded run: global loss and norm, then every
        layer's shard update, all-gather and (on a commit step) gather to rank 0's store."""
        owners = [i for i in range(opt.program.n_layers) if self.tiers[i].numel]
        missing = [i for i in owners if i not in self._reduced]
        if missing:
            raise RuntimeError(f"layers {missing} never received final gradients this step")
        if self.dev is None:
            sq = math.fsum(self._reduced.pop(i).result() for i in owners)
            host = torch.tensor([float(loss.detach().float().cpu()), sq], dtype=torch.float64)
        else:  # the squared shard norms are on the device, final once the compute stream waited for every reduction
            for i in owners:
                self._reduced.pop(i).wait_stream(self.copies.compute_stream)
            sq_dev = self._sq.double().sum()  # layers without state never write theirs: it stays 0
            host = torch.stack([loss.detach().double().reshape(()), sq_dev]).cpu()  # the step's one sync
        # the step's one collective on this thread
        collective("the loss and norm all-reduce", self.dist.all_reduce, host, group=self.sync_group)
        loss_f = float(host[0])
        total = torch.tensor(math.sqrt(host[1]) if host[1] >= 0 else float("nan"), dtype=torch.float32)
        clip = opt.cfg.clip_norm
        coef_t = torch.clamp(clip / (total + 1e-6), max=1.0) if clip is not None else torch.ones(())
        coef = coef_t if clip is not None else None
        opt._step, step = None, opt._step
        total_f = float(total)
        skipped = not (math.isfinite(loss_f) and math.isfinite(total_f))
        if skipped:
            opt.note_skipped(step)
        stats = StepStats(loss=loss_f, lr=opt._lr, grad_norm=total_f, clip_coef=float(coef_t), skipped=skipped)
        writes: list[Future[None]] = []
        prev_commit = opt.commit_future
        kinds = state_kinds("ram", opt.durability) if commit is not None else ()
        streamed: list[tuple[int, Future[None], dict, tuple]] = []  # ram layers the GPU updates (gpu_update)
        for i in range(opt.program.n_layers):
            s = self.tiers[i]
            if not s.numel:
                continue
            if s.tier == "disk":  # hook: read from, updated in and written to this rank's shard store (mtc.runtime.dp_disk)
                writes.append(self.disk.schedule(self, opt, i, coef, step, skipped, prev_commit))
                continue
            lo, hi = s.shard
            decay = min(max(s.decay_numel - lo, 0), hi - lo)
            hp = {"lr": opt._lr, "step": opt.adam_step(step), "decay_numel": decay}
            if s.tier == "gpu":
                self._step_gpu_layer(opt, i, coef, hp, skipped, kinds, write_generation, prev_commit, step, writes)
                continue
            deps = (s.write, s.grad_ready, s.last_read)
            if i in opt.gpu_update and not skipped:
                upd = Future()
                streamed.append((i, upd, hp, deps))
            else:
                upd = opt._cpu.submit(self._update_shard, opt, i, coef, hp, deps, step, skipped)
            gather = self._all_gather if self.dev is None else self._all_gather_ram_device
            s.update = upd if skipped else self._comm.submit(gather, i, upd)
            if kinds:
                s.write = Future()
                src = {"master": s.master, "m": s.m, "v": s.v}
                # on the commit thread: it waits for the update and the last commit, which must not hold
                # up the comm thread's collectives (the next step's reductions queue behind them)
                opt._writer.submit(self._shard_write, opt, i, upd, src, kinds, write_generation, prev_commit, step, s.write)
                writes.append(s.write)
        if streamed:  # this rank's shards stream to the GPU and back (`StreamingAdamW._update_streamed`)
            views = {}
            for i, *_ in streamed:
                s = self.tiers[i]
                k = s.shard[1] - s.shard[0]
                master = s.master[:k]
                out = master if self._shard_out(i) is s.master else self._shard_out(i)[:k]  # fp32: the master is the copy
                views[i] = (master, s.m[:k], s.v[:k], self._gshard[i][:k], out)
            opt._gpu.submit(opt._update_streamed, streamed, coef, step, views)
        if self.disk is not None:  # hook: the next step's disk reads come from the generation just written
            self.disk.end_step()
        if commit is not None:
            opt.commit_future = opt._writer.submit(self._commit_all, opt, writes, commit, write_generation, step)
        if opt.engine.serialize:
            opt.wait()
        return stats

    def _step_gpu_layer(self, opt: StreamingAdamW, i: int, coef: torch.Tensor | None, hp: dict, skip: bool,
                        kinds: tuple[str, ...], gen: int | None, prev_commit: Future[None], tstep: int,
                        writes: list[Future[None]]) -> None:
        """Training thread: a gpu layer's shard update on the compute stream (the existing device
        AdamW; `finish_step` made the compute stream wait for its reduce-scatter), then the
        all-gather of the updated shards into its compute copy on the comm stream, and on a commit
        step the shard's copy to pinned host memory and its write into this rank's shard store."""
        s = self.tiers[i]
        k = s.shard[1] - s.shard[0]
        for tr in (s.staged, s.last_read):  # the staging copy of the last commit, a tied weight's fetch
            if tr is not None:
                self.copies.wait_on_compute(tr)
        s.staged = s.last_read = None
        if not skip:
            if k:
                with opt.timeline.span("update_gpu", i, step=tstep):
                    cdev = self._cdev.get(i)
                    _device_adamw(s.master[:k], self._gdev[i][:k], s.m[:k], s.v[:k], coef=coef,
                                  compute_out=cdev[:k] if cdev is not None else None, **hp, **opt._hyper())
            fut: Future[torch.cuda.Event | None] = Future()
            self._comm.submit(self._all_gather_gpu, i, self.copies.marker(), fut)
            s.gathered = CommTransfer(fut)
            s.update = fut
        else:
            s.update = _done()
        if kinds:
            # two staging sets per layer, alternating between commits: the store reads a set in
            # place until its write ends, so a set is refilled only once the write of two commits
            # ago has ended (long since, in practice: the wait is a guard, not a stall)
            sets = self._staging.setdefault(i, [])
            j = self._stage_next[i] = 1 - self._stage_next.get(i, 1)
            if len(sets) <= j:
                pin = self.tiers.device.type == "cuda"
                sets.append([host_buffer(k, torch.float32, pinned=pin) for _ in range(3)])
            stage = sets[j]
            last = self._stage_write.get((i, j))
            if last is not None:
                with contextlib.suppress(Exception):  # a failed write is reported by its own commit
                    last.result()
            staged = self.copies.d2h(list(zip(stage, (s.master[:k], s.m[:k], s.v[:k]), strict=True)), after=self.copies.marker(),
                                     layer=i, stage="stage_out")
            s.staged = staged  # the next update waits for it (ordered on the compute stream)
            s.write = Future()
            opt._writer.submit(self._shard_write, opt, i, staged, dict(zip(("master", "m", "v"), stage, strict=True)), kinds,
                              gen, prev_commit, tstep, s.write)
            self._stage_write[(i, j)] = s.write
            writes.append(s.write)

    def _all_gather_gpu(self, i: int, after: Marker, fut: Future) -> None:
        """Comm thread: all-gather a gpu layer's updated shards into its resident compute copy."""
        try:
            s = self.tiers[i]
            per = s.master.numel()
            src = self._cdev.get(i, s.master)[:per]
            with self.dev.on_stream(after):
                self.dev.all_gather(s.compute, src, f"layer {i}'s weight all-gather")
                fut.set_result(self.dev.record())
        except BaseException as e:
            fut.set_exception(e)
            raise

    def _all_gather_ram_device(self, i: int, upd: Future[None]) -> None:
        """Comm thread: a ram layer's updated compute-dtype shard goes up, is all-gathered on the
        device, and the whole layer comes down into the host compute copy (see `_init_device` for
        why there); returns once it is there, since the next fetch copies from the host."""
        upd.result()
        s = self.tiers[i]
        per = s.master.numel()
        with self.dev.on_stream():
            self._scr_c[:per].copy_(self._shard_out(i)[:per], non_blocking=True)
            self.dev.all_gather(self._scr_full[: per * self.world_size], self._scr_c[:per], f"layer {i}'s weight all-gather")
            s.compute.copy_(self._scr_full[: per * self.world_size], non_blocking=True)
            ev = self.dev.record()
        if ev is not None:  # the comm thread waits, not the layer loop: the next fetch of this layer waits for this future
            ev.synchronize()

    def _update_shard(self, opt: StreamingAdamW, i: int, coef: torch.Tensor | None, hp: dict, deps: tuple, tstep: int,
                      skip: bool) -> None:
        s = self.tiers[i]
        _wait_all(opt.timeline, i, deps, tstep)
        if skip:
            return
        lo, hi = s.shard
        k = hi - lo
        if not k:
            return
        with opt.timeline.span("update", i, step=tstep):
            opt.host_adamw(s.master[:k], self._gshard[i][:k], s.m[:k], s.v[:k], grad_scale=coef, compute_out=self._shard_out(i)[:k], **hp)

    def _shard_out(self, i: int) -> torch.Tensor:
        """Where rank's updated compute-dtype shard goes before the all-gather (the master itself in fp32)."""
        s = self.tiers[i]
        if s.compute.dtype == s.master.dtype:
            return s.master
        out = self._out.get(i)
        if out is None:  # pinned where it crosses to the device for the device all-gather
            pin = self.dev is not None and self.tiers.device.type == "cuda"
            out = self._out[i] = host_buffer(s.master.numel(), s.compute.dtype, pinned=pin)
        return out

    def _all_gather(self, i: int, upd: Future[None]) -> None:
        upd.result()
        s = self.tiers[i]
        per = s.master.numel()
        parts = [s.compute[r * per : (r + 1) * per] for r in range(self.world_size)]
        collective(f"layer {i}'s weight all-gather", self.dist.all_gather, parts, self._shard_out(i), group=self.comm_group)

    def _shard_write(self, opt: StreamingAdamW, i: int, ready: Future[None] | Transfer, src: dict[str, torch.Tensor],
                     kinds: tuple[str, ...], gen: int, prev_commit: Future[None], tstep: int, written: Future[None]) -> None:
        """Write layer ``i``'s updated state shard (``src``: host tensors, final once ``ready``)
        into this rank's shard store, generation ``gen``; ``written`` completes once it is there.
        The last global commit must have landed first: it may name ``gen``'s other generation only
        (see `mtc.shards`)."""
        try:
            if isinstance(ready, Future):
                ready.result()
            else:
                ready.wait()
            prev_commit.result()
            s = self.tiers[i]
            k = s.shard[1] - s.shard[0]
            t0 = time.perf_counter()
            futs = [self.shard_store.write_async(state_array_name(i, kind, gen), src[kind][:k], in_place=True)
                    for kind in kinds] if k else []
        except BaseException as e:
            written.set_exception(e)
            raise
        if not futs:
            written.set_result(None)
            return
        def done(err: BaseException | None) -> None:
            opt.timeline.add("write_behind", i, t0, time.perf_counter(), step=tstep)
            if err is not None:
                written.set_exception(err)
            else:
                written.set_result(None)

        _when_all(futs, done)

    def _commit_all(self, opt: StreamingAdamW, writes: list[Future[None]], commit: Callable[[int, BaseException | None], None],
                    gen: int, tstep: int) -> None:
        """On the writer thread: once this rank's writes are done (or failed), run the global
        commit protocol, which every rank enters (a failed write makes it fail on all ranks)."""
        error: BaseException | None = None
        for f in writes:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - reported through the protocol, so the other ranks do not hang
                error = error or e
        with opt.timeline.span("commit", step=tstep):
            commit(gen, error)

    def close(self) -> None:
        """Finish the collectives started (or let them fail on a dead peer) and stop the comm thread."""
        self._comm.shutdown(wait=True)
        if self.dev is not None:
            self.dev.synchronize()
