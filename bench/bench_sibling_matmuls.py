"""Sibling matmuls as one: what merging q/k/v and gate/up projections would save, measured first.

A Llama block runs three projections of the same normed input (q, k, v) and two more (gate, up).
The engine lays each layer's weights out flat in first-use order, so wq, wk and wv (and w_gate,
w_up) sit next to each other in the weight slot, and one [sum of outputs, dim] matrix over them is
a view, not a copy. A compiler pass could then run each group as one matmul:

- forward: ``x @ [Wq; Wk; Wv]^T`` once, q / k / v as column slices of its output (no copy);
- input gradient: ``[dq dk dv] @ [Wq; Wk; Wv]`` once, instead of three products whose outputs the
  norm's backward kernel then sums (n - 1 fewer outputs written and read);
- weight gradient: ``[dq dk dv]^T @ x`` once, each weight's gradient a row slice.

Both gradients need the output gradients side by side in one buffer. Where their producers cannot
write into it (q's and k's come from RoPE's backward, v's from attention's), that is one more copy,
timed here as ``cat``. The k/v products are narrow (N = 1024 at 8192 tokens for Llama-8B, K = 1024
in their input gradients), where cuBLAS runs below its peak (the H200, 2026-11-26: 468 TFLOP/s at
M 8192, K 1024, N 4096 against 707 at K 4096), which merging would recover.

The pass is not built: issue 9's Llama block missed its goal by about 1 % (1.24x unfused / 1.04x
torch.compile, goal 1.25x / 1.05x, H200 2026-11-27), and whether merging wins that, and by how
much after the cat, is a GPU measurement. This script makes it on the shapes that matter: the
bench_fusion blocks (Llama-8B and Qwen2 at 8192 tokens) and bench_train's P1 (4 x 1024 tokens) and
P3 (16 x 1024) micro-batches, in the compute dtype (bf16 on CUDA). Per shape and group it times
each way (median of interleaved rounds), the passes over the input gradient that merging saves (the
norm's backward kernel reads one part instead of n: n - 1 passes, timed as a third of an add's) and
the cat, and prints the saving per joint call of a block (forward + backward; a forward-only call
or a recompute saves the forward part again) with and without the cat. A JSON record goes to
bench/results/.

    python bench/bench_sibling_matmuls.py                 # CUDA: every shape, ~20 s
    python bench/bench_sibling_matmuls.py --smoke         # CPU: tiny shapes, checks the merged results
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fusion import _time_all  # noqa: E402
from common import P1_SHAPE, P3_SHAPE, write_record  # noqa: E402

# (tokens per call, dim, head dim, heads, kv heads, ffn): the shapes the GPU benchmarks run
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "llama8b-block": (8192, 4096, 128, 32, 8, 14336),  # bench_fusion's llama block
    "qwen2-block": (8192, 3584, 128, 28, 4, 18944),  # bench_fusion's qwen2 block
    "P1": (4 * 1024, P1_SHAPE["dim"], P1_SHAPE["dim"] // P1_SHAPE["n_heads"], P1_SHAPE["n_heads"], P1_SHAPE["n_kv_heads"],
           P1_SHAPE["ffn_dim"]),
    "P3": (16 * 1024, P3_SHAPE["dim"], P3_SHAPE["dim"] // P3_SHAPE["n_heads"], P3_SHAPE["n_heads"], P3_SHAPE["n_kv_heads"],
           P3_SHAPE["ffn_dim"]),
}
SMOKE = {"smoke": (64, 64, 16, 4, 2, 160)}


def groups(dim: int, hd: int, heads: int, kv: int, ffn: int) -> dict[str, list[int]]:
    """Each group's projection widths (the rows of its weights; every weight has ``dim`` columns)."""
    return {"qkv": [heads * hd, kv * hd, kv * hd], "gate_up": [ffn, ffn]}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def merged_errors(x: torch.Tensor, ws: list[torch.Tensor], w_all: torch.Tensor, dys: list[torch.Tensor],
                  widths: list[int]) -> dict[str, float]:
    """Largest relative difference of each merged product (``w_all``: the group's weights as one
    matrix) from the separate ones (``ws``), forward, input and weight gradient."""
    dy_all = torch.cat(dys, dim=1)
    sep_dx = sum(dy @ w for dy, w in zip(dys, ws, strict=True))
    return {
        "fwd": max(_rel(a, x @ w.t()) for a, w in zip((x @ w_all.t()).split(widths, dim=1), ws, strict=True)),
        "dx": _rel(dy_all @ w_all, sep_dx),
        "dw": max(_rel(a, dy.t() @ x) for a, dy in zip((dy_all.t() @ x).split(widths, dim=0), dys, strict=True)),
    }


def measure_group(tokens: int, dim: int, widths: list[int], device: torch.device, dtype: torch.dtype,
                  rounds: int) -> dict[str, Any]:
    """One group's ways, timed: forward, input gradient and weight gradient, separate and merged,
    and the cat and sum that merging adds and removes. Merged results are checked against separate."""
    g = torch.Generator(device=device).manual_seed(0)
    n = sum(widths)
    flat = torch.randn(n * dim, generator=g, device=device, dtype=dtype) * dim**-0.5  # the weight slot, laid out flat
    ws = list(flat.view(n, dim).split(widths))  # each weight a view of the slot (rows after rows)
    w_all = flat.view(n, dim)  # the whole group: a view of the same memory
    x = torch.randn(tokens, dim, generator=g, device=device, dtype=dtype)
    dys = [torch.randn(tokens, w, generator=g, device=device, dtype=dtype) for w in widths]
    dy_all = torch.cat(dys, dim=1)
    fns: dict[str, Callable[[], Any]] = {
        "fwd_separate": lambda: [x @ w.t() for w in ws],
        "fwd_merged": lambda: (x @ w_all.t()).split(widths, dim=1),
        "dx_separate": lambda: [dy @ w for dy, w in zip(dys, ws, strict=True)],
        "dx_merged": lambda: dy_all @ w_all,
        "dw_separate": lambda: [dy.t() @ x for dy in dys],
        "dw_merged": lambda: (dy_all.t() @ x).split(widths, dim=0),
        "cat": lambda: torch.cat(dys, dim=1),  # the output gradients into one buffer
    }
    # one add of two input-gradient-sized tensors: three passes over [tokens, dim] (two reads, a write)
    outs = [torch.empty(tokens, dim, device=device, dtype=dtype) for _ in range(3)]
    fns["add"] = lambda: torch.add(outs[0], outs[1], out=outs[2])
    # bench_fusion's interleaved rounds (one call of each way per round, the order shuffled); on CUDA
    # the GPU span between events around each call, else the wall time
    timed = _time_all(fns, device, warmup=1, reps=rounds)
    t = {k: statistics.median([ms / 1e3 for ms in r["gpu_span_ms"]] or r["times_s"]) for k, r in timed.items()}
    errs = merged_errors(x, ws, w_all, dys, widths)
    flops = {"fwd": 2 * tokens * dim * n, "dx": 2 * tokens * dim * n, "dw": 2 * tokens * dim * n}
    rec: dict[str, Any] = {"widths": widths, "ms": {k: v * 1e3 for k, v in t.items()}, "max_rel_err": errs,
                           "tflops": {f"{k}_{way}": flops[k] / t[f"{k}_{way}"] / 1e12 for k in flops
                                      for way in ("separate", "merged")}}
    # separate, the norm's backward kernel reads n input-gradient parts and adds them; merged, it
    # reads one: n - 1 passes over [tokens, dim] saved, each a third of the add's time
    rec["dx_sum_saved_ms"] = t["add"] * (len(widths) - 1) / 3 * 1e3
    sep = t["fwd_separate"] + t["dx_separate"] + t["add"] * (len(widths) - 1) / 3 + t["dw_separate"]
    merged = t["fwd_merged"] + t["dx_merged"] + t["dw_merged"]
    rec["saved_ms_per_joint"] = (sep - merged) * 1e3  # output gradients written side by side by their producers
    rec["saved_ms_per_joint_with_cat"] = (sep - merged - t["cat"]) * 1e3  # ... or copied there
    rec["saved_ms_forward"] = (t["fwd_separate"] - t["fwd_merged"]) * 1e3  # each forward-only call (and a recompute)
    # the same dot products either way, so within the dtype's rounding
    rec["ok"] = all(e <= (2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4) for e in errs.values())
    return rec


def main() -> None:
    """Parse, time every shape's groups, print a table, write a record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in fp32 (checks, no figures)")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="default: all")
    ap.add_argument("--rounds", type=int, help="interleaved rounds, one call of each way per round (default 40 on CUDA, 3 smoke)")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMOKE if a.smoke else {k: SHAPES[k] for k in (a.shapes or SHAPES)}
    rounds = a.rounds or (3 if a.smoke else 40)
    if device.type == "cpu" and not a.smoke:  # (minutes of CPU time for figures that say nothing about a GPU)
        raise SystemExit("bench_sibling_matmuls: no GPU here; its figures are GPU timings. --smoke checks the script on the CPU")
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    print(f"{'shape':14s} {'group':8s} {'fwd sep/merged ms':>18s} {'dx sep(+sum)/merged':>18s} {'dw sep/merged':>14s} "
          f"{'cat ms':>7s} {'saved/joint ms':>15s} {'(with cat)':>10s}  TFLOP/s sep->merged (fwd, dx, dw)")
    for name, (tokens, dim, hd, heads, kv, ffn) in shapes.items():
        results[name] = {}
        for gname, widths in groups(dim, hd, heads, kv, ffn).items():
            r = measure_group(tokens, dim, widths, device, dtype, rounds)
            results[name][gname] = r
            ms, tf = r["ms"], r["tflops"]
            print(f"{name:14s} {gname:8s} {ms['fwd_separate']:8.3f}/{ms['fwd_merged']:<9.3f} "
                  f"{ms['dx_separate'] + r['dx_sum_saved_ms']:8.3f}/{ms['dx_merged']:<9.3f} {ms['dw_separate']:6.3f}/{ms['dw_merged']:<7.3f} "
                  f"{ms['cat']:7.3f} {r['saved_ms_per_joint']:15.3f} {r['saved_ms_per_joint_with_cat']:10.3f}  "
                  + ", ".join(f"{tf[k + '_separate']:.3g}->{tf[k + '_merged']:.3g}" for k in ("fwd", "dx", "dw"))
                  + ("" if r["ok"] else f"  MERGED RESULTS DIFFER: {r['max_rel_err']}"))
        both = sum(g["saved_ms_per_joint"] for g in results[name].values())
        both_cat = sum(g["saved_ms_per_joint_with_cat"] for g in results[name].values())
        print(f"{name:14s} both groups: {both:.3f} ms per block's joint call ({both_cat:.3f} with the cat)")
    print(f"total {time.perf_counter() - t0:.1f} s; saved > 0: merging is faster; 'with cat': the output gradients "
          "copied side by side, else written there by their producers")
    if not all(g["ok"] for s in results.values() for g in s.values()):
        raise SystemExit("merged matmuls disagree with separate ones beyond the dtype's rounding")
    if not a.no_record:
        print(f"record: {write_record('bench_sibling_matmuls' + ('-smoke' if a.smoke else ''), {'smoke': a.smoke, 'dtype': str(dtype), 'rounds': rounds, 'results': results})}")


if __name__ == "__main__":
    main()
