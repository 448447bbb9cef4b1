"""Kernel launches per layer call, and the CUDA-graph replay variant of a compiled joint graph
(helpers of bench_fusion.py).

Launches are counted two ways: on any machine, the CPU-countable proxy (kernel-invoking nodes of
a compiled graph, `mtc.compiler.launches`; for a replayed graph, its input copies + one graph
launch + its output clones, `mtc.runtime.graph_replay.launches_per_replay`); on CUDA, also the
kernels the profiler sees in one call (torch.compile's included: its count cannot be read off a
graph). A replayed graph's kernels still show one by one in the profiler, but the host issues one
launch for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from mtc.compiler import launches
from mtc.runtime.graph_replay import CudaGraphCapture, GraphRunner, launches_per_replay
from mtc.runtime.runners import CompiledRunner


def kernel_table(fn: Callable[[], Any], top: int = 80) -> dict:
    """CUDA time per kernel name over one call of ``fn`` (torch.profiler), largest first, and the
    total: wall time minus the total is time the GPU sat idle (launch and Python overhead)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:120], "calls": e.count, "ms": us / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"gpu_ms_total": sum(r["ms"] for r in rows), "top": rows[:top], "timeline": idle_gaps(spans)}


def idle_gaps(spans: list[tuple[str, float, float]], top: int = 6) -> dict:
    """Where the GPU idles inside one call: from (name, start_us, end_us) of its device activities
    (kernels, copies, memsets; overlapping ones merge), the span from the first start to the last
    end, the time nothing ran in it, and the ``top`` longest gaps with the activities on either
    side (a gap after a graph's copies is the replay's launch; one before a cuDNN kernel, its host
    work). Time outside the span (the host's launch and sync) is the median's wall less the span."""
    if not spans:
        return {"span_ms": 0.0, "idle_ms": 0.0, "gaps": []}
    spans = sorted(spans, key=lambda s: s[1])
    gaps, end, last = [], spans[0][2], spans[0][0]
    for name, a, b in spans[1:]:
        if a > end:
            gaps.append({"ms": (a - end) / 1e3, "after": last[:80], "before": name[:80]})
        if b >= end:
            end, last = b, name
    gaps.sort(key=lambda g: -g["ms"])
    return {"span_ms": (end - spans[0][1]) / 1e3, "idle_ms": sum(g["ms"] for g in gaps), "gaps": gaps[:top]}


def kernel_diff(base: dict, other: dict, top: int = 12) -> dict:
    """Where ``other`` (a `kernel_table`) spends GPU time differently from ``base``: per kernel name,
    ms in each and the difference, largest differences first, and the totals' difference."""
    a = {r["kernel"]: r for r in base["top"]}
    b = {r["kernel"]: r for r in other["top"]}
    rows = [{"kernel": k, "base_ms": a[k]["ms"] if k in a else 0.0, "other_ms": b[k]["ms"] if k in b else 0.0,
             "base_calls": a[k]["calls"] if k in a else 0, "other_calls": b[k]["calls"] if k in b else 0}
            for k in a.keys() | b.keys()]
    for r in rows:
        r["diff_ms"] = r["other_ms"] - r["base_ms"]
    rows.sort(key=lambda r: -abs(r["diff_ms"]))
    return {"gpu_ms_diff": other["gpu_ms_total"] - base["gpu_ms_total"], "top": rows[:top]}


# kernel names by what they compute (cuBLAS's nvjet / cutlass / xmma GEMMs, mtc's Triton matmul;
# cuDNN's and mtc's attention kernels); anything else is memory-bound work between them
_MATMUL_NAMES = ("nvjet", "gemm", "cutlass", "xmma", "cublas", "splitkreduce", "_fused_mm_kernel")
_ATTENTION_NAMES = ("sdpa", "cudnn", "flash", "fmha", "_attn_")


def kernel_class(name: str) -> str:
    """'matmul', 'attention' or 'other' for a profiled kernel's name."""
    n = name.lower()
    if any(k in n for k in _MATMUL_NAMES):
        return "matmul"
    return "attention" if any(k in n for k in _ATTENTION_NAMES) else "other"


def compute_floor(tables: dict[str, dict], medians: dict[str, float]) -> dict | None:
    """How fast any variant could be: each profiled variant's matmul and attention time (what all
    of them must compute; the rest is memory-bound work and idle time), the least of those as the
    floor, and the speed-ups over unfused and torch.compile a variant doing only that would reach.
    A goal above them cannot be met by fusing the rest (ms from `kernel_table`s, one call each)."""
    if not tables:
        return None
    split = {}
    for v, t in tables.items():
        ms = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for r in t["top"]:
            ms[kernel_class(r["kernel"])] += r["ms"]
        split[v] = ms
    floor_v = min(split, key=lambda v: split[v]["matmul"] + split[v]["attention"])
    floor = split[floor_v]["matmul"] + split[floor_v]["attention"]
    out = {"method": "per profiled variant, GPU ms of matmul, attention and other kernels over one call; floor: the least "
                     "matmul + attention sum; best_possible_vs_*: that variant's median over the floor",
           "split_ms": split, "floor_ms": floor, "floor_variant": floor_v}
    for v in ("unfused", "torch_compile"):
        if v in medians and floor > 0:
            out[f"best_possible_vs_{v}"] = medians[v] / floor
    return out


def print_kernel_table(variant: str, table: dict, median_ms: float, top: int = 25) -> None:
    """`kernel_table`'s figures as lines: GPU-busy time against the variant's median, then its top kernels."""
    print(f"  {variant}: GPU busy {table['gpu_ms_total']:.2f} ms of {median_ms:.2f} ms; top kernels:")
    for r in table["top"][:top]:
        print(f"    {r['ms']:9.3f} ms  x{r['calls']:<5d} {r['kernel'][:100]}")
    tl = table.get("timeline")
    if tl and tl["span_ms"] > 0:
        print(f"    timeline: span {tl['span_ms']:.3f} ms, idle inside it {tl['idle_ms']:.3f} ms; longest gaps:")
        for g in tl["gaps"]:
            print(f"      {g['ms']:7.3f} ms  after {g['after'][:50]}  before {g['before'][:50]}")


def profiled_kernels(fn: Callable[[], Any]) -> int:
    """GPU kernels (not copies or memsets) that one call of ``fn`` runs, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for n in names if not n.lower().startswith(("memcpy", "memset")))


def second_stage_launches(graph: Any) -> int:
    """Launches a compiled graph's column kernels add after their own (`mtc.compiler.second_stage_launches`)."""
    from mtc.compiler import second_stage_launches as count

    return count(graph)


def generated_bytes(graph: Any) -> int:
    """Bytes the generated kernels of a compiled graph read and write per call (their inputs'
    and outputs' sizes, each counted once per kernel): the memory traffic fusion is about, a CPU
    count to read beside the GPU times."""
    total = 0
    for n in graph.nodes:
        k = n.target
        if n.op != "call_function" or not hasattr(k, "out_specs"):
            continue
        for a in n.args:
            v = a.meta.get("val") if hasattr(a, "meta") else None
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
        total += sum(math.prod(s) * dt.itemsize for s, dt in k.out_specs)
    return total


def generated_kernels(graph: Any) -> dict[str, dict[str, Any]]:
    """Per generated kernel of a compiled graph (by the name the profiler shows): its mode
    (pointwise, row, column, rowcol), calls per graph call and bytes read and written per call."""
    out: dict[str, dict[str, Any]] = {}
    for n in graph.nodes:
        k = n.target
        if n.op != "call_function" or not hasattr(k, "out_specs"):
            continue
        nbytes = sum(a.meta["val"].numel() * a.meta["val"].element_size() for a in n.args
                     if hasattr(a, "meta") and isinstance(a.meta.get("val"), torch.Tensor))
        nbytes += sum(math.prod(s) * dt.itemsize for s, dt in k.out_specs)
        row = out.setdefault(k.__name__, {"mode": k.mode, "calls": 0, "bytes": 0})
        row["calls"] += 1
        row["bytes"] += nbytes
    return out


def kernel_bandwidth(kernels: dict[str, dict[str, Any]], table: dict) -> dict[str, dict[str, Any]]:
    """Each generated kernel's profiled time (a `kernel_table`) beside its bytes: GB/s achieved,
    to read against the device's memory bandwidth (which kernel shapes run near it, which not)."""
    rows = {r["kernel"]: r for r in table["top"]}
    out = {}
    for name, k in kernels.items():
        r = rows.get(name)
        if r is None or not r["ms"]:
            continue
        out[name] = {**k, "ms": r["ms"], "gb_per_s": k["bytes"] / (r["ms"] / 1e3) / 1e9}
    return out


def proxy_launches(ct: Any, t: Any) -> dict[str, int]:
    """The CPU proxy of one forward + backward call of a compiled template (its joint graph):
    eager (one launch per kernel-invoking node) and replayed as a CUDA graph."""
    n_out = 1 + t.n_aux_out
    return {"mtc_fused": launches(ct.joint_graph), "mtc_fused_graph": launches_per_replay(ct.joint_graph, t, "joint", ct.diff, n_out)}


def graph_variant(ct: Any, t: Any, args: list[torch.Tensor], gout: torch.Tensor,
                  device: torch.device) -> tuple[Callable[[], Any], GraphRunner]:
    """The compiled joint graph replayed as a CUDA graph, weights read in place (as the executor's
    ring slots are), activations and the incoming gradient copied in; and its runner (stats)."""
    weights = {a.untyped_storage().data_ptr() for a, i in zip(args, t.inputs, strict=True) if i.kind in ("param", "const")}
    runner = GraphRunner(CompiledRunner(ct, t), t, CudaGraphCapture(device))
    runner.bind_stable(lambda x: x.untyped_storage().data_ptr() in weights)
    joint = runner.joint(device)

    def replayed() -> Any:
        return joint(*args, gout)

    return replayed, runner
