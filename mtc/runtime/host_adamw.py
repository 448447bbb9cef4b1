"""AdamW on the host over one layer's flat fp32 state, in cache-sized chunks across threads.

A layer's master weights, Adam m and v are flat 1-D fp32 tensors in host RAM; the CPU updates them
while the GPU streams other layers. `adamw_flat_` cuts the flat arrays into chunks of
``chunk_numel`` elements and runs the whole update on one chunk before the next, so the nine
element-wise passes of torch's single-tensor AdamW hit the cache instead of RAM, and (with a ``pool``)
spreads the chunks over threads: torch's CPU kernels release the GIL. Two implementations:

- ``impl="exact"`` calls `mtc.kernels.adamw.adamw_step_ref` per chunk: torch.optim.AdamW's
  single-tensor path op for op. Element-wise ops do not depend on where a tensor is cut, so the
  result equals ``torch.optim.AdamW(foreach=False, fused=False)`` bit for bit, whatever the
  chunking or the number of threads.
- ``impl="fused"`` calls torch's own one-pass CPU kernel ``torch._fused_adamw_`` per chunk. It
  computes ``param - step_size * m / denom`` in another order than ``addcdiv_`` and is only close:
  after 10 steps on 1M params (|p| ~ 0.02, bench/bench_adamw.py) 3.3% of the elements differed
  from single-tensor AdamW, by at most 7.5e-9 absolute, 6.2e-4 relative element-wise (on
  near-zero weights). Its bits also depend on chunk boundaries that are not multiples of the CPU's
  vector width (its vector body and scalar tail round differently); for a fixed chunk_numel they
  do not depend on the number of threads.

Measured on the 2-core CPU box (AMD EPYC VM, torch 2.13 CPU, bench/bench_adamw.py --numel 4000000
--threads 2, grad scaling on; medians of 15; G params/s without / with the bf16 compute copy):

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

import numbers
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Literal

import torch

from mtc.errors import KernelInputError
from mtc.kernels.adamw import adamw_step_ref

__all__ = ["DEFAULT_CHUNK_NUMEL", "DEFAULT_IMPL", "Impl", "adamw_flat_", "best_impl", "host_pool"]

Impl = Literal["exact", "fused"]
DEFAULT_IMPL: Impl = "exact"
# 256K elements (1 MiB per array): every chunk costs ~50 us of Python, mostly under the GIL, which
# the threads share; 16K chunks ran ~4x slower than 256K on the 2-core box, 64K 1.3x slower, and
# 1M no faster. On the 16-core box re-measure with bench/bench_adamw.py --chunk ...
DEFAULT_CHUNK_NUMEL = 1 << 18
# Per-thread denom scratch is kept between calls only up to this size (16 MiB); a caller that runs
# whole tensors as one chunk gets a temporary instead, as torch itself would allocate.
_SCRATCH_KEEP_NUMEL = 1 << 22

_local = threading.local()


def best_impl() -> Impl:
    """The implementation `adamw_flat_` uses by default, and why (see the module docstring)."""
    return DEFAULT_IMPL


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

    def run(a: int) -> None:
        b = min(a + chunk_numel, n)
        p, g, m, v = param[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b]
        c = compute_out[a:b] if compute_out is not None else None
        decay = min(max(decay_numel - a, 0), b - a)
        if impl == "exact":
            adamw_step_ref(p, g, m, v, **hp, step=step, decay_numel=decay, grad_scale=coef, denom=_scratch(b - a), compute_copy=c)
        else:
            _fused_chunk(p, g, m, v, **hp, step_t=step_t, decay_numel=decay, grad_scale=coef, compute_copy=c)

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


def _fused_chunk(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    step_t: torch.Tensor | None, decay_numel: int, grad_scale: torch.Tensor | float | None,
    compute_copy: torch.Tensor | None,
) -> None:
    """One chunk through torch's fused CPU AdamW kernel (one call per weight-decay region)."""
    if isinstance(grad_scale, torch.Tensor) or (grad_scale is not None and grad_scale != 1.0):
        # Multiplied like clip_grad_norm_; the kernel's own grad_scale divides (AMP's unscale).
        g.mul_(grad_scale)
    n = p.numel()
    for a, b, wd in ((0, decay_numel, weight_decay), (decay_numel, n, 0.0)):
        if b > a:
            torch._fused_adamw_(
                [p[a:b]], [g[a:b]], [m[a:b]], [v[a:b]], [], [step_t],
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
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
