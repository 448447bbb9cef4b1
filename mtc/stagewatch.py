"""At run time: the engine's measured stages against the plan's, and a warning when a slow disk lengthens the steps.

`mtc train` with a machine profile (the last `mtc calibrate`, or one passed in) makes the plan of
its run and hands it to a `StageWatch`. After each step the watch reads the engine's own timeline
(`mtc.runtime.timeline`) for that step: compute, optimizer updates, copies and store writes,
each summed over its spans, the step's length (from one step's first compute to the next's) and
the wall time the store was being written. Once the run is past its first steps the watch warns,
once, when the disk is what makes steps longer than planned: the steps take longer than planned
by more than `STEP_MARGIN`, the store's writes alone take longer than the planned step (so they
cannot have hidden behind the rest of it), and the disk's measured write rate is below `SLOW` of
the profile's. A write rate is taken only from a step that wrote at least `MIN_RATE_BYTES`.
Write-behind overlaps the other work, so a slow rate alone is no reason to warn: a commit
written beside the compute may read slow (the two share the cores) and cost the step nothing.
`summary()` gives the measured vs predicted figure per stage, and for the step.
"""

from __future__ import annotations

import statistics

from mtc.planner import Plan
from mtc.runtime.timeline import Span, Timeline

__all__ = ["StageWatch"]

# timeline stages -> the plan's stage names
_STAGES = {"compute": ("compute",), "optimizer": ("update", "update_streamed"), "copies": ("h2d", "grad_d2h"),
           "disk writes": ("write_behind",)}
SLOW = 2 / 3  # warn below this fraction of the planned disk rate
# How much longer than planned the steps, and the store's writes alone, must take before the disk is
# said to lengthen them: above plan validation's spread (-4..+9 % on the disk-tier case in 3 runs)
# and the step-to-step jitter of a busy 2-core machine.
STEP_MARGIN = 0.2
# The fewest bytes a step must write for its write time to give a rate. The store's write path costs
# about 1.2 ms per write of a layer's three arrays whatever their size (CRC32C, fsync, the hand-off
# to an I/O thread: 10 KiB took 1.18 ms on the 2-core VM, 1 MiB 1.53 ms, 3 MiB 2.45 ms, 9 MiB
# 6.3 ms, written alone); below 4 MiB that fixed cost is a third or more of the time at ~1.5 GB/s,
# so the quotient falls to the SLOW line by itself and says nothing about the disk.
MIN_RATE_BYTES = 4 * 2**20
MIN_SAMPLES = 2  # steps (and rates) needed before judging: one step can be an outlier


class StageWatch:
    """Per-step stage times of a run, compared with its plan."""

    def __init__(self, plan: Plan, *, skip_steps: int = 2) -> None:
        self.plan = plan
        self.skip_steps = skip_steps  # the first steps warm caches and allocators up
        self.seen: dict[str, list[float]] = {k: [] for k in _STAGES}
        self.step_seconds: list[float] = []  # each recorded step's length (where the next step's start is known)
        self.write_wall: list[float] = []  # seconds per step the store was being written (overlapping spans once)
        self.write_bytes: list[int] = []  # bytes the plan says each recorded step wrote
        self.write_rates: list[float] = []  # bytes/s of the steps that wrote at least MIN_RATE_BYTES
        self.warned = False

    def after_step(self, timeline: Timeline, step: int, steps_done: int) -> str | None:
        """Record step ``step`` (its spans are complete once its updates and writes are, and the next
        step has started); return a warning the first time a slow disk makes steps longer than planned."""
        if steps_done <= self.skip_steps:
            return None
        for name, stages in _STAGES.items():
            self.seen[name].append(sum(timeline.seconds(s, step=step) for s in stages))
        length = _step_length(timeline, step)
        if length is not None:
            self.step_seconds.append(length)
        writes = timeline.spans("write_behind", step=step)
        took, wrote = _wall_seconds(writes), self._bytes_written(writes)
        self.write_wall.append(took)
        self.write_bytes.append(wrote)
        if wrote >= MIN_RATE_BYTES and took > 0:
            self.write_rates.append(wrote / took)
        planned_rate = self._write_rate()
        if self.warned or not planned_rate or len(self.step_seconds) < MIN_SAMPLES or len(self.write_rates) < MIN_SAMPLES:
            return None
        planned_step = self.plan.step.step_s
        # means, not medians: a slow commit every few steps stalls one step in so many (what the run
        # loses is the mean), and its writes are spread over the steps between
        step_s = statistics.fmean(self.step_seconds)
        disk_s = statistics.fmean(self.write_wall)
        if min(step_s, disk_s) <= (1 + STEP_MARGIN) * planned_step:
            return None  # steps as planned, or the writes fit inside the planned step: the disk costs nothing
        rate = statistics.median(self.write_rates)
        if rate >= SLOW * planned_rate:
            return None  # the disk is as calibrated: the plan is off elsewhere
        self.warned = True
        mib = statistics.fmean(self.write_bytes) / 2**20
        return (f"the disk writes at {rate / 1e9:.2f} GB/s, calibrated {planned_rate / 1e9:.2f} GB/s "
                f"(machine profile {self.plan.profile.name!r}): a step's writes ({mib:,.0f} MiB) take {disk_s * 1e3:,.0f} ms, "
                f"so steps take {step_s * 1e3:,.0f} ms, longer than the planned {planned_step * 1e3:,.0f} ms; re-run "
                "`mtc calibrate --dir <store's disk>` if the disk changed, or check what else is using it")

    def _bytes_written(self, writes: list[Span]) -> int:
        """Bytes the step of ``writes`` put in the store: its disk layers' state (every step), and a
        commit's volume if it wrote a layer held elsewhere (the plan averages commits over the steps
        between them, which would make a commit step's rate look slower by that factor)."""
        st = self.plan.step
        if not writes:
            return 0
        averaged = st.commits.bytes_per_commit // st.commits.every if st.commits.every else 0
        disk_layers = st.disk_bytes_written - averaged
        placement = self.plan.placement
        committed = any(0 <= w.layer < len(placement) and placement[w.layer] != "disk" for w in writes)
        return disk_layers + (st.commits.bytes_per_commit if committed else 0)

    def _write_rate(self) -> float:
        """Bytes/s the profile measured for the store's writes as this run makes them: disk layers
        write beside their read-ahead, so at the rate calibrate measured with reads beside it (the
        cost model instead shares the disk at the joint rate: a write's span, timed here, is what
        that figure describes)."""
        prof = self.plan.profile
        return (prof.store_write_busy if "disk" in self.plan.placement else prof.store_write_gbps) * 1e9

    def summary(self) -> list[str]:
        """Measured (median over the recorded steps) vs predicted step length and busy time per stage."""
        st = self.plan.step.stages()
        rate = self._write_rate()  # the plan's writes timed at it, as the spans measure them
        pred = {"compute": st.get("GPU compute", st.get("compute (CPU)", 0.0)), "optimizer": st.get("CPU optimizer", 0.0),
                "copies": st.get("PCIe", st.get("host copies (memcpy)", 0.0)),
                "disk writes": self.plan.step.disk_write_s * self.plan.profile.store_write_gbps * 1e9 / rate if rate else 0.0}
        out = []
        if self.step_seconds:
            out.append(f"step: measured {statistics.median(self.step_seconds) * 1e3:,.1f} ms, "
                       f"planned {self.plan.step.step_s * 1e3:,.1f} ms")
        for name, vals in self.seen.items():
            if vals:
                out.append(f"{name}: measured {statistics.median(vals) * 1e3:,.1f} ms per step, planned {pred[name] * 1e3:,.1f} ms")
        return out


def _step_length(timeline: Timeline, step: int) -> float | None:
    """Seconds from ``step``'s first compute to the next step's: the step as the run lives it, stalls
    included (None before the next step has computed, or without compute spans)."""
    starts = [min((s.start for s in timeline.spans("compute", step=k)), default=None) for k in (step, step + 1)]
    if starts[0] is None or starts[1] is None:
        return None
    return starts[1] - starts[0]


def _wall_seconds(spans: list[Span]) -> float:
    """Wall time covered by ``spans`` (writes on several I/O threads at once count once): the time
    the store was being written, which bytes are divided by for the disk's rate."""
    total, end = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.end > end:
            total += s.end - max(s.start, end)
            end = s.end
    return total
