"""Pick a kernel's launch configuration by timing a few candidates once per problem key.

Hand-tuned kernels (flash attention) ship a short list of tile configurations that compile
without heavy register spills on the target GPU; which one is fastest depends on the shapes and
the device. The first launch for a key times every candidate (a candidate that fails to compile
or launch is skipped) and remembers the fastest; later launches reuse it. Unlike
``triton.autotune`` this is plain Python around the launch, so the CPU tests run the same code
path in Triton's interpreter with a substituted clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from mtc.errors import KernelInputError

__all__ = ["Tuner", "cuda_bench_ms"]


def cuda_bench_ms(fn: Callable[[], None]) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))


class Tuner:
    """Remembers the fastest candidate configuration per key."""

    def __init__(self, name: str, bench: Callable[[Callable[[], None]], float] = cuda_bench_ms) -> None:
        self.name = name
        self.bench = bench
        self.best: dict[Hashable, Any] = {}
        self.timings: dict[Hashable, list[tuple[Any, float | None]]] = {}

    def choose(self, key: Hashable, candidates: Sequence[Any], launch: Callable[[Any], None]) -> Any:
        """The best of ``candidates`` for ``key``, timing each with ``launch(candidate)`` on first use.

        A candidate that raises (out of shared memory, a compile error) is recorded with no time.
        Raises KernelInputError if every candidate fails, with the first failure as its cause.
        """
        if key in self.best:
            return self.best[key]
        if len(candidates) == 1:
            self.best[key] = candidates[0]
            return candidates[0]
        results: list[tuple[Any, float | None]] = []
        first_error: Exception | None = None
        for cand in candidates:
            try:
                results.append((cand, self.bench(lambda c=cand: launch(c))))
            except Exception as e:  # noqa: BLE001  (any launch failure just disqualifies the candidate)
                results.append((cand, None))
                first_error = first_error or e
        timed = [(c, t) for c, t in results if t is not None]
        if not timed:
            raise KernelInputError(f"{self.name}: no launch configuration works for {key}: {first_error}") from first_error
        self.timings[key] = results
        self.best[key] = min(timed, key=lambda ct: ct[1])[0]
        return self.best[key]
