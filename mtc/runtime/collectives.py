"""Data parallelism over the streaming engine: gradient reduction, sharded AdamW, all-gather, commits.

Every rank streams the same layers over its own micro-batches (`mtc.train` splits the step's
global batch contiguously by rank). Each layer's flat fp32 state of ``n`` elements is split into
``world`` contiguous shards of ``S = ceil(n / world)`` (the last ones shorter, possibly empty):
rank ``r`` owns ``[r*S, min((r+1)*S, n))`` of the master weights, Adam's m and v, and updates only
that range. Per layer and step:

1. backward: once the layer's gradient is final and copied to its host buffer, the comm thread
   reduce-scatters it over the ranks, so each rank receives the sum of its shard only (gloo gained
   reduce-scatter in recent torch; where it is missing, an all-reduce, each rank reading its
   shard), and takes the squared norm of that shard. The layer loop never waits for it.
2. `finish_step`: one all-reduce of [loss share, sum of squared shard norms] on the training thread
   gives the step's loss and the exact global gradient norm, so clipping is the single-process
   clipping (up to the reduction order).
3. the host AdamW updates this rank's shard, writing its compute-dtype copy, and the comm thread
   all-gathers the shards into every rank's full compute copy; the layer's next fetch waits for
   that (`LayerState.update` completes after the all-gather).
4. on a commit step the comm thread writes the layer's updated master, m and v shards into this
   rank's own shard store (its stale generation, once the last global commit has landed); once
   every layer is written the writer thread runs the global commit protocol of `mtc.shards`
   (per-rank record, agreement of all ranks, rank 0's global record, barrier).

Store layout: one shard store per rank (``RUN/ranks/rank-R-of-N/``) and one global commit record in
the run directory, which names each shard's digest (see `mtc.shards`): commit I/O is spread over
the ranks, nothing is gathered to rank 0, a missing or stale shard is refused on resume, and
``mtc reshard`` rewrites the state for another world size. ``ram`` and ``disk`` placements are
supported with more than one rank (a disk layer's shard is read from and written to the rank's
shard store each step: `mtc.runtime.dp_disk`); the ``gpu`` tier is refused with a clear error.

All collectives of the comm thread are enqueued by the training thread in a fixed order (the
executor's finalisation order, then `finish_step`'s forward order), so every rank issues the same
sequence; the training thread's own collectives use a separate group (`mtc.dist`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from mtc.errors import MTCError
from mtc.runtime.host_adamw import adamw_flat_
from mtc.runtime.optimizer import StepStats, _wait_all, _when_all
from mtc.runtime.tiers import state_kinds
from mtc.store import state_array_name

if TYPE_CHECKING:
    from mtc.runtime.dp_disk import DiskShards
    from mtc.runtime.optimizer import StreamingAdamW
    from mtc.runtime.tiers import StateTiers
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


def _reduce_scatter_fn(dist: object, group: object) -> Callable | None:
    """torch's reduce-scatter when this build's gloo has it (probed once, alike on every rank), else None."""
    fn = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
    if fn is None:
        return None
    n = dist.get_world_size(group)
    try:
        fn(torch.empty(1), torch.zeros(n), group=group)
    except (RuntimeError, NotImplementedError):  # "not supported" by this backend: all-reduce instead
        return None
    return fn


class DataParallel:
    """The collectives of one rank: the comm thread, gradient reductions, sharded updates."""

    def __init__(self, tiers: StateTiers, *, rank: int, world_size: int, sync_group: object, comm_group: object) -> None:
        import torch.distributed as dist

        self.dist, self.tiers, self.rank, self.world_size = dist, tiers, rank, world_size
        self.sync_group, self.comm_group = sync_group, comm_group
        for s in tiers.layers:
            if s.numel and s.tier not in ("ram", "disk"):
                raise ValueError(f"data parallel runs support the ram and disk tiers only, layer {s.layer} is {s.tier!r}")
        self.disk: DiskShards | None = None  # the disk layers' shards (mtc.runtime.dp_disk), set by mtc.dist.attach
        self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-comm")
        self._scatter = _reduce_scatter_fn(dist, comm_group)
        # reduce-scatter needs world equal parts: the gradient buffer is padded to world * shard
        # size (the executor sees its first numel elements), and this rank's summed shard lands in
        # a buffer of its own
        self._gpad: dict[int, torch.Tensor] = {}
        self._gshard: dict[int, torch.Tensor] = {}
        for s in tiers.layers:
            if not s.numel:
                continue
            per = -(-s.numel // world_size)  # (a disk layer has no master in RAM)
            pad = torch.zeros(per * world_size, dtype=torch.float32, pin_memory=s.grad.is_pinned())
            s.grad = pad[: s.numel]
            self._gpad[s.layer], self._gshard[s.layer] = pad, torch.zeros(per, dtype=torch.float32)
        self._reduced: dict[int, Future[float]] = {}  # layer -> its reduction (squared norm of this rank's shard)
        # bf16 compute: the update writes this rank's compute-dtype shard here, then it is all-gathered
        self._out: dict[int, torch.Tensor] = {}
        self.shard_store: TensorStore | None = None  # this rank's shard store (mtc.shards), set by mtc.dist.attach

    # -- the training thread's collectives -----------------------------------------------------

    def reduce_count(self, count: torch.Tensor) -> torch.Tensor:
        """The global number of target tokens of the step, from this rank's ``count``."""
        t = count.detach().to("cpu", torch.float64).reshape(1).clone()
        collective("the target-count all-reduce", self.dist.all_reduce, t, group=self.sync_group)
        return t.to(count.device, torch.float32).reshape(())

    # -- backward ------------------------------------------------------------------------------

    def grad_final(self, layer: int) -> None:
        """``layer``'s local gradient is final (its copy to the host buffer may still be in flight):
        reduce it over the ranks on the comm thread."""
        s = self.tiers[layer]
        self._reduced[layer] = self._comm.submit(self._reduce, layer, s.grad_ready)

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
        sq = math.fsum(self._reduced.pop(i).result() for i in owners)
        host = torch.tensor([float(loss.detach().float().cpu()), sq], dtype=torch.float64)
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
        stats = StepStats(loss=loss_f, lr=opt._lr, grad_norm=total_f, clip_coef=float(coef_t), skipped=skipped)
        writes: list[Future[None]] = []
        prev_commit = opt.commit_future
        kinds = state_kinds("ram", opt.durability) if commit is not None else ()
        for i in range(opt.program.n_layers):
            s = self.tiers[i]
            if not s.numel:
                continue
            if s.tier == "disk":  # hook: read from, updated in and written to this rank's shard store (mtc.runtime.dp_disk)
                writes.append(self.disk.schedule(self, opt, i, coef, step, skipped, prev_commit))
                continue
            lo, hi = s.shard
            decay = min(max(s.decay_numel - lo, 0), hi - lo)
            hp = {"lr": opt._lr, "step": step + 1, "decay_numel": decay}
            deps = (s.write, s.grad_ready, s.last_read)
            upd = opt._cpu.submit(self._update_shard, opt, i, coef, hp, deps, step, skipped)
            s.update = upd if skipped else self._comm.submit(self._all_gather, i, upd)
            if kinds:
                s.write = Future()
                self._comm.submit(self._shard_write, opt, i, upd, kinds, write_generation, prev_commit, step, s.write)
                writes.append(s.write)
        if self.disk is not None:  # hook: the next step's disk reads come from the generation just written
            self.disk.end_step()
        if commit is not None:
            opt.commit_future = opt._writer.submit(self._commit_all, opt, writes, commit, write_generation, step)
        if opt.engine.serialize:
            opt.wait()
        return stats

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
            adamw_flat_(s.master[:k], self._gshard[i][:k], s.m[:k], s.v[:k], grad_scale=coef, compute_out=self._shard_out(i)[:k],
                        pool=opt._chunks, impl=opt.host_impl, **hp, **opt._hyper())

    def _shard_out(self, i: int) -> torch.Tensor:
        """Where rank's updated compute-dtype shard goes before the all-gather (the master itself in fp32)."""
        s = self.tiers[i]
        if s.compute.dtype == s.master.dtype:
            return s.master
        out = self._out.get(i)
        if out is None:
            out = self._out[i] = torch.empty(s.master.numel(), dtype=s.compute.dtype)
        return out

    def _all_gather(self, i: int, upd: Future[None]) -> None:
        upd.result()
        s = self.tiers[i]
        per = s.master.numel()
        parts = [s.compute[r * per : (r + 1) * per] for r in range(self.world_size)]
        collective(f"layer {i}'s weight all-gather", self.dist.all_gather, parts, self._shard_out(i), group=self.comm_group)

    def _shard_write(self, opt: StreamingAdamW, i: int, upd: Future[None], kinds: tuple[str, ...], gen: int,
                     prev_commit: Future[None], tstep: int, written: Future[None]) -> None:
        """Write layer ``i``'s updated state shard into this rank's shard store, generation ``gen``;
        ``written`` completes once it is there. The last global commit must have landed first: it
        may name ``gen``'s other generation only (see `mtc.shards`)."""
        try:
            upd.result()
            prev_commit.result()
            s = self.tiers[i]
            k = s.shard[1] - s.shard[0]
            src = {"master": s.master, "m": s.m, "v": s.v}
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
