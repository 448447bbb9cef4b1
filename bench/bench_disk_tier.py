"""The disk tier: training with all fp32 state on disk, the disk's raw speed vs the store's, host RAM per parameter.

One JSON record under bench/results/ (bench_disk_tier-...json) with:
  disk      raw throughput of the store's file system (O_DIRECT, 1 MiB blocks, 16 in flight;
            sequential write over a laid-out file, read, 50/50 mix) and the store's own I/O path
            on the same bytes (zarr format, CRC32C, fsync, --io-threads threads; writes in place,
            as the disk tier's steady state), in --disk-trials alternating raw/store pairs with
            cold caches (the disk is shared and noisy): every trial, the medians, and per mode the
            ratio of the medians (goal >= 0.9 for write, read and mix). First writes into new
            files (``write_fresh``) are reported beside them.
  train     a Llama shape with every layer on disk (durability full: the store is the tier),
            trained in a child process: median step time, model TFLOP/s (6 x params x tokens / step
            time), tokens per step (<= 1M), the store bytes per step and the GB/s they imply, and
            host RAM: peak RSS per parameter, and, when a cgroup memory limit can be applied, the
            cgroup's peak usage (which counts the page cache) under that limit, with cold caches
            (the store reads and writes with O_DIRECT or drops its pages).

Gradient accumulation: a stated rule until the planner (`mtc plan`) lands: enough tokens per step
that the model's compute at --target-tflops takes as long as the step's disk traffic at the raw
mixed throughput measured above, capped at 1M tokens per step.

    python bench/bench_disk_tier.py --smoke      # CPU, ~40M parameters (~0.5 GB fp32 state), a few minutes
    python bench/bench_disk_tier.py              # CUDA: the 4.6B shape, all on disk (needs ~110 GB of disk)
    python bench/bench_disk_tier.py --shape 2.3b # CUDA: the largest whose two generations fit a 64 GB disk
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, write_record
from mtc.store.diskbench import MODES, compare_throughput

from mtc.config import OptimConfig, TrainConfig
from mtc.data import write_token_file

LLAMA = "8b"  # base preset; every shape field is overridden
SHAPES = {
    "4.6b": {"dim": 4096, "ffn_dim": 14336, "n_heads": 32, "n_kv_heads": 8, "n_layers": 20, "vocab_size": 32000},
    "2.3b": {"dim": 4096, "ffn_dim": 14336, "n_heads": 32, "n_kv_heads": 8, "n_layers": 9, "vocab_size": 32000},
    "smoke": {"dim": 512, "ffn_dim": 1408, "n_heads": 8, "n_kv_heads": 4, "n_layers": 12, "vocab_size": 256, "max_seq_len": 256},
}
GOAL_TFLOPS, GOAL_RATIO, GOAL_BYTES_PER_PARAM = 150.0, 0.9, 4.0
_CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


# -- disk ---------------------------------------------------------------------------------------


def measure_disk(directory: Path, nbytes: int, io_threads: int, trials: int) -> dict[str, Any]:
    """Raw vs store throughput on ``directory``'s file system: ``trials`` alternating pairs, cold,
    medians and the ratio of medians per mode (`mtc.store.diskbench.compare_throughput`)."""
    r = compare_throughput(directory, nbytes, trials=trials, io_threads=io_threads)
    r["goal_store_over_raw"] = GOAL_RATIO
    r["goal_met"] = all(r["store_over_raw"][k] >= GOAL_RATIO for k in MODES)
    r["goal_met_by_mode"] = {k: r["store_over_raw"][k] >= GOAL_RATIO for k in MODES}
    return r


# -- host memory under a cgroup -----------------------------------------------------------------


def _cgroup_open(limit: int) -> Path | None:
    """A cgroup v1 memory group limited to ``limit`` bytes (page cache included), or None."""
    if not (_CGROUP_ROOT / "memory.limit_in_bytes").exists():
        return None
    cg = _CGROUP_ROOT / f"mtc-bench-{os.getpid()}"
    try:
        cg.mkdir(exist_ok=True)
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        if int((cg / "memory.limit_in_bytes").read_text()) > limit * 1.01:
            raise OSError("the limit did not take")
        return cg
    except OSError:
        with contextlib.suppress(OSError):
            cg.rmdir()
        return None


def _cgroup_join(cg: Path) -> bool:
    try:
        (cg / "tasks").write_text(str(os.getpid()))
        return str(os.getpid()) in (cg / "tasks").read_text().split()
    except OSError:
        return False


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- the training child -------------------------------------------------------------------------


def _child(args: dict[str, Any], q: mp.Queue) -> None:
    try:
        q.put(_train(args))
    except BaseException as e:  # noqa: BLE001 -- reported in the record
        import traceback

        q.put({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]})


def _train(a: dict[str, Any]) -> dict[str, Any]:
    from mtc.train import train

    baseline_rss = _rss_now()  # torch, mtc and (on CUDA) the CUDA context: the process's fixed overhead
    joined = False
    if a["cgroup"] is not None:
        joined = _cgroup_join(Path(a["cgroup"]))
    cfg = TrainConfig(**a["cfg"], optim=OptimConfig(lr=1e-4, min_lr=1e-5, warmup_steps=1, clip_norm=1.0))
    marks: list[float] = []
    rss: list[int] = []
    res = train(cfg, a["store"], a["data"], overwrite=True,
                on_step=lambda r: (marks.append(r.seconds), rss.append(_rss_now())))
    params = sum(s.numel for s in res.tiers.layers)
    placement = list(res.placement)
    host_bytes = res.tiers.host_bytes()
    pipeline = dict(res.tiers.pipeline_bytes)
    res.store.close()
    out: dict[str, Any] = {"params": params, "placement": placement, "step_s": marks, "rss_by_step": rss,
                           "rss_peak": _rss_peak(), "rss_baseline": baseline_rss, "engine_host_bytes": host_bytes,
                           "pipeline_bytes": pipeline, "cgroup_joined": joined}
    if joined:
        cg = Path(a["cgroup"])
        out["cgroup_peak"] = int((cg / "memory.max_usage_in_bytes").read_text())
        out["cgroup_limit"] = int((cg / "memory.limit_in_bytes").read_text())
        out["cgroup_failcnt"] = int((cg / "memory.failcnt").read_text())
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
                "durability": "full", "device": "cuda" if cuda else "cpu", "io_threads": disk["io_threads"], "kernels": "unfused" if not cuda else "auto"}
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(TrainConfig(**base, steps=1)).parameters())
    # read per visit: no host RAM per parameter for the compute copy (a bf16 copy in RAM would be 2 B/param,
    # beside a 3-set read-ahead ring of 16 B x the largest layer: over the 4 B/param goal at 20 layers)
    disk_compute = a.disk_compute
    per_param = 24 + (8 if disk_compute == "store" else 0)  # read + write master, m, v; + two visit reads of the fp32 master
    accum = a.grad_accum or (2 if a.smoke else grad_accum_rule(params, mbs * seq, per_param * params, disk["raw_median"]["mix"], a.target_tflops))
    steps = a.steps or (3 if a.smoke else 4)
    need = 24 * params * 1.05
    free = shutil.disk_usage(root).free
    record: dict[str, Any] = {"mode": "smoke" if a.smoke else "cuda", "shape": shape, "params": params, "disk": disk,
                              "disk_dir": str(root), "disk_compute": disk_compute, "grad_accum": accum,
                              "grad_accum_rule": "compute at --target-tflops as long as the step's disk traffic at the raw mix GB/s, <= 1M tokens",
                              "tokens_per_step": accum * mbs * seq, "durability": "full"}
    if need > free:
        record["train"] = {"skipped": f"two generations need {need / 1e9:.1f} GB, {root} has {free / 1e9:.1f} GB free"}
    else:
        tokens = root / "tokens.bin"
        rng = np.random.default_rng(0)
        vocab = SHAPES[shape]["vocab_size"]
        write_token_file(tokens, rng.integers(0, vocab, size=max(200_000, 4 * accum * mbs * seq * (steps + 1))).astype(np.uint16 if vocab < 65536 else np.uint32),
                         vocab_size=vocab, tokenizer="byte" if vocab == 256 else "synthetic")
        cfg = dict(base, steps=steps, grad_accum=accum, disk_compute=disk_compute, compute_dtype="float32" if not cuda else "bfloat16")
        # the limit: 4 B/param over the process's fixed overhead (torch, CUDA context), page cache included
        limit = int(GOAL_BYTES_PER_PARAM * params + (1.5e9 if cuda else 0.6e9))
        cg = _cgroup_open(limit)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=({"cfg": cfg, "store": str(root / "store"), "data": str(tokens),
                                               "cgroup": str(cg) if cg else None}, q))
        p.start()
        try:
            out = q.get(timeout=max(60.0, a.time_limit_s - (time.perf_counter() - t0)))
        except Exception:  # noqa: BLE001 -- a hung or killed child: say so
            out = {"error": f"no result within the time limit (exit code {p.exitcode})"}
            p.kill()
        p.join(timeout=30)
        if cg is not None:
            with contextlib.suppress(OSError):
                cg.rmdir()
        if "error" not in out:
            steady = out["step_s"][1:] or out["step_s"]
            step_s = median(steady)
            tok = accum * mbs * seq
            store_bytes = per_param * params
            out.update(
                step_s_median=step_s, model_tflops=6 * params * tok / step_s / 1e12, tokens_per_s=tok / step_s,
                store_bytes_per_step=store_bytes, train_disk_GBps=store_bytes / step_s / 1e9,
                train_disk_over_raw_mix=store_bytes / step_s / 1e9 / disk["raw_median"]["mix"],
                rss_peak_per_param=out["rss_peak"] / params,
                rss_peak_above_baseline_per_param=(out["rss_peak"] - out["rss_baseline"]) / params,
                engine_host_bytes_per_param=out["engine_host_bytes"] / params,
                memory_limit=("cgroup v1 memory.limit_in_bytes (page cache included), "
                              f"{limit / 1e9:.2f} GB = {GOAL_BYTES_PER_PARAM} B/param + fixed overhead") if out.get("cgroup_joined")
                else "no cgroup memory limit could be applied here: RSS reported; the store's I/O bypasses or drops the page cache",
            )
            if out.get("cgroup_joined"):
                out["cgroup_peak_per_param"] = out["cgroup_peak"] / params
            out["goal_tflops"] = GOAL_TFLOPS if cuda else None
        record["train"] = out
        for f in (tokens, tokens.with_suffix(".json")):
            f.unlink(missing_ok=True)
        shutil.rmtree(root / "store", ignore_errors=True)
    path = write_record("bench_disk_tier", record)
    tr = record["train"]
    if "error" in tr or "skipped" in tr:
        print(f"train: {tr.get('error') or tr.get('skipped')}")
    else:
        print(f"train: {params / 1e6:.1f}M params all on disk, {record['tokens_per_step']} tokens/step, "
              f"{tr['step_s_median']:.2f} s/step, {tr['model_tflops']:.3f} model TFLOP/s, store {tr['train_disk_GBps']:.3f} GB/s "
              f"({tr['train_disk_over_raw_mix']:.2f} of raw mix); host RSS peak {tr['rss_peak_per_param']:.2f} B/param "
              f"({tr['rss_peak_above_baseline_per_param']:.2f} above the process baseline), engine buffers "
              f"{tr['engine_host_bytes_per_param']:.2f} B/param"
              + (f"; cgroup peak {tr['cgroup_peak_per_param']:.2f} B/param under {tr['cgroup_limit'] / 1e9:.2f} GB" if tr.get("cgroup_joined") else "; no cgroup limit"))
    print(f"wrote {path}")
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
