"""bench_train.py --world-size N: the same run plain, under torchrun at one rank, and at N ranks.

Each setting is the CLI a user would type, in its own process(es), on the same config file, data
and global batch:

  plain        python -m mtc train --config RUN.json --store S --data D
  torchrun-1   python -m torch.distributed.run --standalone --nproc-per-node 1 -m mtc train ... (same flags)
  torchrun-N   ... --nproc-per-node N ...

Step times come from the runs' own metrics (``logs/metrics.jsonl`` under each store directory:
one file per rank where every rank logs, else rank 0's), after the warm-up steps. Tokens/s per
rank is the global batch's tokens over N, over the median step. The ratios: torchrun at one rank
over the plain path (the issue's bound: within 2 %), and per-rank tokens/s at N over the plain run.
Data-parallel training is issue 13's engine (`mtc.dist`); where the checkout lacks it, torchrun-N
is not launched (N independent runs would race on one store) and the record says why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
GOAL_TORCHRUN_ONE = 0.98  # torchrun at one rank: at least 98 % of the plain path's tokens/s


def settings(world: int) -> list[tuple[str, int | None]]:
    """(name, ranks under torchrun; None: no torchrun) of each setting, in run order."""
    out: list[tuple[str, int | None]] = [("plain", None), ("torchrun-1", 1)]
    return out + ([(f"torchrun-{world}", world)] if world > 1 else [])


def train_argv(config: Path, store: Path, data: Path, ranks: int | None) -> list[str]:
    """The command line of one setting: `mtc train` with the same flags, under torchrun if ``ranks``."""
    train = ["mtc", "train", "--config", str(config), "--store", str(store), "--data", str(data)]
    if ranks is None:
        return [sys.executable, "-m", *train]
    return [*TORCHRUN, "--nproc-per-node", str(ranks), "-m", *train]


def dist_engine_missing() -> str | None:
    """Why data-parallel runs cannot start in this checkout (None: the engine is there)."""
    if importlib.util.find_spec("mtc.dist") is None:
        return ("data-parallel training is not in this checkout (no mtc.dist, issue 13's engine): torchrun would start "
                "independent single-process runs racing on one store; not launched")
    return None


def step_seconds(store: Path, warmup: int) -> dict[str, list[float]]:
    """Per metrics file under ``store`` (one per logging rank): the step seconds after ``warmup`` steps."""
    out: dict[str, list[float]] = {}
    for f in sorted(store.rglob("metrics.jsonl")):
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        secs = [float(r["seconds"]) for r in sorted(recs, key=lambda r: r["step"])]
        out[str(f.relative_to(store))] = secs[warmup:]
    return out


def summarize(name: str, ranks: int, per_file: dict[str, list[float]], tokens_per_step: int) -> dict[str, Any]:
    """One setting's figures: the median step per logging rank, the slowest of them (the step ends
    when every rank's does), tokens/s per rank."""
    medians = {f: statistics.median(s) for f, s in per_file.items() if s}
    if not medians:
        return {"setting": name, "error": "no step metrics found (logs/metrics.jsonl) after the warm-up steps"}
    step = max(medians.values())
    return {"setting": name, "ranks": ranks, "median_step_s_by_file": medians, "median_step_s": step,
            "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / step,
            "tokens_per_s_per_rank": tokens_per_step / ranks / step}


def _error_line(text: str) -> str:
    """The run's own error line (`mtc: error: ...`) if it printed one, else its last line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "mtc: error:" in ln or "Error" in ln]
    return (errs or lines or ["(no output)"])[-1].strip()


def run_setting(name: str, ranks: int | None, *, config: Path, data: Path, root: Path, warmup: int, tokens_per_step: int,
                timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Launch one setting, wait for it, and read its step metrics."""
    store = root / f"store-{name}"
    argv = train_argv(config, store, data, ranks)
    print(f"  DP / {name}: {' '.join(argv[1:])}", flush=True)
    t = time.perf_counter()
    try:
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"setting": name, "argv": argv, "error": f"timed out after {timeout_s:.0f} s"}
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return {"setting": name, "argv": argv, "returncode": proc.returncode, "wall_s": wall,
                "error": f"exit {proc.returncode}: {_error_line(proc.stderr + proc.stdout)}", "stderr_tail": proc.stderr[-4000:]}
    out = summarize(name, ranks or 1, step_seconds(store, warmup), tokens_per_step)
    out.update(argv=argv, returncode=0, wall_s=wall)
    return out


def best_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A setting's fastest successful round (with every round's median step beside it), else its last error."""
    ok = [r for r in rounds if "tokens_per_s_per_rank" in r]
    if not ok:
        return rounds[-1]
    best = max(ok, key=lambda r: r["tokens_per_s_per_rank"])
    return {**best, "rounds_median_step_s": [r.get("median_step_s") for r in rounds]}


def predicted(cfg: Any, world: int) -> dict[str, Any]:
    """`mtc plan`'s prediction for the same config at 1 and ``world`` ranks on one host, on the
    last `mtc calibrate` profile of this machine (none saved: says so)."""
    from mtc.calibrate import DEFAULT_PROFILE_PATH, MachineProfile
    from mtc.dist_plan import make_dist_plan
    from mtc.errors import MTCError

    if not DEFAULT_PROFILE_PATH.is_file():
        return {"error": f"no machine profile at {DEFAULT_PROFILE_PATH}; run `mtc calibrate` first"}
    try:
        prof = MachineProfile.load(DEFAULT_PROFILE_PATH)
        out: dict[str, Any] = {"profile": prof.name, "profile_created": prof.created}
        tokens = cfg.grad_accum * cfg.micro_batch_size * cfg.seq_len
        for w in sorted({1, world}):
            st = make_dist_plan(cfg, prof, w).step
            out[f"world_{w}"] = {"step_s": st.step_s, "tokens_per_s_per_rank": tokens / w / st.step_s, "bottleneck": st.bottleneck}
        return out
    except MTCError as e:
        return {"error": str(e)}


def ratios(results: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """torchrun-1 over plain, and per-rank torchrun-N over plain (tokens/s per rank)."""
    by = {r["setting"]: r.get("tokens_per_s_per_rank") for r in results}
    plain, one, many = by.get("plain"), by.get("torchrun-1"), by.get(f"torchrun-{world}")
    return {"torchrun_1_over_plain": one / plain if one and plain else None, "goal_torchrun_1_over_plain": GOAL_TORCHRUN_ONE,
            f"torchrun_{world}_per_rank_over_plain": many / plain if many and plain and world > 1 else None}
