"""A timeline of the engine's stages, recorded by the production code path.

Every stage of a step (weight fetch, host-to-device copy, compute, gradient copy, optimizer update,
write-behind, commit) records a span: which stage, which layer and micro-batch, on which thread,
and when it started and ended (host clock). Tests assert orderings and overlaps on it (the next
layer's copy starts before this layer's compute ends; updates run while later layers compute);
benchmarks sum it into a step-time breakdown. On CUDA a span measures the host side (enqueue, or a
wait); GPU-side time comes from CUDA events where the benchmark asks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

__all__ = ["Span", "Timeline"]


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One stage's interval on one thread."""

    stage: str
    step: int
    layer: int
    start: float
    end: float
    thread: str
    mb: int | None = None

    def overlaps(self, other: Span) -> bool:
        """Whether the two intervals share any time."""
        return self.start < other.end and other.start < self.end


class Timeline:
    """Thread-safe list of spans (appends are atomic under the GIL; a lock guards reads)."""

    def __init__(self, *, enabled: bool = True, keep_steps: int | None = 16) -> None:
        self.enabled = enabled
        self.keep_steps = keep_steps  # spans of older steps are dropped: a long run's memory stays flat
        self.step = 0
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def begin_step(self, step: int) -> None:
        """Spans recorded from now on belong to ``step`` (unless given one); forget old steps."""
        self.step = step
        if self.keep_steps is not None:
            with self._lock:
                self._spans = [s for s in self._spans if s.step > step - self.keep_steps]

    @contextlib.contextmanager
    def span(self, stage: str, layer: int = -1, mb: int | None = None, *, step: int | None = None) -> Iterator[None]:
        """Record the time the body takes as a span of ``stage``."""
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, layer, t0, time.perf_counter(), mb=mb, step=step)

    def add(self, stage: str, layer: int, start: float, end: float, *, mb: int | None = None, step: int | None = None) -> None:
        """Record a span measured elsewhere."""
        if self.enabled:
            sp = Span(stage, self.step if step is None else step, layer, start, end, threading.current_thread().name, mb)
            with self._lock:
                self._spans.append(sp)

    def spans(self, stage: str | None = None, *, step: int | None = None) -> list[Span]:
        """Recorded spans, optionally of one stage and/or one step, in start order."""
        with self._lock:
            out = [s for s in self._spans if (stage is None or s.stage == stage) and (step is None or s.step == step)]
        return sorted(out, key=lambda s: s.start)

    def clear(self) -> None:
        """Forget every span (benchmarks keep memory flat over long runs)."""
        with self._lock:
            self._spans.clear()

    def seconds(self, stage: str, *, step: int | None = None) -> float:
        """Total seconds spent in ``stage`` (summed over threads)."""
        return sum(s.end - s.start for s in self.spans(stage, step=step))
