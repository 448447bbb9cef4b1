"""What the training loop adds to each step's record: throughput, MFU, memory, phases, validation loss.

`RunWatcher` is built once per `train` call and asked once per step; the loop stays a loop. The
validation loss (every ``eval_every`` steps and at the run's last step) is measured on the weights
of the step it is reported with: the watcher first waits for that step's updates of every layer
(`mtc.weight_sources.wait_for_updates`), then runs the run's own layer runners forward over the
held-out batches, taking each layer's weights from the tiers' compute copies. In a data-parallel
run each rank runs its share of those batches (every rank holds the whole compute copy) and the
per-batch losses are summed over the ranks into one vector, which every rank combines as one
process would: the figure is that of one process over all the batches, bit for bit, in 1/N of
the time.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mtc.config import TrainConfig
from mtc.data import TokenFile
from mtc.evaluate import batch_losses, combine_losses, eval_batches, forward_loss
from mtc.graphs.program import Program
from mtc.metrics import FlopCounter, gpu_peak_bytes, host_rss_bytes, peak_rate, phase_seconds
from mtc.runtime.runners import LayerRunner
from mtc.runtime.tiers import StateTiers
from mtc.runtime.timeline import Timeline
from mtc.weight_sources import TierWeights, wait_for_updates

__all__ = ["RunWatcher", "check_eval_data", "eval_due", "mfu_devices"]


def eval_due(step: int, cfg: TrainConfig) -> bool:
    """Whether step ``step`` (completed steps, from 1) reports a validation loss."""
    return bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == cfg.steps)


def check_eval_data(tokens: TokenFile, program_batch: tuple[int, int], cfg: TrainConfig) -> None:
    """DataError now (before a store is written) when ``--eval-every`` has no held-out split to use."""
    if cfg.eval_every:
        from mtc.data import BatchSampler

        b, t = program_batch
        BatchSampler(tokens, batch_size=b, seq_len=t, seed=cfg.seed, split="val")


def mfu_devices(device: torch.device, world_size: int, local_world_size: int) -> int:
    """How many devices of MFU's denominator computed a data-parallel step's tokens: each rank's
    GPU; on the CPU, each host's (its ranks split its cores: `mtc.dist.cpu_share`)."""
    if device.type == "cuda":
        return world_size
    return max(1, world_size // max(1, local_world_size))


class RunWatcher:
    """Per-step figures of one training run (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, program: Program, tiers: StateTiers, runners: dict[str, LayerRunner],
                 timeline: Timeline, tokens: TokenFile, device: torch.device, *, devices: int = 1, rank: int = 0,
                 world_size: int = 1) -> None:
        # ``devices``: how many devices the step's tokens were computed on (`mfu_devices`): MFU
        # divides the whole step's model FLOP/s by their peak together. ``rank`` of ``world_size``:
        # a data-parallel rank, which validates on its share of the eval batches (`validate`)
        self.cfg, self.program, self.tiers, self.runners, self.devices = cfg, program, tiers, runners, devices
        self.rank, self.world_size = rank, world_size
        self.timeline, self.device = timeline, device
        self.flops = FlopCounter.of(program, cfg.seq_len)
        self.peak = peak_rate(device, cfg.resolved_compute_dtype, allow_tf32=cfg.allow_tf32)
        self._val = eval_batches(tokens, program, n=cfg.eval_batches, seed=cfg.seed) if cfg.eval_every else None
        gpu_peak_bytes(device)  # start the peak counter at this run's first step

    def after_step(self, step: int, tokens: int, start: float, end: float) -> dict[str, Any]:
        """The extra fields of step ``step``'s record (it ran from ``start`` to ``end``, host clock)."""
        secs = max(end - start, 1e-12)
        tflops = self.flops.flops(tokens) / secs / 1e12
        mfu = self.peak.mfu(tflops / self.devices)
        out: dict[str, Any] = {
            "tflops": tflops, "mfu": mfu, "peak_tflops": self.peak.tflops,
            "gpu_peak_bytes": gpu_peak_bytes(self.device), "host_rss_bytes": host_rss_bytes(),
            "phase_s": phase_seconds(self.timeline.spans(), start, end),
        }
        if self._val is not None and eval_due(step, self.cfg):
            t0 = time.perf_counter()
            out["val_loss"] = self.validate()
            out["eval_s"] = time.perf_counter() - t0
        return out

    def validate(self) -> float:
        """Validation loss of the weights after the last finished step (waits for its updates)."""
        assert self._val is not None
        wait_for_updates(self.tiers)
        weights = TierWeights(self.program, self.tiers, self.device)
        if self.world_size == 1:
            return forward_loss(self.program, self.runners, weights, self._val, self.device)
        from mtc.dist import sum_over_ranks

        # this rank's contiguous share; the others' slots stay 0, so the sum over the ranks puts
        # each batch's own figures in place exactly (x + 0.0 == x) and the combination below is the
        # one a single process makes
        n = len(self._val)
        lo, hi = self.rank * n // self.world_size, (self.rank + 1) * n // self.world_size
        both = torch.zeros(2, n, dtype=torch.float64)
        if hi > lo:
            both[0, lo:hi], both[1, lo:hi] = batch_losses(self.program, self.runners, weights, self._val[lo:hi], self.device)
        sum_over_ranks(both, "the validation loss all-reduce")
        return combine_losses(both[0], both[1])
