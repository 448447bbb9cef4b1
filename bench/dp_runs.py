"""bench_train.py --world-size N: the same run plain, under torchrun at one rank, and at N ranks.

Each setting is the CLI a user would type, in its own process(es), on the same config file, data
and global batch:

  plain        python -m mtc train --config RUN.json --store S --data D
  torchrun-1   python -m torch.distributed.run --standalone --nproc-per-node 1 -m mtc train ... (same flags)
  torchrun-N   ... --nproc-per-node N ...

Step times come from the runs' own metrics (``logs/metrics.jsonl`` under each store directory:
one file per rank where every rank logs, else rank 0's), after the warm-up steps, so process
start-up and the launcher are left out (their cost is reported apart: each run's wall time less
its steps). Tokens/s per rank is the global batch's tokens over N, over the median step.

The settings run in interleaved rounds, the order alternating (plain first in even rounds, last
in odd ones) so that a drift of the machine's load hits both alike. Each setting's figure is the
median over rounds of its per-round median step. The torchrun-1 overhead (the issue's bound:
within 2 %) is measured per round, as the ratio of the two runs of that round, and reported as the
median of those ratios with their spread (min, max, quartiles); beside it the machine's own noise:
how far one setting's per-round medians lie apart. When that noise exceeds the 2 % bound, the
record says the machine cannot resolve it rather than pretending a verdict.
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
import threading
import time
from pathlib import Path
from typing import Any

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
GOAL_TORCHRUN_ONE = 0.98  # torchrun at one rank: at least 98 % of the plain path's tokens/s


def settings(world: int) -> list[tuple[str, int | None]]:
    """(name, ranks under torchrun; None: no torchrun) of each setting, in run order."""
    out: list[tuple[str, int | None]] = [("plain", None), ("torchrun-1", 1)]
    return out + ([(f"torchrun-{world}", world)] if world > 1 else [])


def round_order(k: int, names: list[tuple[str, int | None]]) -> list[tuple[str, int | None]]:
    """The settings of round ``k``: in order in even rounds, reversed in odd ones (a load drift
    during the rounds then favours neither plain nor torchrun-1)."""
    return list(names) if k % 2 == 0 else list(reversed(names))


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
            "tokens_per_s_per_rank": tokens_per_step / ranks / step,
            "steps_s_total": max(sum(s) for s in per_file.values()), "steps_measured": min(len(s) for s in per_file.values())}


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
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    samples: list[tuple[float, float, int]] = []  # under torchrun: (time, the launcher's own CPU seconds, metrics bytes)
    watch = threading.Thread(target=_watch_launcher, args=(proc, store / "logs" / "metrics.jsonl", samples), daemon=True)
    if ranks is not None:
        watch.start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"setting": name, "argv": argv, "error": f"timed out after {timeout_s:.0f} s"}
    finally:
        if watch.is_alive():
            watch.join()
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return {"setting": name, "argv": argv, "returncode": proc.returncode, "wall_s": wall,
                "error": f"exit {proc.returncode}: {_error_line(stderr + stdout)}", "stderr_tail": stderr[-4000:]}
    out = summarize(name, ranks or 1, step_seconds(store, warmup), tokens_per_step)
    every = step_seconds(store, 0)  # warm-up included: what is outside them is start-up, launcher and exit
    out.update(argv=argv, returncode=0, wall_s=wall, outside_steps_s=wall - max((sum(s) for s in every.values()), default=0.0))
    # torchrun's agent process beside the worker: the share of one core it took while steps were
    # logged (from the first sample that saw a step to the first that saw the last one; not the exit)
    ends = [i for i in range(1, len(samples)) if samples[i][2] != samples[i - 1][2]]
    if ends and samples[ends[-1]][0] - samples[0][0] >= 0.5:
        a, b = samples[0], samples[ends[-1]]
        out["launcher_cpu_cores"] = (b[1] - a[1]) / (b[0] - a[0])
    return out


def own_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) that process ``pid`` used itself, its children's not included
    (Linux /proc; None where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _watch_launcher(proc: subprocess.Popen, metrics: Path, samples: list[tuple[float, float, int]]) -> None:
    """Sample the launcher's own CPU time and the metrics file's size every 0.05 s once the run
    logs steps, until it exits."""
    while proc.poll() is None:
        if metrics.exists():
            size = metrics.stat().st_size
            cpu = own_cpu_s(proc.pid)
            if cpu is not None and proc.poll() is None:
                samples.append((time.perf_counter(), cpu, size))
        time.sleep(0.05)


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A setting's figures over its successful rounds: the median round's (by median step), with
    every round's median step beside it; else its last error."""
    ok = sorted((r for r in rounds if "tokens_per_s_per_rank" in r), key=lambda r: r["median_step_s"])
    if not ok:
        return rounds[-1]
    mid = ok[(len(ok) - 1) // 2]  # the lower median: a round that ran
    return {**mid, "median_step_s": statistics.median(r["median_step_s"] for r in ok),
            "tokens_per_s_per_rank": statistics.median(r["tokens_per_s_per_rank"] for r in ok),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
            "rounds_median_step_s": [r.get("median_step_s") for r in rounds], "rounds_ok": len(ok)}


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and (with 4 or more values) the quartiles of ``values``."""
    out: dict[str, Any] = {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}
    if len(values) >= 4:
        q = statistics.quantiles(values, n=4)
        out.update(q1=q[0], q3=q[2])
    return out


def overhead(rounds: dict[str, list[dict[str, Any]]], base: str = "plain", other: str = "torchrun-1",
             bound: float = GOAL_TORCHRUN_ONE) -> dict[str, Any]:
    """``other``'s tokens/s over ``base``'s, per round (the two runs of one round ran back to back),
    with its spread; the machine's noise (per setting: the largest round median over the smallest,
    less 1); and whether the figures can decide the bound."""
    pairs = [(a["median_step_s"], b["median_step_s"]) for a, b in zip(rounds.get(base, []), rounds.get(other, []), strict=False)
             if "median_step_s" in a and "median_step_s" in b]
    if not pairs:
        return {"error": f"no round in which both {base} and {other} ran"}
    per_round = [sa / sb for sa, sb in pairs]  # step time ratio = tokens/s of `other` over `base`
    noise = {}
    for name in (base, other):
        meds = [r["median_step_s"] for r in rounds[name] if "median_step_s" in r]
        noise[name] = max(meds) / min(meds) - 1 if len(meds) > 1 else None
    launch = [b.get("outside_steps_s", 0.0) - a.get("outside_steps_s", 0.0)
              for a, b in zip(rounds[base], rounds[other], strict=False) if "median_step_s" in a and "median_step_s" in b]
    r = spread(per_round)
    worst_noise = max((x for x in noise.values() if x is not None), default=None)
    tol = 1 - bound
    if len(pairs) < 3 or worst_noise is None:
        verdict = f"undecided: {len(pairs)} paired round(s); run 3 or more (--repeats)"
    elif worst_noise > tol:
        verdict = (f"undecided: this machine's run-to-run noise ({worst_noise:.1%}) exceeds the {tol:.0%} bound; "
                   f"median ratio {r['median']:.3f} (range {r['min']:.3f}-{r['max']:.3f})")
    elif r["median"] >= bound:
        verdict = f"within the bound: median ratio {r['median']:.3f} >= {bound}"
    else:
        verdict = f"outside the bound: median ratio {r['median']:.3f} < {bound}"
    cores = [b["launcher_cpu_cores"] for b in rounds[other] if "launcher_cpu_cores" in b]
    return {"ratio_per_round": per_round, "ratio": r, "noise_by_setting": noise, "launch_overhead_s": spread(launch),
            "launcher_cpu_cores": spread(cores) if cores else None, "bound": bound, "verdict": verdict}


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
