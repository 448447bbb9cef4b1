"""The executor holds at most two layers' weights at once, and memory does not grow with depth."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from mtc.config import OptimConfig, TrainConfig
from mtc.data import BatchSampler
from mtc.runtime.placement import streamed_grads_on_device
from mtc.runtime.tiers import StateTiers
from mtc.runtime.timeline import Timeline
from mtc.train import build_engine, open_run, plan_placement


def _measure(n_layers: int, device: str = "cpu", **kw: object) -> dict[str, float]:
    cfg = TrainConfig(model="tiny", model_overrides={"n_layers": n_layers}, steps=1, micro_batch_size=2, seq_len=16,
                      grad_accum=2, device=device, optim=OptimConfig(warmup_steps=1), durability="none", **kw)
    run = open_run(cfg, None)
    program = run.program
    placement, gpu_update = plan_placement(cfg, program)
    tiers = StateTiers(program, placement, torch.device(device), getattr(torch, cfg.resolved_compute_dtype),
                       streamed=gpu_update, streamed_grads_on_device=streamed_grads_on_device(cfg.activation_budget_gb))
    largest = max(program.layer_numel(i) for i in range(program.n_layers)) * tiers.compute_dtype.itemsize
    seen = {"max_live_sets": 0, "max_in_use": 0, "visits": 0}

    def on_visit(phase: str, layer: int) -> None:
        # no gc.collect() here: a visit's weights must go by reference counting alone, as they do
        # in a run (a collection per visit also took 90 % of this test's time)
        seen["visits"] += 1
        seen["max_live_sets"] = max(seen["max_live_sets"], len(eng.executor.live_weights))
        seen["max_in_use"] = max(seen["max_in_use"], eng.executor.ring.bytes_in_use)

    eng = build_engine(cfg, program, tiers, gpu_update, run.store, Timeline(), on_visit=on_visit)
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
    sampler = BatchSampler(tokens, batch_size=2, seq_len=16, seed=0)
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    eng.optimizer.begin_step(0, 1e-3)
    out = eng.executor.run_step([sampler.batch(0), sampler.batch(1)], eng.optimizer)
    eng.optimizer.finish_step(out.loss)
    eng.optimizer.wait()
    if device != "cpu":
        seen["gpu_peak"] = torch.cuda.max_memory_allocated() - base
    ring = eng.executor.ring
    seen.update(peak=ring.peak_bytes_in_use, allocated=ring.allocated_bytes, largest=largest, layers=program.n_layers,
                slabs=eng.executor.slabs.allocated_bytes, acts=eng.executor.acts.peak_device_bytes)
    eng.close()
    run.store.close()
    return seen


@pytest.mark.parametrize("n_layers", [2, 8])
def test_at_most_two_layers_of_weights(n_layers):
    s = _measure(n_layers)
    assert s["visits"] == 2 * s["layers"] - 1  # layer-major: one visit per layer and direction for the group
    assert s["peak"] <= 2 * s["largest"], s
    assert s["allocated"] <= 2 * s["largest"], s
    # the weights handed to templates do not outlive their visit (plus the prefetched one)
    assert s["max_live_sets"] <= 2, s


def test_buffer_memory_does_not_grow_with_depth():
    shallow, deep = _measure(2), _measure(8)
    assert deep["allocated"] == shallow["allocated"]
    assert deep["peak"] == shallow["peak"]
    assert deep["slabs"] == shallow["slabs"]


def test_activation_budget_bounds_device_activations():
    hidden = 2 * 16 * 64 * 4  # micro-batch x seq x dim x fp32 bytes of one boundary activation
    s = _measure(8, activation_budget_gb=3 * hidden / 2**30)
    assert s["acts"] <= 3 * hidden, s
    free = _measure(8)
    assert free["acts"] > 3 * hidden  # without a budget all of them stay on the device


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 2**-10])
def test_gpu_peak_memory_flat_in_depth(budget):
    shallow = _measure(4, "cuda", compute_dtype="float32", placement="stateless", activation_budget_gb=budget)
    deep = _measure(8, "cuda", compute_dtype="float32", placement="stateless", activation_budget_gb=budget)
    if budget is not None:
        assert deep["gpu_peak"] <= 1.10 * shallow["gpu_peak"], (shallow, deep)
    # without a budget the layer-boundary activations stay on the device (and grow with depth); all
    # the rest is flat in depth either way
    assert deep["gpu_peak"] - deep["acts"] <= 1.10 * (shallow["gpu_peak"] - shallow["acts"]), (shallow, deep)


_NO_ALLOC_MODES = {
    "ram": {},
    "stateless-gpu-update": {"placement": "stateless", "gpu_update": "all", "update_prefetch": 1},
    "disk": {"placement": "disk"},
    "offloaded-activations": {"activation_budget_gb": 1e-6},
}


@pytest.mark.parametrize("extra", _NO_ALLOC_MODES.values(), ids=_NO_ALLOC_MODES.keys())
def test_no_step_after_the_first_two_allocates_host_buffers(tmp_path, monkeypatch, extra):
    """Buffers are reused: after the first steps (start-up, the first visits' lazy buffers), no step
    maps page-aligned host memory (`pinned.host_buffer`'s allocator, pinned on CUDA) or pins a tensor."""
    import mtc.runtime.pinned as pinned
    from mtc.train import train
    from tests.runtime.engine_util import skewed_tokens, small_config

    tokens = skewed_tokens(tmp_path / "tok.bin")
    step = {"done": 0}
    late: list[str] = []
    early = []
    mapped, pin = pinned._mapped, torch.Tensor.pin_memory

    def spy_mapped(nbytes):
        early.append(nbytes)
        if step["done"] >= 2:
            late.append(f"{nbytes} B mapped after step {step['done']}")
        return mapped(nbytes)

    def spy_pin(self, *a, **k):
        if step["done"] >= 2:
            late.append(f"{self.numel()} elements pinned after step {step['done']}")
        return pin(self, *a, **k)

    monkeypatch.setattr(pinned, "_mapped", spy_mapped)
    monkeypatch.setattr(torch.Tensor, "pin_memory", spy_pin)
    cfg = small_config(steps=5, model_overrides={"n_layers": 3}, durability="none", **extra)
    res = train(cfg, tmp_path / "s" if extra.get("placement") == "disk" else None, tokens,
                on_step=lambda rec: step.__setitem__("done", step["done"] + 1))
    res.store.close()
    assert step["done"] == 5 and not late, late
    assert early  # (the spy sees the allocator: the engine's buffers were mapped through it at start-up)
