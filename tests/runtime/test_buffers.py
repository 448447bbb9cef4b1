"""The executor holds at most two layers' weights at once, and memory does not grow with depth."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from mtc.config import OptimConfig, TrainConfig
from mtc.data import BatchSampler
from mtc.runtime.executor import StreamingExecutor
from mtc.runtime.optimizer import HostAdamW
from mtc.runtime.trainer import open_run


def _measure(n_layers: int, device: str = "cpu") -> dict[str, float]:
    cfg = TrainConfig(model="tiny", model_overrides={"n_layers": n_layers}, steps=1, micro_batch_size=2, seq_len=16,
                      grad_accum=2, device=device, optim=OptimConfig(warmup_steps=1))
    store, program, last = open_run(cfg, None)
    largest = max(program.layer_numel(i) for i in range(program.n_layers)) * 4
    seen = {"max_live_sets": 0, "max_in_use": 0, "visits": 0}

    ex: StreamingExecutor

    def on_visit(phase: str, layer: int) -> None:
        gc.collect()
        seen["visits"] += 1
        seen["max_live_sets"] = max(seen["max_live_sets"], len(ex.live_weights))
        seen["max_in_use"] = max(seen["max_in_use"], ex.pool.bytes_in_use)

    ex = StreamingExecutor(program, store, device=device, on_visit=on_visit)
    opt = HostAdamW(program, store, cfg.optim)
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
    sampler = BatchSampler(tokens, batch_size=2, seq_len=16, seed=0)
    opt.begin_step(0, 1e-3, 0, 1)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ex.run([sampler.batch(0), sampler.batch(1)], opt, 0)
    opt.finish_step()
    if device != "cpu":
        seen["gpu_peak"] = torch.cuda.max_memory_allocated() - base
    seen.update(peak=ex.pool.peak_bytes_in_use, allocated=ex.pool.allocated_bytes, largest=largest, layers=program.n_layers)
    ex.close()
    opt.close()
    store.close()
    return seen


@pytest.mark.parametrize("n_layers", [2, 8])
def test_at_most_two_layers_of_weights(n_layers):
    s = _measure(n_layers)
    assert s["visits"] == 2 * (2 * s["layers"] - 1)  # two micro-batches: fwd, head, bwd visits
    assert s["peak"] <= 2 * s["largest"], s
    assert s["allocated"] <= 2 * s["largest"], s
    # the weights handed to templates do not outlive their visit (plus the prefetched one)
    assert s["max_live_sets"] <= 2, s


def test_buffer_memory_does_not_grow_with_depth():
    shallow, deep = _measure(2), _measure(8)
    assert deep["allocated"] == shallow["allocated"]
    assert deep["peak"] == shallow["peak"]


@pytest.mark.gpu
def test_gpu_peak_memory_flat_in_depth():
    shallow, deep = _measure(4, "cuda"), _measure(8, "cuda")
    assert deep["gpu_peak"] <= 1.10 * shallow["gpu_peak"], (shallow, deep)
