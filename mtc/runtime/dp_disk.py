"""The disk tier of a data-parallel run: each rank's shard of a disk layer's state lives only in its shard store.

With more than one rank (`mtc.runtime.collectives`) rank ``r`` owns the contiguous range
``[lo, hi)`` of every layer's flat state. For a ``disk`` layer that range's master, m and v are
never held in RAM: they live in the rank's own shard store (``RUN/ranks/rank-r-of-N/``, arrays of
shape ``(hi - lo,)`` under the single-process names, `mtc.shards`), and each step

1. the disk tier's read-ahead ring (`mtc.runtime.disk_tier.DiskRing`, over the shard store and the
   shard's length) reads the shard, chunk by chunk, from the generation the last commit names,
   while forward and backward run;
2. the comm thread's reduce-scatter leaves this rank's summed gradient shard in host memory, as
   for a ram layer (the executor sends a sharded disk layer's gradient to the host buffer a ram
   layer's goes to, so there is no per-set gradient buffer);
3. the host AdamW updates each chunk in its ring set, writing the compute-dtype result straight
   into this rank's range of the layer's whole (padded) compute copy, and the chunk is written
   behind, in place, into the other generation of the shard store once the last global commit
   has landed; the set returns to the ring when its writes are durable;
4. the comm thread all-gathers the compute copy's ranges over the ranks before the layer's next
   visit, as for a ram layer.

A disk layer writes its whole state every step, whatever the durability mode (`state_kinds`), so
a run with disk layers commits every step (as the single-process disk tier); its writes are among
the ones the rank's per-rank commit record waits for (`DataParallel._commit_all`), so the global
commit protocol of `mtc.shards` covers them. Host RAM per disk parameter is the gradient (4 B)
and the compute copy (4 or 2 B); the state itself costs only the ring's ``slots`` sets of one
chunk each, whatever the depth.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from mtc.runtime.disk_tier import DiskRing
from mtc.runtime.optimizer import update_disk_chunks

if TYPE_CHECKING:
    from mtc.runtime.collectives import DataParallel
    from mtc.runtime.optimizer import StreamingAdamW
    from mtc.runtime.tiers import StateTiers
    from mtc.store import TensorStore

__all__ = ["DiskShards", "disk_shard_layers"]

_KINDS = ("master", "m", "v")


def disk_shard_layers(tiers: StateTiers) -> dict[int, int]:
    """Each sharded disk layer's shard length on this rank (0 where its shard is empty)."""
    return {s.layer: s.shard[1] - s.shard[0] for s in tiers.layers if s.tier == "disk" and s.numel and s.shard is not None}


class DiskShards:
    """The disk layers of one rank: their read-ahead ring over the rank's shard store, their
    updates and write-behind, and the all-gather of their compute copies."""

    def __init__(self, tiers: StateTiers, store: TensorStore, *, rank: int, world_size: int, slots: int = 3) -> None:
        self.tiers, self.store, self.rank, self.world_size = tiers, store, rank, world_size
        self.layers = disk_shard_layers(tiers)
        # the gradient shard is in host memory (reduced there): the ring's sets need no gradient buffer.
        # The optimizer owns the ring (`mtc.dist.attach` hands it over): it posts each step's
        # read-ahead in `begin_step` and closes it, as for the single-process disk tier
        self.ring = DiskRing(tiers, store, slots=slots, numels=self.layers, grad_buffers=False)

    def schedule(self, dp: DataParallel, opt: StreamingAdamW, i: int, coef: torch.Tensor | None, step: int, skipped: bool,
                 prev_commit: Future[None]) -> Future[None]:
        """Start layer ``i``'s update (on the optimizer's update thread, in forward order) and its
        all-gather (on the comm thread, in the order every rank enqueues); returns the future of
        its write into the other generation, which the commit waits for."""
        s = self.tiers[i]
        w_gen = self.tiers.disk_write_generation()
        s.write = written = Future()
        hp = {"lr": opt._lr, "step": opt.adam_step(step)}
        upd = opt._cpu.submit(self._update, dp, opt, i, coef, hp, (s.grad_ready, s.last_read), w_gen, prev_commit, step,
                              skipped, written)
        # a skipped step changes no weight: nothing to gather (its state is still carried over)
        s.update = upd if skipped else dp._comm.submit(self._all_gather, dp, i, upd)
        return written

    def end_step(self) -> None:
        """Every disk layer's update of the step is scheduled: the next step reads what it writes."""
        self.tiers.disk_generation = self.tiers.disk_write_generation()

    def _update(self, dp: DataParallel, opt: StreamingAdamW, i: int, coef: torch.Tensor | None, hp: dict, deps: tuple,
                w_gen: int, prev_commit: Future[None], tstep: int, skip: bool, written: Future[None]) -> None:
        """Update this rank's shard of layer ``i`` chunk by chunk in its read-ahead sets and write
        each chunk behind into ``w_gen``; ``written`` completes once all of it is durable."""
        s = self.tiers[i]
        lo = s.shard[0]
        if not self.layers.get(i):  # an empty shard: nothing to read, update or write
            written.set_result(None)
            return
        per = -(-s.numel // self.world_size)
        base = self.rank * per  # this rank's range of the padded compute copy
        grad = dp._gshard[i]

        def update(_set: object, c_lo: int, c_hi: int, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
            if skip:  # a skipped step only carries the state over into the next generation
                return
            with opt.timeline.span("update", i, step=tstep):
                # element-wise: a chunk of the shard is updated as the whole layer would be
                decay = min(max(s.decay_numel - lo - c_lo, 0), c_hi - c_lo)
                opt.host_adamw(master, grad[c_lo:c_hi], m, v, grad_scale=coef, compute_out=s.compute[base + c_lo : base + c_hi],
                               **dict(hp, decay_numel=decay))

        update_disk_chunks(self.ring, self.store, i, update, deps=deps, w_gen=w_gen, prev_commit=prev_commit,
                           timeline=opt.timeline, tstep=tstep, written=written)

    def _all_gather(self, dp: DataParallel, i: int, upd: Future[None]) -> None:
        """Every rank's updated range of layer ``i``'s compute copy, into every rank's copy."""
        from mtc.runtime.collectives import collective

        upd.result()
        s = self.tiers[i]
        per = -(-s.numel // self.world_size)
        parts = [s.compute[r * per : (r + 1) * per] for r in range(self.world_size)]
        # the source is this rank's own output slot: gathered from a copy, so no backend sees
        # its input alias its output (one shard of one layer, freed at once)
        collective(f"layer {i}'s weight all-gather", dp.dist.all_gather, parts, parts[self.rank].clone(), group=dp.comm_group)
