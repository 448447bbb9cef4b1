"""AdamW on the host over one layer's flat fp32 state, in cache-sized chunks across threads.

A layer's master weights, Adam m and v are flat 1-D fp32 tensors in host RAM; the CPU updates them
while the GPU streams other layers. `adamw_flat_` cuts the flat arrays into chunks of
``chunk_numel`` elements and runs the whole update on one chunk before the next, so the nine
element-wise passes of torch's single-tensor AdamW hit the cache instead of RAM, and (with a ``pool``)
spreads the chunks over threads: torch's CPU kernels release the GIL. Two implementations:

- ``impl="exact"`` calls `mtc.kernels.adamw_ref.adamw_step_ref` per chunk: torch.optim.AdamW's
  single-tensor path op for op. Element-wise ops do not depend on where a tensor is cut, so the
  result equals ``torch.optim.AdamW(foreach=False, fused=False)`` bit for bit, whatever the
  chunking or the number of threads.
- ``impl="fused"`` calls torch's own one-pass CPU kernel ``torch._fused_adamw_`` per chunk. It
  computes ``param - step_size * m / denom`` in another order than ``addcdiv_`` and is only close:
  after 10 steps on 1M params (|p| ~ 0.02, bench/bench_adamw.py) 3.3% of the elements differed
  from single-tensor AdamW, by at most 7.5e-9 absolute, 6.2e-4 relative element-wise (on
  near-zero weights). Its vector body and scalar tail round differently, so every cut it sees is
  aligned (`FUSED_ALIGN`): chunks of any multiple of it, any number of threads, and whole tensors
  give the same bits. A clip coefficient that fired is applied inside the kernel (its
  ``grad_scale`` divides: by 1 / coef), not by a separate pass over the gradient.

A clip coefficient of exactly 1.0 (the norm was under the limit) is not multiplied by in either
implementation: x * 1.0 == x bit for bit. How an update uses the cores (chunks over a pool, or
chunks or whole tensors on the calling thread with torch's intra-op threads) is timed on the
machine at the engine's start when a layer is large (`tune_strategy`, `HostStrategy`).

Measured on the 2-core CPU box (AMD EPYC VM, torch 2.13 CPU, bench/bench_adamw.py --numel 4000000
--threads 2, grad scaling on; medians of 15; G params/s without / with the bf16 compute copy;
before the clip coefficient went into the fused kernel, see bench/results/ for later runs):

    exact, pool of 2, 256K chunks (default)    0.57 / 0.54
    exact, pool of 2, 64K / 16K / 1M chunks    0.43 / 0.15 / 0.54
    exact, no pool, 256K chunks, 2 intra-op    0.56 / 0.50
    exact, whole tensors, 2 intra-op threads   0.46 / 0.42
    torch.optim.AdamW single-tensor            0.43 / 0.39  (copy as a separate pass)
    fused, pool of 2, 256K chunks              1.15 / 0.96
    fused, whole tensors, 2 intra-op threads   1.32 / 1.02
    torch.optim.AdamW(fused=True)              1.20 / 0.96
    with 1 thread: exact 256K chunks 0.38, whole tensors 0.30; fused 256K chunks 0.93

So cutting into cache-sized chunks is worth ~1.25x for the exact path, one intra-op thread per
pool worker is as fast as torch's intra-op threads on these two cores, and fused is ~2x faster.
``DEFAULT_IMPL`` is "exact": "fused" would be the default only if it were both faster and within
1e-6 relative of torch's single-tensor AdamW after 10 steps, and element-wise it is not (6.2e-4).
For scale, the 16-core GPU box measured torch's fused CPU AdamW at 5.1 G params/s alone, 2.7
while PCIe copies run; the exact path has not been measured there yet.

Threads: a pool thread's first chunk switches that thread to one intra-op thread (a thread-local
setting that stays): chunks are the parallelism, and a thread that let each op fan out over every
core would oversubscribe the machine. Without a pool the chunks run on the calling thread, each
op with torch's own intra-op parallelism.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Literal

import torch

from mtc.errors import KernelInputError
from mtc.kernels.adamw_ref import adamw_step_ref

__all__ = ["DEFAULT_CHUNK_NUMEL", "DEFAULT_IMPL", "FUSED_ALIGN", "HostStrategy", "Impl", "TUNE_MIN_NUMEL", "adamw_flat_", "best_impl",
           "host_pool", "tune_strategy"]

Impl = Literal["exact", "fused"]
DEFAULT_IMPL: Impl = "exact"
# 256K elements (1 MiB per array): every chunk costs ~50 us of Python, mostly under the GIL, which
# the threads share; 16K chunks ran ~4x slower than 256K on the 2-core box, 64K 1.3x slower, and
# 1M no faster. On the 16-core box re-measure with bench/bench_adamw.py --chunk ...
DEFAULT_CHUNK_NUMEL = 1 << 18
# Per-thread denom scratch is kept between calls only up to this size (16 MiB); a caller that runs
# whole tensors as one chunk gets a temporary instead, as torch itself would allocate.
_SCRATCH_KEEP_NUMEL = 1 << 22

# torch's fused kernel runs a vector body and a scalar tail that round differently, so its bits
# depend on where each call starts and ends. Every cut it sees is a multiple of this (the widest
# vector, AVX-512's 16 floats, unrolled 4x), except the weight-decay boundary, after which the
# undecayed part runs to the next multiple in a call of its own: chunks of any multiple of it, or
# whole tensors (`HostStrategy`), then give the same bits.
FUSED_ALIGN = 64

_local = threading.local()


def best_impl() -> Impl:
    """The implementation `adamw_flat_` uses by default, and why (see the module docstring)."""
    return DEFAULT_IMPL


@dataclasses.dataclass(frozen=True, slots=True)
class HostStrategy:
    """How `adamw_flat_` spreads a layer's update over the cores: chunks of ``chunk_numel`` over
    a pool's threads (one intra-op thread each), or (``pooled`` False) on the calling thread with
    torch's intra-op threads inside each kernel, in chunks or (``chunk_numel`` 0) whole tensors."""

    pooled: bool = True
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    rates: tuple[tuple[str, float], ...] = ()  # (candidate, G params/s) as timed by `tune_strategy`

    @property
    def name(self) -> str:
        """A short label: ``pool/262144``, ``caller/262144`` or ``whole``."""
        if not self.chunk_numel:
            return "whole"
        return f"{'pool' if self.pooled else 'caller'}/{self.chunk_numel}"

    def describe(self, impl: str) -> str:
        """One line for the run's log: the implementation, this choice, and what each candidate measured."""
        timed = ", ".join(f"{k} {r:.2f}" for k, r in self.rates)
        return f"host AdamW ({impl}): {self.name}" + (f" (timed, G params/s: {timed})" if timed else " (the default, not timed)")

    def run(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
            pool: ThreadPoolExecutor | None, threads: int, **kw: object) -> None:
        """`adamw_flat_` with this strategy (``threads``: the intra-op threads of a call on the calling
        thread, which keeps that setting)."""
        chunk = self.chunk_numel or max(1, param.numel())
        if self.pooled:
            adamw_flat_(param, grad, exp_avg, exp_avg_sq, pool=pool, chunk_numel=chunk, **kw)
            return
        if torch.get_num_threads() != threads:  # this thread's setting (a pool worker may have changed the default)
            torch.set_num_threads(threads)
        adamw_flat_(param, grad, exp_avg, exp_avg_sq, pool=None, chunk_numel=chunk, **kw)


# Below this many parameters in its largest layer a run keeps the default: the update is short,
# and timing the candidates would cost more than it saves.
TUNE_MIN_NUMEL = 4_000_000


def tune_strategy(impl: Impl, pool: ThreadPoolExecutor, threads: int, numel: int, *,
                  compute_dtype: torch.dtype | None = None, repeats: int = 3) -> HostStrategy:
    """Time `adamw_flat_`'s ways to use the cores on ``numel`` scratch parameters (with a compute
    copy of ``compute_dtype``, as the engine runs it) and return the fastest.

    Pooled chunks keep each chunk's passes in cache and take any idle core (no barrier), but cost
    a Python call per chunk under the GIL; chunks on the calling thread with intra-op threads take
    one call per op and chunk, and pay a fork and join per op; whole tensors take one call per op
    and no cache reuse between passes (``fused`` makes one pass anyway). Which wins depends on the
    machine: on the 2-core VM (bench/bench_adamw.py, 4M params, the bf16 copy) exact ran 0.48 /
    0.72 / 0.69 G params/s pooled / caller / whole, fused 1.26 / 1.55 / 1.86. Each candidate runs
    once untimed before each timed call: intra-op threads spin for a while after a call and would
    slow whichever ran next. All candidates give the same bits (`FUSED_ALIGN`).
    """
    if numel <= 0:
        return HostStrategy()
    g = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=g) * 0.02
    grad = torch.randn(numel, generator=g) * 1e-3
    m, v = torch.zeros(numel), torch.zeros(numel)
    out = torch.empty(numel, dtype=compute_dtype) if compute_dtype is not None and compute_dtype != torch.float32 else None
    coef = torch.tensor(0.9999)  # clipping fires: the slower case
    candidates = [HostStrategy(True, DEFAULT_CHUNK_NUMEL), HostStrategy(False, DEFAULT_CHUNK_NUMEL), HostStrategy(False, 0)]
    if impl == "fused":  # one pass per element: larger chunks cost fewer calls and lose no cache reuse
        candidates.insert(1, HostStrategy(True, 4 * DEFAULT_CHUNK_NUMEL))
    caller = torch.get_num_threads()
    times: dict[str, list[float]] = {c.name: [] for c in candidates}
    step = 0
    try:
        for r in range(repeats + 1):  # interleaved rounds; the first warms up (threads, page faults)
            for c in candidates:
                for timed in (False, True):
                    step += 1
                    t = time.perf_counter()
                    c.run(p, grad, m, v, pool=pool, threads=threads, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, step=step, decay_numel=numel * 9 // 10, grad_scale=coef, compute_out=out, impl=impl)
                    if r and timed:
                        times[c.name].append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(caller)
    rates = tuple((c.name, numel / min(times[c.name]) / 1e9) for c in candidates)
    best = max(candidates, key=lambda c: dict(rates)[c.name])
    return dataclasses.replace(best, rates=rates)


def host_pool(threads: int) -> ThreadPoolExecutor:
    """A thread pool for `adamw_flat_` with ``threads`` workers (about one per free core)."""
    if threads < 1:
        raise KernelInputError(f"host_pool: threads must be >= 1, got {threads}; use about one per core left free by the engine")
    return ThreadPoolExecutor(threads, thread_name_prefix="mtc-adamw")


def adamw_flat_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decay_numel: int,
    grad_scale: torch.Tensor | float | None = None,
    compute_out: torch.Tensor | None = None,
    pool: ThreadPoolExecutor | None = None,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    impl: Impl = DEFAULT_IMPL,
) -> None:
    """One AdamW step, in place, on flat fp32 CPU state (``step`` counts from 1).

    Weight decay applies to ``param[:decay_numel]`` only (the ndim >= 2 parameters sit first).
    ``grad`` is multiplied in place by ``grad_scale`` first (the 0-dim clip coefficient, as
    ``clip_grad_norm_`` does). If ``compute_out`` is given (same numel, e.g. bf16 pinned memory),
    it receives ``param.to(compute_out.dtype)`` in the same chunk pass. Chunks run on ``pool``'s
    threads, or on the calling thread without one.
    """
    coef = _check(param, grad, exp_avg, exp_avg_sq, compute_out, grad_scale, step, decay_numel, chunk_numel, impl)
    n = param.numel()
    if n == 0:
        return
    hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    step_t = torch.tensor(float(step)) if impl == "fused" else None  # read-only, shared by the threads
    scale = float(coef) if coef is not None else 1.0
    if scale == 1.0:
        # clipping did not fire: x * 1.0 == x bit for bit, so the multiply (a full read and write
        # of the gradient, ~20 % of a fused update's memory traffic) is skipped, not approximated
        coef = None
    elif impl == "fused" and 0.0 < scale and math.isfinite(1.0 / scale):
        # clipping fired: the kernel divides by its grad_scale as it reads the gradient (AMP's
        # unscale; it stores the scaled gradient back, as the multiply would), saving that pass;
        # x / (1 / c) rounds differently from x * c, as fused rounds differently anyway
        coef = _Reciprocal(torch.tensor(1.0 / scale))

    def run(a: int) -> None:
        b = min(a + chunk_numel, n)
        p, g, m, v = param[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b]
        c = compute_out[a:b] if compute_out is not None else None
        decay = min(max(decay_numel - a, 0), b - a)
        if impl == "exact":
            adamw_step_ref(p, g, m, v, **hp, step=step, decay_numel=decay, grad_scale=coef, denom=_scratch(b - a), compute_copy=c)
        else:
            # the undecayed part first runs up to the next aligned element, wherever the chunks are cut
            aligned = min(max(-(-decay_numel // FUSED_ALIGN) * FUSED_ALIGN - a, decay), b - a)
            _fused_chunk(p, g, m, v, **hp, step_t=step_t, decay_numel=decay, aligned=aligned, grad_scale=coef, compute_copy=c)

    starts = range(0, n, chunk_numel)
    if pool is None:
        for a in starts:
            run(a)
        return
    caller_threads = torch.get_num_threads()  # also fixes the caller's own setting before workers change the default
    todo = iter(starts)  # shared: each worker takes the next chunk, so a slow thread does not hold the rest back
    width = min(len(starts), getattr(pool, "_max_workers", None) or os.cpu_count() or 1)
    futures = [pool.submit(_drain, todo, run) for _ in range(width)]
    # Wait for every worker before re-raising one's exception: none may still be writing the
    # caller's tensors when this returns.
    wait(futures)
    configured = [f.result() for f in futures]
    if any(configured):
        # torch.set_num_threads(1) in a worker also set the process default that threads started
        # later inherit; put it back to the caller's value (the caller's own setting is unchanged).
        torch.set_num_threads(caller_threads)


def _drain(todo: Iterator[int], run: Callable[[int], None]) -> bool:
    """Worker loop: run chunks until ``todo`` is empty; True if this call configured the thread."""
    configured = _single_threaded_ops()
    for a in todo:  # next() on a range iterator is atomic under the GIL
        run(a)
    return configured


def _single_threaded_ops() -> bool:
    """Give this thread one intra-op thread, once; True if it was changed now."""
    if getattr(_local, "single", False):
        return False
    torch.get_num_threads()  # runs torch's lazy per-thread init now, so it cannot later reset the 1
    torch.set_num_threads(1)
    _local.single = True
    return True


def _scratch(numel: int) -> torch.Tensor | None:
    """This thread's fp32 denom scratch of >= ``numel`` elements (None above the size worth keeping)."""
    if numel > _SCRATCH_KEEP_NUMEL:
        return None
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < numel:
        buf = _local.scratch = torch.empty(max(numel, DEFAULT_CHUNK_NUMEL), dtype=torch.float32)
    return buf


class _Reciprocal:
    """A clip coefficient handed to torch's fused kernel as the divisor it takes (1 / coef)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _fused_chunk(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    step_t: torch.Tensor | None, decay_numel: int, aligned: int, grad_scale: torch.Tensor | float | _Reciprocal | None,
    compute_copy: torch.Tensor | None,
) -> None:
    """One chunk through torch's fused CPU AdamW kernel: one call per weight-decay region, the
    undecayed one cut at ``aligned`` (see `FUSED_ALIGN`)."""
    inv = None
    if isinstance(grad_scale, _Reciprocal):  # the kernel's own grad_scale divides (AMP's unscale)
        inv = grad_scale.tensor
    elif isinstance(grad_scale, torch.Tensor) or (grad_scale is not None and grad_scale != 1.0):
        g.mul_(grad_scale)  # multiplied like clip_grad_norm_
    n = p.numel()
    for a, b, wd in ((0, decay_numel, weight_decay), (decay_numel, aligned, 0.0), (aligned, n, 0.0)):
        if b > a:
            torch._fused_adamw_(
                [p[a:b]], [g[a:b]], [m[a:b]], [v[a:b]], [], [step_t],
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False, grad_scale=inv,
            )
    if compute_copy is not None:
        compute_copy.copy_(p)


def _check(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    compute_out: torch.Tensor | None, grad_scale: torch.Tensor | float | None,
    step: int, decay_numel: int, chunk_numel: int, impl: str,
) -> torch.Tensor | float | None:
    """Raise `KernelInputError` on bad inputs; return the grad scale to use (a CPU tensor or float)."""
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if compute_out is not None:
        named["compute_out"] = compute_out
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"adamw_flat_: {name} must be a torch.Tensor, got {type(t).__name__}")
    n = param.numel()
    for name, t in named.items():
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != n:
            raise KernelInputError(
                f"adamw_flat_: {name} must be a contiguous 1-D tensor of {n} elements (param's numel), got shape "
                f"{tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}; pass the layer's flat buffer "
                f"(or .reshape(-1).contiguous() of it)"
            )
        if t.device.type != "cpu":
            raise KernelInputError(f"adamw_flat_: {name} is on {t.device}; the host optimizer updates CPU tensors only")
    for name in ("param", "grad", "exp_avg", "exp_avg_sq"):
        if named[name].dtype != torch.float32:
            raise KernelInputError(
                f"adamw_flat_: {name} must be float32 (the fp32 master state and gradient), got {named[name].dtype}; "
                f"accumulate gradients into an fp32 buffer"
            )
    if compute_out is not None and not compute_out.dtype.is_floating_point:
        raise KernelInputError(f"adamw_flat_: compute_out must be a floating dtype such as torch.bfloat16, got {compute_out.dtype}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise KernelInputError(f"adamw_flat_: step must be an int >= 1 (the count after this update), got {step!r}")
    if not 0 <= decay_numel <= n:
        raise KernelInputError(f"adamw_flat_: decay_numel must be in [0, {n}] (the decayed prefix of the flat state), got {decay_numel}")
    if chunk_numel < 1:
        raise KernelInputError(f"adamw_flat_: chunk_numel must be >= 1, got {chunk_numel}; the default is {DEFAULT_CHUNK_NUMEL}")
    if impl not in ("exact", "fused"):
        raise KernelInputError(f"adamw_flat_: impl must be 'exact' or 'fused', got {impl!r}")
    if impl == "fused" and not hasattr(torch, "_fused_adamw_"):
        raise KernelInputError(f"adamw_flat_: impl='fused' needs torch._fused_adamw_, missing in torch {torch.__version__}; use 'exact'")
    if isinstance(grad_scale, torch.Tensor):
        if grad_scale.numel() != 1 or not grad_scale.dtype.is_floating_point:
            raise KernelInputError(
                f"adamw_flat_: grad_scale must be a one-element floating tensor (the clip coefficient), got shape "
                f"{tuple(grad_scale.shape)} {grad_scale.dtype}"
            )
        # One device sync if the coefficient lives on the GPU; the update cannot start without it anyway.
        return grad_scale.reshape(()).to("cpu", torch.float32)
    return grad_scale
