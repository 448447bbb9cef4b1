"""The disk tier: training with all fp32 state on disk, the disk's raw speed vs the store's, host RAM per parameter.

One JSON record under bench/results/ (bench_disk_tier-...json) with:
  disk      raw throughput of the store's file system (O_DIRECT, 1 MiB blocks, 16 in flight;
            sequential write over a laid-out file, read, 50/50 mix) and the store's own I/O path
            on the same bytes (zarr format, CRC32C, fsync, --io-threads threads; writes in place,
            as the disk tier's steady state), in --disk-trials alternating raw/store pairs with
            cold caches (the disk is shared and noisy): every trial, the medians, and per mode the
            ratio of the medians (goal >= 0.9 for write, read and mix). First writes into new
            files (``write_fresh``) are reported beside them.
  train     a Llama shape with every layer on disk (durability full by default: the store is the
            tier; --durability none keeps one generation of it, updated in place), trained in a
            child process: median step time, model TFLOP/s (6 x params x tokens / step time), tokens
            per step (<= 1M), the store bytes per step and the GB/s they imply, the store's bytes on
            disk after the run, and host RAM per parameter (below).

Host RAM per parameter: the run is created (initial state written, one step) in one child
process; a second child resumes it and trains the measured steps. That child imports torch and
mtc, notes its RSS (the fixed baseline: interpreter, libraries), then joins a fresh cgroup v1
memory group limited to --limit-bytes-per-param x params (default 4), page cache included, and
drops the store's pages from the cache first (posix_fadvise DONTNEED on every store file): cold
caches, and the page cache cannot hold the state for it (the store reads and writes with O_DIRECT,
or drops its pages where O_DIRECT is refused). Everything the run allocates or caches after
joining is charged to the group: its peak (memory.max_usage_in_bytes) per parameter is the figure
(goal <= 4), with the group's cache/rss split at the end, its failcnt (times the limit forced
reclaim), the process's peak RSS over the baseline (VmHWM), and the engine's own count of its host
buffers (state tiers + fixed pipeline, by owner). Where no cgroup can be made, the record says so
and reports RSS over baseline plus the store files' resident page-cache pages (mincore).

Gradient accumulation: a stated rule until the planner (`mtc plan`) lands: enough tokens per step
that the model's compute at --target-tflops takes as long as the step's disk traffic at the raw
mixed throughput measured above, capped at 1M tokens per step.

    python bench/bench_disk_tier.py --smoke      # CPU, 48 layers, ~142M parameters (1.7 GB fp32 state), ~10 minutes
    python bench/bench_disk_tier.py              # CUDA: the 4.6B shape, all on disk (needs ~110 GB of disk)
    python bench/bench_disk_tier.py --shape 2.3b # CUDA: the largest whose two generations fit a 64 GB disk
    python bench/bench_disk_tier.py --durability none  # CUDA: the 4.6B shape's one generation (55 GB)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostmem
from common import LLAMA, P1_SHAPE, median, write_record
from mtc.store.diskbench import MODES, compare_throughput

from mtc.config import OptimConfig, TrainConfig
from mtc.data import write_token_file

SHAPES = {
    "4.6b": dict(P1_SHAPE),
    "2.3b": {**P1_SHAPE, "n_layers": 9},
    # 48 narrow layers: the largest layer is 1/48 of the model (at h=4096, 2.3B has 9 blocks of 218M
    # parameters; its fixed buffers are one 4M-element update chunk per ring set, not a whole layer)
    "smoke": {"dim": 512, "ffn_dim": 1408, "n_heads": 8, "n_kv_heads": 4, "n_layers": 48, "vocab_size": 256, "max_seq_len": 256},
}
GOAL_TFLOPS, GOAL_RATIO, GOAL_BYTES_PER_PARAM = 150.0, 0.9, 4.0


# -- disk ---------------------------------------------------------------------------------------


def measure_disk(directory: Path, nbytes: int, io_threads: int, trials: int) -> dict[str, Any]:
    """Raw vs store throughput on ``directory``'s file system: ``trials`` alternating pairs, cold,
    medians and the ratio of medians per mode (`mtc.store.diskbench.compare_throughput`)."""
    r = compare_throughput(directory, nbytes, trials=trials, io_threads=io_threads)
    r["goal_store_over_raw"] = GOAL_RATIO
    r["goal_met"] = all(r["store_over_raw"][k] >= GOAL_RATIO for k in MODES)
    r["goal_met_by_mode"] = {k: r["store_over_raw"][k] >= GOAL_RATIO for k in MODES}
    return r


# -- the training children ----------------------------------------------------------------------


def _child(fn: str, args: dict[str, Any], q: mp.Queue) -> None:
    try:
        q.put({"prepare": _prepare, "train": _train}[fn](args))
    except BaseException as e:  # noqa: BLE001 -- reported in the record
        import traceback

        q.put({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]})


def _config(a: dict[str, Any]) -> TrainConfig:
    return TrainConfig(**a["cfg"], optim=OptimConfig(lr=1e-4, min_lr=1e-5, warmup_steps=1, clip_norm=1.0))


def _prepare(a: dict[str, Any]) -> dict[str, Any]:
    """Create the run: build the model, write its initial state (both generations' arrays), one step."""
    from mtc.train import train

    res = train(_config(a), a["store"], a["data"], overwrite=True, stop_after=1)
    res.store.close()
    return {"params": sum(s.numel for s in res.tiers.layers)}


def _train(a: dict[str, Any]) -> dict[str, Any]:
    """Resume the run and train the measured steps inside the memory group (see the module doc);
    ``fresh``: start the run here instead (a run without durability has no commit to resume)."""
    from mtc.train import train

    baseline_rss = hostmem.rss_now()  # interpreter, torch, mtc: the process's fixed overhead
    group = hostmem.MemGroup(Path(a["cgroup"]), a["cgroup_version"]) if a["cgroup"] else None
    dropped = hostmem.drop_file_cache(Path(a["store"]))  # cold caches: the store's pages left the cache
    cached_before = hostmem.resident_file_bytes(Path(a["store"]))
    joined = group.join() if group is not None else False
    hwm_reset = hostmem.reset_peak_rss()
    marks: list[float] = []
    rss: list[int] = []
    cached: list[int] = []
    store_dir = Path(a["store"])
    res = train(_config(a), a["store"], a["data"], overwrite=bool(a.get("fresh")),
                on_step=lambda r: (marks.append(r.seconds), rss.append(hostmem.rss_now()),
                                   cached.append(hostmem.resident_file_bytes(store_dir))))
    params = sum(s.numel for s in res.tiers.layers)
    out: dict[str, Any] = {
        "params": params, "placement": list(res.placement), "grads_spilled": res.tiers.spill is not None,
        "step_s": marks, "rss_by_step": rss, "store_cached_by_step": cached, "rss_baseline": baseline_rss,
        "rss_peak": hostmem.peak_rss(), "rss_peak_reset": hwm_reset, "store_files_dropped": dropped,
        "store_cached_at_start": cached_before, "engine_host_bytes": res.tiers.host_bytes(),
        "pipeline_bytes": dict(res.tiers.pipeline_bytes), "cgroup_joined": joined,
    }
    res.store.close()
    if joined:
        assert group is not None
        out.update(cgroup_peak=group.peak, cgroup_limit=group.limit, cgroup_limit_hits=group.hits,
                   cgroup_stat_at_end=group.stat(), cgroup_version=group.version)
    return out


def _run_child(fn: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(fn, args, q))
    p.start()
    end = time.monotonic() + max(60.0, timeout)
    out: dict[str, Any] | None = None
    while out is None and time.monotonic() < end:
        try:
            out = q.get(timeout=2.0)
        except Exception:  # noqa: BLE001 -- queue.Empty: look whether the child still lives
            if not p.is_alive():  # died without a result (e.g. the memory group's OOM killer): no point waiting
                try:
                    out = q.get(timeout=1.0)  # unless its result was still in the pipe
                except Exception:  # noqa: BLE001
                    break
    if out is None:
        p.join(timeout=5)
        out = {"error": f"{fn}: no result within the time limit or the child died (exit code {p.exitcode}; "
                        "-9: killed, e.g. by the memory group's OOM killer)"}
        p.kill()
    p.join(timeout=30)
    return out


def grad_accum_rule(params: int, tokens_per_mb: int, disk_bytes_per_step: float, disk_GBps: float, target_tflops: float) -> int:
    """Micro-batches per step so that compute at ``target_tflops`` lasts as long as the disk traffic (<= 1M tokens)."""
    disk_s = disk_bytes_per_step / (disk_GBps * 1e9)
    tokens = disk_s * target_tflops * 1e12 / (6 * params)
    tokens = min(tokens, 2**20)
    return max(1, min(2**20 // tokens_per_mb, math.ceil(tokens / tokens_per_mb)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, a ~40M-parameter model (~0.5 GB of fp32 state)")
    ap.add_argument("--shape", choices=tuple(SHAPES), help="model shape (default: 4.6b on CUDA, smoke with --smoke)")
    ap.add_argument("--dir", help="directory on the disk to measure and hold the store (default: a temp dir)")
    ap.add_argument("--disk-bytes", type=float, default=None, help="bytes per throughput trial (default 4 GB, smoke 256 MB)")
    ap.add_argument("--disk-trials", type=int, default=5, help="alternating raw/store trial pairs (medians reported)")
    ap.add_argument("--io-threads", type=int, default=next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "io_threads"), help="store I/O threads, for the throughput trials and the training run (default: the trainer's)")
    ap.add_argument("--steps", type=int, default=None, help="steps to train (default 4, smoke 3)")
    ap.add_argument("--target-tflops", type=float, default=GOAL_TFLOPS, help="the grad-accumulation rule's compute rate")
    ap.add_argument("--grad-accum", type=int, default=None, help="override the rule")
    ap.add_argument("--time-limit-s", type=float, default=480)
    ap.add_argument("--disk-compute", choices=("store", "ram"), default="store", help="disk layers' compute copy (TrainConfig.disk_compute)")
    ap.add_argument("--durability", choices=("full", "none"), default="full",
                    help="full: two generations of the disk layers' state (crash-safe); none: one, updated in place")
    ap.add_argument("--limit-bytes-per-param", type=float, default=GOAL_BYTES_PER_PARAM,
                    help="the memory group's limit (page cache included) and the run's RAM budget, per parameter")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    if not cuda and not a.smoke:
        print("no CUDA device: run with --smoke on the CPU", file=sys.stderr)
        return 2
    shape = a.shape or ("smoke" if a.smoke else "4.6b")
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="mtc-disk-tier-"))
    root.mkdir(parents=True, exist_ok=True)
    nbytes = int(a.disk_bytes or (256e6 if a.smoke else 4e9))
    t0 = time.perf_counter()
    disk = measure_disk(root, nbytes, a.io_threads, a.disk_trials)
    print(f"disk: {disk['trials']} alternating trials of {nbytes / 1e6:.0f} MB, cold (direct I/O: raw {disk['raw_direct_io']}, "
          f"store {disk['store_direct_io']}), {disk['seconds']:.0f} s; medians GB/s:")
    print(f"disk raw   {json.dumps({k: round(v, 3) for k, v in disk['raw_median'].items()})}")
    print(f"disk store {json.dumps({k: round(v, 3) for k, v in disk['store_median'].items()})} with {disk['io_threads']} I/O threads")
    print(f"store/raw  {json.dumps({k: round(v, 3) for k, v in disk['store_over_raw'].items()})} (ratio of medians; goal >= {GOAL_RATIO} "
          f"for {', '.join(MODES)}: {'met' if disk['goal_met'] else 'not met'})")

    from mtc.train import build_model

    seq = 64 if a.smoke else 1024
    mbs = 1 if a.smoke else 4
    base = {"model": LLAMA, "model_overrides": SHAPES[shape], "seq_len": seq, "micro_batch_size": mbs, "placement": "disk",
                "durability": a.durability, "device": "cuda" if cuda else "cpu", "io_threads": disk["io_threads"], "kernels": "unfused" if not cuda else "auto"}
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(TrainConfig(**base, steps=1)).parameters())
    # read per visit: no host RAM per parameter for the compute copy (a bf16 copy in RAM would be 2 B/param)
    disk_compute = a.disk_compute
    per_param = 24 + (8 if disk_compute == "store" else 0)  # read + write master, m, v; + two visit reads of the fp32 master
    accum = a.grad_accum or (2 if a.smoke else grad_accum_rule(params, mbs * seq, per_param * params, disk["raw_median"]["mix"], a.target_tflops))
    steps = a.steps or (3 if a.smoke else 4)
    # two generations of master, m, v (one without durability), and the gradients' scratch when spilled
    gens = 2 if a.durability == "full" else 1
    need = (12 * gens + 4) * params * 1.05
    free = shutil.disk_usage(root).free
    record: dict[str, Any] = {"mode": "smoke" if a.smoke else "cuda", "shape": shape, "params": params, "disk": disk,
                              "disk_dir": str(root), "disk_compute": disk_compute, "grad_accum": accum,
                              "grad_accum_rule": "compute at --target-tflops as long as the step's disk traffic at the raw mix GB/s, <= 1M tokens",
                              "tokens_per_step": accum * mbs * seq, "durability": a.durability}
    # the disk's figures on record before the training run: a run the session's time limit kills
    # (gpu_session.sh's timeout sends TERM) still leaves them; rewritten whole at the end
    path = write_record("bench_disk_tier", dict(record, train={"pending": "the training run did not finish (killed?)"}))
    if need > free:
        record["train"] = {"skipped": f"{gens} generation(s) need {need / 1e9:.1f} GB, {root} has {free / 1e9:.1f} GB free"}
    else:
        tokens = root / "tokens.bin"
        rng = np.random.default_rng(0)
        vocab = SHAPES[shape]["vocab_size"]
        write_token_file(tokens, rng.integers(0, vocab, size=max(200_000, 4 * accum * mbs * seq * (steps + 2))).astype(np.uint16 if vocab < 65536 else np.uint32),
                         vocab_size=vocab, tokenizer="byte" if vocab == 256 else "synthetic")
        # the run's RAM budget is the limit: the engine fits itself to it (gradients of disk layers go
        # to the store on the CPU when 4 B/param cannot also hold them)
        limit = int(a.limit_bytes_per_param * params)
        cfg = dict(base, steps=steps + 1, grad_accum=accum, disk_compute=disk_compute, compute_dtype="float32" if not cuda else "bfloat16",
                   ram_budget_gb=limit / 2**30)
        child = {"cfg": cfg, "store": str(root / "store"), "data": str(tokens)}
        left = a.time_limit_s - (time.perf_counter() - t0)
        fresh = a.durability == "none"  # nothing to resume: the run starts in the measured child, outside a memory group
        out = _run_child("train", dict(child, fresh=True, cgroup=None, cgroup_version=0), left) if fresh else _run_child("prepare", child, left / 2)
        if "error" not in out and not fresh:
            group = hostmem.MemGroup.open(f"mtc-bench-{os.getpid()}", limit)
            out = _run_child("train", dict(child, cgroup=str(group.path) if group else None, cgroup_version=group.version if group else 0),
                             a.time_limit_s - (time.perf_counter() - t0))
            if group is not None:
                group.remove()
        if "error" not in out:
            steady = out["step_s"][1:] or out["step_s"]
            step_s = median(steady)
            tok = accum * mbs * seq
            spill = 8 if out["grads_spilled"] else 0  # the gradient's write to scratch and read back
            store_bytes = (per_param + spill) * params
            above = out["rss_peak"] - out["rss_baseline"]
            out.update(
                step_s_median=step_s, model_tflops=6 * params * tok / step_s / 1e12, tokens_per_s=tok / step_s,
                store_bytes_per_step=store_bytes, train_disk_GBps=store_bytes / step_s / 1e9,
                train_disk_over_raw_mix=store_bytes / step_s / 1e9 / disk["raw_median"]["mix"],
                rss_peak_above_baseline_per_param=above / params,
                store_cached_max_per_param=max(out["store_cached_by_step"], default=0) / params,
                engine_host_bytes_per_param=out["engine_host_bytes"] / params,
                limit_bytes=limit, limit_bytes_per_param=a.limit_bytes_per_param,
            )
            if out.get("cgroup_joined"):
                out["host_bytes_per_param"] = out["cgroup_peak"] / params
                out["method"] = (f"cgroup v{out['cgroup_version']} memory limit {limit / 1e9:.3f} GB "
                                 f"({a.limit_bytes_per_param} B/param), page cache included, joined after the process's "
                                 "fixed start-up; store pages dropped first (cold); figure: the group's peak usage")
            elif fresh:
                out["host_bytes_per_param"] = None
                out["method"] = ("not measured: a run without durability has no commit to resume, so it builds the model and "
                                 "writes its initial state in the measured process (its RSS peak holds the model's fp32 weights)")
            else:
                out["host_bytes_per_param"] = (above + max(out["store_cached_by_step"], default=0)) / params
                out["method"] = ("no memory cgroup could be made here: peak RSS over the start-up baseline plus the most "
                                 "store page-cache bytes seen after a step (mincore); store pages dropped first (cold)")
            out["goal_bytes_per_param"] = GOAL_BYTES_PER_PARAM
            out["goal_met_bytes_per_param"] = None if fresh else out["host_bytes_per_param"] <= GOAL_BYTES_PER_PARAM
            out["goal_tflops"] = GOAL_TFLOPS if cuda else None
        if "error" not in out:  # what the store holds on disk after the run (allocated blocks)
            held = sum(f.stat().st_blocks * 512 for f in (root / "store").rglob("*") if f.is_file())
            out.update(store_bytes_on_disk=held, store_bytes_on_disk_per_param=held / params)
        record["train"] = out
        for f in (tokens, tokens.with_suffix(".json")):
            f.unlink(missing_ok=True)
        shutil.rmtree(root / "store", ignore_errors=True)
    write_record("bench_disk_tier", record, path=path)
    tr = record["train"]
    if "error" in tr or "skipped" in tr:
        print(f"train: {tr.get('error') or tr.get('skipped')}")
    else:
        print(f"train: {params / 1e6:.1f}M params all on disk ({len(tr['placement'])} layers), {record['tokens_per_step']} tokens/step, "
              f"{tr['step_s_median']:.2f} s/step, {tr['model_tflops']:.3f} model TFLOP/s, store {tr['train_disk_GBps']:.3f} GB/s "
              f"({tr['train_disk_over_raw_mix']:.2f} of raw mix); gradients {'spilled to the store' if tr['grads_spilled'] else 'in memory'}; "
              f"durability {record['durability']}: the store holds {tr['store_bytes_on_disk'] / 1e9:.2f} GB "
              f"({tr['store_bytes_on_disk_per_param']:.1f} B/param)")
        held = "not measured" if tr["host_bytes_per_param"] is None else f"{tr['host_bytes_per_param']:.2f} B/param"
        print(f"host RAM: {held} (goal <= {GOAL_BYTES_PER_PARAM}); {tr['method']}; "
              f"RSS peak over baseline {tr['rss_peak_above_baseline_per_param']:.2f} B/param, engine buffers "
              f"{tr['engine_host_bytes_per_param']:.2f} B/param {json.dumps(tr['pipeline_bytes'])}"
              + (f"; group at end {json.dumps(tr['cgroup_stat_at_end'])}, limit reached {tr['cgroup_limit_hits']} times" if tr.get("cgroup_joined") else ""))
    print(f"wrote {path}")
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
