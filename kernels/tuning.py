"""Pick a kernel's launch configuration by timing a few candidates once per problem key.

Hand-tuned kernels (flash attention) and generated column and rowcol kernels ship a short list
of launch configurations, the default one free of heavy register spills on the target GPU; which
one is fastest depends on the shapes, the device and the Triton version (a tile that spills under
one may win under another). The first launch for a key times every candidate (a candidate that
fails to compile or launch is skipped) and remembers the fastest; later launches reuse it. Unlike
``triton.autotune`` this is plain Python around the launch, so the CPU tests run the same code
path in Triton's interpreter with a substituted clock.

What a tuner chose is part of a compiled plan: `Tuner.recording` collects the decisions a
template's shapes needed as `Decisions` (plain JSON), the compiler stores them with the template,
and `Tuner.seed` hands them back to a later process, which then reuses them without timing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from mtc.errors import KernelInputError, PlanError

__all__ = ["Decisions", "Tuner", "cuda_bench_ms", "key_name", "tuning_input"]

_TUNING_SEED = 0x6D7463  # "mtc": a process's tuning inputs do not depend on the user's seed
_generators: dict[Any, Any] = {}  # device -> the tuning inputs' own generator


def tuning_input(v: Any, device: Any) -> Any:
    """A tensor to time a kernel on, laid out as ``v`` (a meta value) is: same shape, strides (a
    transposed view stays transposed: a kernel's speed depends on it) and dtype; floating values
    standard normal, others zero. The values come from a generator of their own, so compiling a
    plan in the middle of a run neither advances the user's random stream (dropout, sampling) nor
    depends on where it stood."""
    import torch

    # the storage the strides reach, filled flat and viewed: an expanded input (stride 0 over a
    # dimension of several) has elements that share memory, which an in-place fill refuses
    shape, stride = tuple(v.shape), v.stride()
    size = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
    flat = torch.empty(size, dtype=v.dtype, device=device)
    if not v.dtype.is_floating_point:
        return flat.zero_().as_strided(shape, stride)
    gen = _generators.get(flat.device)
    if gen is None:
        gen = _generators[flat.device] = torch.Generator(device=flat.device)
        gen.manual_seed(_TUNING_SEED)
    if v.dtype.itemsize == 1:  # fp8 has no normal_: drawn in fp32, rounded
        flat.copy_(torch.empty(size, device=flat.device).normal_(generator=gen))
    else:
        flat.normal_(generator=gen)
    return flat.as_strided(shape, stride)


def cuda_bench_ms(fn: Callable[[], None]) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))


def key_name(key: Hashable) -> str:
    """A problem key as it is stored: a tuple's parts joined by '/' (``('fwd', 64, True)`` -> 'fwd/64/True')."""
    return "/".join(map(str, key)) if isinstance(key, tuple) else str(key)


@dataclasses.dataclass(slots=True)
class Decisions:
    """The candidate chosen per problem key (`key_name`); candidates are JSON values (a config
    dict, a backend name)."""

    choices: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The decisions as a JSON-ready dict."""
        return {"format": "mtc-tuning", "choices": dict(sorted(self.choices.items()))}

    @classmethod
    def from_json(cls, doc: Any) -> Decisions:
        """Decisions from `to_json`'s dict; raises PlanError on anything else."""
        if not isinstance(doc, dict) or doc.get("format") != "mtc-tuning" or not isinstance(doc.get("choices"), dict):
            raise PlanError(f"stored tuning decisions must be {{'format': 'mtc-tuning', 'choices': {{...}}}}, got "
                            f"{str(doc)[:120]}; recompile the plan (`mtc compile`)")
        return cls(dict(doc["choices"]))


class Tuner:
    """Remembers the fastest candidate configuration per key; ``seconds``: time spent timing."""

    def __init__(self, name: str, bench: Callable[[Callable[[], None]], float] = cuda_bench_ms) -> None:
        self.name = name
        self.bench = bench
        self.best: dict[Hashable, Any] = {}
        self.timings: dict[Hashable, list[tuple[Any, float | None]]] = {}
        self.seeded: dict[str, Any] = {}  # decisions a compiled plan recorded, by key name
        self.seconds = 0.0
        self._recorders: list[Decisions] = []

    def seed(self, decisions: Decisions) -> None:
        """Take ``decisions`` (from a compiled plan) as known: their keys are not timed again."""
        self.seeded.update(decisions.choices)

    @contextlib.contextmanager
    def recording(self) -> Iterator[Decisions]:
        """Collect every decision looked up (chosen, recalled or timed) inside the block."""
        rec = Decisions()
        self._recorders.append(rec)
        try:
            yield rec
        finally:
            self._recorders.remove(rec)

    def _decided(self, key: Hashable, choice: Any) -> Any:
        self.best[key] = choice
        for rec in self._recorders:
            rec.choices[key_name(key)] = choice
        return choice

    def recall(self, key: Hashable, candidates: Sequence[Any]) -> Any | None:
        """The choice already made for ``key`` (in this process, or seeded from a plan), if it is
        among ``candidates``; else None, when it must be timed (candidates are never None)."""
        if key in self.best and self.best[key] in candidates:
            return self._decided(key, self.best[key])
        name = key_name(key)
        if name in self.seeded and self.seeded[name] in candidates:
            return self._decided(key, self.seeded[name])
        return None

    def choose(self, key: Hashable, candidates: Sequence[Any], launch: Callable[[Any], None]) -> Any:
        """The best of ``candidates`` for ``key``, timing each with ``launch(candidate)`` on first use.

        A candidate that raises (out of shared memory, a compile error) is recorded with no time.
        Raises KernelInputError if every candidate fails, with the first failure as its cause.
        """
        known = self.recall(key, candidates)
        if known is not None:
            return known
        if len(candidates) == 1:
            return self._decided(key, candidates[0])
        results: list[tuple[Any, float | None]] = []
        first_error: Exception | None = None
        t0 = time.perf_counter()
        try:
            for cand in candidates:
                try:
                    results.append((cand, self.bench(lambda c=cand: launch(c))))
                except Exception as e:  # noqa: BLE001  (any launch failure just disqualifies the candidate)
                    results.append((cand, None))
                    first_error = first_error or e
        finally:
            self.seconds += time.perf_counter() - t0
        timed = [(c, t) for c, t in results if t is not None]
        if not timed:
            raise KernelInputError(f"{self.name}: no launch configuration works for {key}: {first_error}") from first_error
        self.timings[key] = results
        return self._decided(key, min(timed, key=lambda ct: ct[1])[0])
