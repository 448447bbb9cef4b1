"""StageWatch on timelines written by hand: it warns when a slow disk lengthens the steps, and not
when slow-looking writes hide behind other work (a commit beside the compute) or are too small to time.

(The run through `mtc.train` is in tests/mtc/test_planner.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from mtc.calibrate import MachineProfile, builtin
from mtc.config import TrainConfig
from mtc.planner import Plan, make_plan
from mtc.runtime.timeline import Timeline
from mtc.stagewatch import MIN_RATE_BYTES, STEP_MARGIN, StageWatch
from tests.runtime.engine_util import small_config


def _profile(*, write_gbps: float, busy_gbps: float = 0.0) -> MachineProfile:
    """A 2-core CPU box whose matmul rate puts `tiny` (4 x 128 tokens) near the reported 366 ms step."""
    return dataclasses.replace(builtin("h100-box"), name="vm", accelerator="cpu", gpu_memory_bytes=0, cores=2,
                               matmul=[{"m": 1024, "k": 1024, "n": 1024, "tflops": 0.0152}], matmul_dtype="float32",
                               store_write_gbps=write_gbps, store_write_busy_gbps=busy_gbps)


def _run(plan: Plan, *, steps: int, step_s: float, writes: dict[int, list[tuple[int, float]]]) -> tuple[StageWatch, list[str]]:
    """Feed a watch ``steps`` steps of ``step_s`` seconds each, as train does (a step once the next has
    run). ``writes[k]``: step k's write-behind spans as (layer, seconds), one after the other from the
    middle of the step: a commit's writes beside the next compute, as the engine runs them."""
    tl = Timeline(keep_steps=None)
    for k in range(steps):
        t0 = k * step_s
        tl.add("compute", 0, t0, t0 + 0.9 * step_s, step=k)
        t = t0 + 0.5 * step_s
        for layer, secs in writes.get(k, []):
            tl.add("write_behind", layer, t, t + secs, step=k)
            t += secs
    watch, said = StageWatch(plan), []
    for k in range(steps - 1):
        msg = watch.after_step(tl, k, k + 1)
        if msg is not None:
            said.append(msg)
    return watch, said


def test_a_commit_that_reads_slow_beside_the_compute_of_faster_steps_says_nothing():
    """The reported tiny CPU run: steps at 296 ms against 366 planned, a 9 MiB commit every few steps
    written at 0.53 GB/s (calibrated 1.47) while the next step computes. The slow quotient costs no
    step time, so there is no warning, and the summary says the steps were faster than planned."""
    plan = make_plan(TrainConfig(model="tiny", micro_batch_size=4, seq_len=128), _profile(write_gbps=1.47))
    assert 0.3 < plan.step.step_s < 0.45 and "disk" not in plan.placement
    commit = plan.step.commits.bytes_per_commit
    assert 9 * 2**20 < commit < 10 * 2**20  # tiny's master, m and v
    step_s = plan.step.step_s * 296.2 / 365.7
    per_layer = commit / len(plan.placement) / 0.53e9
    writes = {k: [(i, per_layer) for i in range(len(plan.placement))] for k in range(0, 24, 4)}
    watch, said = _run(plan, steps=24, step_s=step_s, writes=writes)
    assert said == []
    assert watch.write_rates and max(watch.write_rates) < 0.55e9  # it did time the commits (at the full 9 MiB)
    assert watch.summary()[0] == f"step: measured {step_s * 1e3:,.1f} ms, planned {plan.step.step_s * 1e3:,.1f} ms"


def test_a_disk_too_slow_for_the_planned_step_warns_once_with_both_rates():
    """Disk layers written every step at an eighth of the calibrated rate: the writes outlast the
    planned step (the compute's, here) and the steps stretch to them."""
    plan = make_plan(small_config(placement="disk", durability="none"), _profile(write_gbps=1.5, busy_gbps=0.9))
    wrote = plan.step.disk_bytes_written
    assert plan.placement == ["disk"] * 4 and wrote >= MIN_RATE_BYTES
    planned_rate = 0.9e9  # the rate beside reads: disk layers write beside their read-ahead
    took = wrote / (planned_rate / 8)
    assert took > (1 + STEP_MARGIN) * plan.step.step_s  # the writes alone no longer fit in the planned step
    writes = {k: [(i, took / 4) for i in range(4)] for k in range(8)}
    _watch, said = _run(plan, steps=8, step_s=took * 1.1, writes=writes)
    assert len(said) == 1, said
    assert "the disk writes at 0.11 GB/s, calibrated 0.90 GB/s (machine profile 'vm')" in said[0]
    assert f"steps take {took * 1.1 * 1e3:,.0f} ms, longer than the planned {plan.step.step_s * 1e3:,.0f} ms" in said[0]


@pytest.mark.parametrize("case", ["writes fit in the step", "too small to time"])
def test_slow_writes_that_do_not_lengthen_steps_or_cannot_be_timed_say_nothing(case):
    """Steps three times the planned length (the plan is off) with writes slower than calibrated: they
    fit inside the planned step (the compute is what is slow), or the step writes too few bytes for a
    rate (fixed costs per write would dominate the quotient)."""
    plan = make_plan(small_config(placement="disk", durability="none"), _profile(write_gbps=1.5, busy_gbps=0.9))
    planned = plan.step.step_s
    took = 0.9 * planned if case == "writes fit in the step" else 3 * planned
    if case == "too small to time":
        plan = dataclasses.replace(plan, step=dataclasses.replace(plan.step, disk_bytes_written=MIN_RATE_BYTES - 1))
    assert plan.step.disk_bytes_written / took < 0.9e9 * 2 / 3  # slower than the SLOW line either way
    writes = {k: [(i, took / 4) for i in range(4)] for k in range(8)}
    watch, said = _run(plan, steps=8, step_s=3.3 * planned, writes=writes)
    assert said == []
    assert (watch.write_rates == []) == (case == "too small to time")


def test_commits_that_stall_one_step_in_four_warn():
    """A RAM plan committing every 4 steps on a disk 500x slower than calibrated: most steps take
    the planned time, but each step after a commit waits out the rest of its writes. The median step
    looks as planned; the mean (what the run loses) does not, and that is what is judged."""
    plan = make_plan(TrainConfig(model="tiny", micro_batch_size=4, seq_len=128, commit_every=4), _profile(write_gbps=1.47))
    P, L = plan.step.step_s, len(plan.placement)
    per_layer = plan.step.commits.bytes_per_commit / L / (1.47e9 / 500)
    tl, t, starts = Timeline(keep_steps=None), 0.0, []
    for k in range(40):
        starts.append(t)
        tl.add("compute", 0, t, t + 0.9 * P, step=k)
        t += max(P, per_layer * L - 3 * P) if k % 4 == 0 and k else P
    for k in range(3, 40, 4):  # committed at the end of steps 3, 7, ...: one layer after another
        w = starts[k] + 0.9 * P
        for i in range(L):
            tl.add("write_behind", i, w, w + per_layer, step=k)
            w += per_layer
    watch = StageWatch(plan)
    said = [m for k in range(38) if (m := watch.after_step(tl, k, k + 1)) is not None]
    assert sorted(watch.step_seconds)[len(watch.step_seconds) // 2] == pytest.approx(P)  # the median step: as planned
    assert len(said) == 1 and "the disk writes at" in said[0] and "longer than the planned" in said[0], said
