"""At run time: the engine's measured stages against the plan's, and a warning when the disk is slower.

`mtc train` with a machine profile (the last `mtc calibrate`, or one passed in) makes the plan of
its run and hands it to a `StageWatch`. After each step the watch reads the engine's own timeline
(`mtc.runtime.timeline`) for that step: compute, optimizer updates, copies and store writes,
each summed over its spans. Once the run is past its first steps, the disk's measured write rate
(bytes the step wrote to the store over the time its writes took) is compared with the profile's;
if it is below two thirds of it the watch warns, once, with both figures and what they mean for
the step time. `summary()` gives the measured vs predicted figure per stage.
"""

from __future__ import annotations

import statistics

from mtc.planner import Plan
from mtc.runtime.timeline import Timeline

__all__ = ["StageWatch"]

# timeline stages -> the plan's stage names
_STAGES = {"compute": ("compute",), "optimizer": ("update", "update_streamed"), "copies": ("h2d", "grad_d2h"),
           "disk writes": ("write_behind",)}
SLOW = 2 / 3  # warn below this fraction of the planned disk rate


class StageWatch:
    """Per-step stage times of a run, compared with its plan."""

    def __init__(self, plan: Plan, *, skip_steps: int = 2) -> None:
        self.plan = plan
        self.skip_steps = skip_steps  # the first steps warm caches and allocators up
        self.seen: dict[str, list[float]] = {k: [] for k in _STAGES}
        self.write_rates: list[float] = []
        self.warned = False

    def after_step(self, timeline: Timeline, step: int, steps_done: int) -> str | None:
        """Record step ``step`` (its spans are complete once its updates and writes are); return a
        warning the first time the disk writes slower than calibrated."""
        if steps_done <= self.skip_steps:
            return None
        for name, stages in _STAGES.items():
            self.seen[name].append(sum(timeline.seconds(s, step=step) for s in stages))
        wrote = self.plan.step.disk_bytes_written
        took = self.seen["disk writes"][-1]
        if wrote and took > 0:
            self.write_rates.append(wrote / took)
        planned = self._write_rate()
        if self.warned or len(self.write_rates) < 2 or not planned:
            return None
        rate = statistics.median(self.write_rates)
        if rate >= SLOW * planned:
            return None
        self.warned = True
        return (f"the disk writes at {rate / 1e9:.2f} GB/s, calibrated {planned / 1e9:.2f} GB/s "
                f"(machine profile {self.plan.profile.name!r}): each step writes {wrote / 2**20:,.0f} MiB, so steps take "
                f"longer than the planned {self.plan.step.step_s * 1e3:,.0f} ms; re-run `mtc calibrate --dir <store's disk>` if "
                "the disk changed, or check what else is using it")

    def _write_rate(self) -> float:
        """Bytes/s the profile measured for the store's writes as this run makes them: disk layers
        write beside their read-ahead, so at the rate calibrate measured with reads beside it (the
        cost model instead shares the disk at the joint rate: a write's span, timed here, is what
        that figure describes)."""
        prof = self.plan.profile
        return (prof.store_write_busy if "disk" in self.plan.placement else prof.store_write_gbps) * 1e9

    def summary(self) -> list[str]:
        """Measured (median over the recorded steps) vs predicted busy time per stage."""
        st = self.plan.step.stages()
        rate = self._write_rate()  # the plan's writes timed at it, as the spans measure them
        pred = {"compute": st.get("GPU compute", st.get("compute (CPU)", 0.0)), "optimizer": st.get("CPU optimizer", 0.0),
                "copies": st.get("PCIe", st.get("host copies (memcpy)", 0.0)),
                "disk writes": self.plan.step.disk_write_s * self.plan.profile.store_write_gbps * 1e9 / rate if rate else 0.0}
        out = []
        for name, vals in self.seen.items():
            if vals:
                out.append(f"{name}: measured {statistics.median(vals) * 1e3:,.1f} ms per step, planned {pred[name] * 1e3:,.1f} ms")
        return out
