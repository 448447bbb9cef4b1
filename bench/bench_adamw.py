"""Host AdamW over one flat fp32 layer state: mtc's chunked kernels against torch.optim.AdamW.

Side by side on the same inputs (--numel params, the first 90% weight-decayed, grad scaling by a
0-dim clip coefficient of 0.9999: clipping fires), each with and without a bf16 compute copy:

- ``exact/pool``, ``fused/pool``: `adamw_flat_` with a pool of --threads workers (one intra-op
  thread each), chunks of --chunk elements (several values sweep the chunk size);
- ``exact/caller``, ``fused/caller``: `adamw_flat_` without a pool, same chunks, on the calling
  thread with torch's intra-op parallelism (--threads) inside each op;
- ``exact/whole``, ``fused/whole``: no pool, one chunk: torch's intra-op parallelism on whole tensors;
- ``torch/single``, ``torch/fused``: torch.optim.AdamW (foreach=False, fused=False / fused=True)
  on the same flat buffers, clip scaling by ``_foreach_mul_`` and the copy as a separate pass.

Then 10 steps from one start on fixed gradients: is each implementation bit-identical to torch's
single-tensor AdamW, and if not how far (max element-wise relative and absolute difference)?
Medians over --repeat interleaved rounds after a warm-up round; G params/s = numel / median seconds.

    python bench/bench_adamw.py --numel 4000000 --threads 2 --repeat 10
    python bench/bench_adamw.py --numel 100000000 --threads 16 --chunk 16384 65536 262144
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, write_record
from mtc.runtime.host_adamw import DEFAULT_CHUNK_NUMEL, adamw_flat_, host_pool

HP = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


class State:
    """One layer's flat fp32 state, gradient, clip coefficient and bf16 compute buffer."""

    def __init__(self, numel: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.param = torch.randn(numel, generator=gen) * 0.02
        self.grad = torch.randn(numel, generator=gen) * 1e-3
        self.m, self.v = torch.zeros(numel), torch.zeros(numel)
        # clipping fires (the slower case: at exactly 1.0 mtc skips the multiply), yet close enough
        # to 1 that repeated in-place scaling does not shrink the gradient into denormals
        self.coef = torch.tensor(0.9999)
        self.copy = torch.empty(numel, dtype=torch.bfloat16)


def mtc_step(impl: str, pool: Any, chunk: int, decay: int) -> Callable[[State, int, bool], None]:
    """A step function running `adamw_flat_` with these settings."""
    def step(s: State, t: int, copy: bool) -> None:
        adamw_flat_(s.param, s.grad, s.m, s.v, **HP, step=t, decay_numel=decay, grad_scale=s.coef,
                    compute_out=s.copy if copy else None, pool=pool, chunk_numel=chunk, impl=impl)
    return step


def torch_step(fused: bool, decay: int) -> Callable[[State, int, bool], None]:
    """A step function running torch.optim.AdamW over views of the state (optimizer built per State)."""
    opts: dict[int, tuple[torch.optim.Optimizer, list[torch.Tensor]]] = {}

    def step(s: State, t: int, copy: bool) -> None:
        if id(s) not in opts:
            # Parameters as views of the flat buffer: torch updates the same memory mtc does.
            ws = [torch.nn.Parameter(s.param[:decay]), torch.nn.Parameter(s.param[decay:])]
            for w, g in zip(ws, (s.grad[:decay], s.grad[decay:])):
                w.grad = g
            groups = [{"params": [ws[0]]}, {"params": [ws[1]], "weight_decay": 0.0}]
            opt = torch.optim.AdamW(groups, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                                    weight_decay=HP["weight_decay"], foreach=False, fused=fused)
            opts[id(s)] = (opt, [w.grad for w in ws])
        opt, grads = opts[id(s)]
        torch._foreach_mul_(grads, s.coef)  # what clip_grad_norm_ does to .grad
        opt.step()
        if copy:
            s.copy.copy_(s.param)
    return step


def timed(fns: dict[str, Callable[[State, int, bool], None]], s: State, copy: bool, repeat: int) -> dict[str, float]:
    """Median seconds per step of each function, interleaved: round r runs every function twice, times the second.

    Interleaving spreads a shared machine's noise over all implementations alike instead of
    penalising whichever happened to run during someone else's burst.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeat + 1):
        for name, fn in fns.items():
            # One untimed step first: after a function that used torch's intra-op threads, their
            # OpenMP workers spin-wait for a while and steal cores from whatever runs next
            # (measured: -40% for the first function of a round without this).
            fn(s, r + 1, copy)
            t0 = time.perf_counter()
            fn(s, r + 1, copy)
            if r >= 1:  # one warm-up round: scratch buffers, thread start-up, page faults
                times[name].append(time.perf_counter() - t0)
    return {name: median(ts) for name, ts in times.items()}


def accuracy(fns: dict[str, Callable[[State, int, bool], None]], numel: int, steps: int = 10) -> dict[str, dict[str, Any]]:
    """Each implementation against torch's single-tensor AdamW after ``steps`` steps on fixed random grads."""
    out: dict[str, torch.Tensor] = {}
    for name, fn in fns.items():
        s = State(numel, seed=1)
        gen = torch.Generator().manual_seed(2)
        for t in range(1, steps + 1):
            s.grad.copy_(torch.randn(numel, generator=gen) * 1e-3)
            s.coef = torch.tensor(0.5)  # a real clip coefficient here: the scaling must match too
            fn(s, t, False)
        out[name] = s.param
    ref = out["torch/single"]
    res = {}
    for name, p in out.items():
        d = (p - ref).abs()
        res[name] = {
            "bit_identical": bool(torch.equal(p, ref)),
            "max_abs_diff": d.max().item(),
            "max_rel_diff": (d / ref.abs().clamp_min(torch.finfo(torch.float32).tiny)).max().item(),
            "frac_elements_differ": (d > 0).double().mean().item(),
        }
    return res


def main() -> None:
    """Measure, print a table and write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=4_000_000, help="flat state size in params (default 4M)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="pool workers and intra-op threads")
    ap.add_argument("--repeat", type=int, default=10, help="timed steps per figure (default 10)")
    ap.add_argument("--chunk", type=int, nargs="+", default=[DEFAULT_CHUNK_NUMEL], help="chunk sizes in elements")
    ap.add_argument("--accuracy-numel", type=int, default=1_000_000, help="size of the 10-step bit-identity check")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    decay = a.numel * 9 // 10
    pool = host_pool(a.threads)
    fns: dict[str, Callable[[State, int, bool], None]] = {}
    for c in a.chunk:
        for impl in ("exact", "fused"):
            fns[f"{impl}/pool/{c}"] = mtc_step(impl, pool, c, decay)
    for impl in ("exact", "fused"):
        fns[f"{impl}/caller/{a.chunk[0]}"] = mtc_step(impl, None, a.chunk[0], decay)
        fns[f"{impl}/whole"] = mtc_step(impl, None, a.numel, decay)
    fns["torch/single"] = torch_step(False, decay)
    fns["torch/fused"] = torch_step(True, decay)

    s = State(a.numel, seed=0)
    rows = []
    print(f"numel {a.numel:,}  threads {a.threads}  repeat {a.repeat}")
    print(f"{'impl':<24}{'ms':>9}{'Gp/s':>8}{'ms +bf16':>10}{'Gp/s':>8}")
    plain, copied = timed(fns, s, False, a.repeat), timed(fns, s, True, a.repeat)
    for name in fns:
        t_plain, t_copy = plain[name], copied[name]
        rows.append({"impl": name, "median_s": t_plain, "gparams_s": a.numel / t_plain / 1e9,
                     "median_s_bf16_copy": t_copy, "gparams_s_bf16_copy": a.numel / t_copy / 1e9})
        print(f"{name:<24}{t_plain * 1e3:>9.2f}{a.numel / t_plain / 1e9:>8.3f}{t_copy * 1e3:>10.2f}{a.numel / t_copy / 1e9:>8.3f}")

    acc_numel = min(a.accuracy_numel, a.numel)
    acc_decay = acc_numel * 9 // 10
    acc_fns = {"torch/single": torch_step(False, acc_decay), "torch/fused": torch_step(True, acc_decay)}
    for impl in ("exact", "fused"):
        acc_fns[f"{impl}/pool"] = mtc_step(impl, pool, a.chunk[0], acc_decay)
    acc = accuracy(acc_fns, acc_numel)
    print(f"\n10 steps on {acc_numel:,} params against torch.optim.AdamW(foreach=False, fused=False):")
    for name, r in acc.items():
        print(f"  {name:<14} bit-identical {r['bit_identical']!s:<6} max abs {r['max_abs_diff']:.3g}  "
              f"max rel {r['max_rel_diff']:.3g}  elements differing {r['frac_elements_differ']:.4%}")
    pool.shutdown()
    path = write_record("bench_adamw", {"config": {**vars(a), **HP, "decay_numel": decay}, "results": rows,
                                        "accuracy_10_steps": {"numel": acc_numel, **acc}})
    print(f"record: {path}")


if __name__ == "__main__":
    main()
