"""The planner's step time against real training on this machine (issue 11, must 3).

A profile is calibrated in the test (`mtc calibrate`), then three small runs whose bottlenecks
differ (compute, CPU optimizer, disk) train a few steps through `mtc.train` (unfused, the CPU
engine with its copy, fetch and optimizer threads); the median step time after warm-up must be
within 15 % of the plan's prediction, and the plan must name the bottleneck the config was built
for.

It is marked `alone`: `./run test` runs it after the parallel tests, by itself (with the second
worker's tests beside it, the compute case measured 20 % slow while the probes read +3 %: a probe's
moment misses a neighbour that comes and goes). The 2-core CI boxes are shared as well: another job
can halve this process's speed for seconds at a time.
The test therefore times fixed probes (a 512^3 matmul; a 128 MiB copy, since a neighbour that
streams memory slows the optimizer and the executor's gradient adds while a matmul hardly notices;
the store's reads and writes at once, since other jobs share the disk too) right after calibrating, and again
before and after each run. Each prediction is judged at the machine's speed anywhere between
calibrated and what the probe of the resource it is bound by read around the run (see `_miss`),
and an attempt in which any probe drifted more than 15 % says nothing about the model and is
repeated (calibration included) while the time budget lasts. A quiet attempt that misses is
repeated once too: the probes see the machine drift from its calibration, not the calibration's
own sampling error, and calibrate's store rates vary by up to 25 % between calibrations minutes
apart on the shared VM (the disk case, 2026-11-26: +22 % on a quiet attempt with its disk probe at
+4 %, where three other calibrations gave +15 %, -10 % and +9 %). Each probe is
compared with itself: against calibrate's own figures (another size, another count of samples)
the small disk probe read 35-50 % faster on a quiet machine, which judged every attempt noisy
and left a test that could not fail. An
attempt with all three within 15 % passes; two quiet attempts that miss fail, and so does one that
no other quiet attempt followed; if every attempt was noisy and missed, the test is skipped with
the figures.

Calibration and runs use one intra-op thread (the engine's copy and optimizer threads run beside
it, so compute and optimizer still share the two cores): with two, a busy neighbour stalls
OpenMP's barriers and a reference block ran 5-8x slower than with one (measured on the 2-core box
under load 8), which no profile can predict; with one, a neighbour slows the run in proportion,
and the probe sees it.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import pytest
import torch

from mtc.calibrate import MachineProfile
from mtc.cli import main
from mtc.config import OptimConfig, TrainConfig
from mtc.planner import make_plan
from mtc.train import train
from tests.runtime.engine_util import skewed_tokens

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # `./run test` runs it by itself, after the parallel tests

TOLERANCE = 0.15
BUDGET_S = 60  # a second attempt starts only within this time (one attempt takes ~40 s on the 2-core box)
STEPS, WARMUP = 9, 3

_BASE = {"model": "tiny", "kernels": "unfused", "durability": "none", "steps": STEPS, "optim": OptimConfig(lr=1e-3, warmup_steps=1)}
CONFIGS = {
    # many tokens through a small model: forward + backward dominate
    "compute": {"model_overrides": {"n_layers": 2, "dim": 384, "ffn_dim": 1024, "n_heads": 6, "n_kv_heads": 2},
                    "micro_batch_size": 8, "seq_len": 128, "placement": "ram"},
    # GPT-2 style with a 32K-row learned position table (12.6M of 13.5M parameters): a step reads 16
    # rows of it, but AdamW (one thread) updates every row
    "CPU optimizer": {"model": "gpt2-tiny", "model_overrides": {"n_layers": 2, "dim": 384, "n_heads": 6, "max_seq_len": 32768},
                      "micro_batch_size": 1, "seq_len": 16, "placement": "ram", "optim_threads": 1},
    # the same state on disk: read, updated and written back (fsync) every step
    "disk I/O": {"model_overrides": {"n_layers": 2, "dim": 768, "ffn_dim": 2048, "n_heads": 8, "n_kv_heads": 2},
                     "micro_batch_size": 1, "seq_len": 16, "placement": "disk"},
}


def _probe() -> float:
    """TFLOP/s of a 512^3 fp32 matmul, median of 5."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    torch.mm(a, b)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * 512**3 / statistics.median(times) / 1e12


def _mem_probe() -> float:
    """GB/s of a 128 MiB fp32 copy (DRAM, past the caches: within 2 % run to run on a quiet 2-core
    box, where 32 MiB swung 12 %), median of 5."""
    a, b = torch.randn(32 * 2**20), torch.empty(32 * 2**20)
    b.copy_(a)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return 2 * a.numel() * 4 / statistics.median(times) / 1e9


def _disk_probe(root) -> float:
    """GB/s of the store writing a disk layer's three arrays (24 MiB) and reading others beside
    them, the bytes of both over the time: the rate at which the cost model lets the disk tier's
    read-ahead and write-behind share the disk (`MachineProfile.store_both_gbps`).

    A probe of the plain write alone once saw +4 % around a run whose prediction missed by +44 %
    ('quiet', CI 2026-11-27): the prediction then hung on the write beside reads, a figure that
    drifts on its own (0.42-0.62 GB/s over eight calibrations in a row, where the plain write read
    0.97-1.14)."""
    from mtc.calibrate import _store_rates

    root.mkdir(exist_ok=True)
    return _store_rates(torch, root, 24, 2, 4)[4]


def _miss(predicted: float, measured: float, slow: float) -> float:
    """The prediction's relative miss, for the machine's speed anywhere between calibrated and probed.

    The plan predicts for the calibrated machine; one that ran 14 % faster through the run should take
    14 % less (CI, disk case: +19 % raw, +3 % at the probed speed). The probes are small and noisy
    themselves (a disk probe read 21 % fast around a run that went 18 % slow), so neither end is the
    truth: the miss is the one nearest zero over the range, and 0 when the range spans the measurement."""
    raw, scaled = predicted / measured - 1, predicted * (1 + slow) / measured - 1
    return 0.0 if raw * scaled <= 0 else min(raw, scaled, key=abs)


def _measure(cfg: TrainConfig, store, data) -> float:
    res = train(cfg, store, data, overwrite=True)
    res.store.close()
    return statistics.median(r.seconds for r in res.records[WARMUP:])


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_predicted_step_time_within_15_percent(tmp_path, one_thread):
    data = skewed_tokens(tmp_path / "d.bin", 100_000)
    t_start, report, attempt = time.perf_counter(), [], 0
    quiet_misses: list[str] = []

    def again() -> bool:  # one quiet miss may be its calibration's outlier: a second quiet attempt decides
        spent = time.perf_counter() - t_start
        return spent < BUDGET_S or (len(quiet_misses) == 1 and spent < 2 * BUDGET_S)

    while attempt == 0 or again():
        # what earlier tests left in the page cache is written back now, not while calibrate and the
        # runs are timed (after `./run test`'s parallel part: GBs of stores). In three suite runs of
        # 2026-11-29 every attempt read as noisy and the test skipped, then passed by itself; whether
        # the writeback was the noise is not settled (with 3 GB written just before it, by itself,
        # it took 79-80 s twice and 41 s once)
        os.sync()
        assert main(["calibrate", "-o", str(tmp_path / "machine.json"), "--dir", str(tmp_path / "cal")]) == 0
        prof = MachineProfile.load(tmp_path / "machine.json")
        os.sync()  # calibrate's own writes must not slow the disk probe's baseline (it then read 25-46 % slow)
        base, mem_base, disk_base = _probe(), _mem_probe(), _disk_probe(tmp_path / "probe")  # the machine's speed while it calibrated
        results, quiet = {}, True
        for want, fields in CONFIGS.items():
            cfg = TrainConfig(**{**_BASE, **fields})
            plan = make_plan(cfg, dataclasses.replace(prof, disk_dir=str(tmp_path)))
            probes, mems = [_probe()], [_mem_probe()]
            disks = [_disk_probe(tmp_path / "probe")] if want == "disk I/O" else []
            measured = _measure(cfg, tmp_path / f"s-{attempt}", data)
            probes.append(_probe())
            mems.append(_mem_probe())
            if disks:
                disks.append(_disk_probe(tmp_path / "probe"))
            # how much slower than calibrated the machine ran (negative: faster, i.e. calibrated in a slow spell)
            drift = {"compute": [1 - p / base for p in probes], "CPU optimizer": [1 - m / mem_base for m in mems],
                     "disk I/O": [1 - d / disk_base for d in disks]}
            quiet = quiet and all(abs(d) <= TOLERANCE for ds in drift.values() for d in ds)
            # the prediction scales with the resource the config is bound by: its own probe's mean drift
            results[want] = (plan.step.step_s, measured, plan.step.bottleneck, statistics.mean(drift[want]))
        lines = [f"attempt {attempt} ({'quiet' if quiet else 'noisy'}):"] + [
            f"  {k:14s} predicted {p * 1e3:7.1f} ms, measured {m * 1e3:7.1f} ms ({p / m - 1:+.0%}; "
            f"{_miss(p, m, d):+.0%} over the drift), bottleneck {b}, its resource {d:+.0%} slower than calibrated"
            for k, (p, m, b, d) in results.items()]
        report.append("\n".join(lines))
        print(report[-1])
        # the plan must name what each config was built to be bound by ("compute (CPU)" for compute)
        named = all(bottleneck.startswith(want) for want, (_, _, bottleneck, _) in results.items())
        within = all(abs(_miss(pred, meas, slow)) <= TOLERANCE for pred, meas, _, slow in results.values())
        if named and within:  # all three within 15 % of the drift-scaled prediction in one attempt: the model holds
            return
        if quiet:
            quiet_misses.append(report[-1])
            # a quiet machine and a miss twice, each against its own calibration: the model is wrong
            assert len(quiet_misses) < 2, "\n".join(quiet_misses)
        attempt += 1
    # a quiet miss that no later attempt could confirm or clear (every other one was noisy): still a miss
    assert not quiet_misses, "\n".join(report)
    pytest.skip(f"the machine ran more than {TOLERANCE:.0%} slower or faster than calibrated during every attempt: nothing to "
                "conclude about the model\n" + "\n".join(report))
