"""Whole training steps of the streaming engine, on models far larger than the GPU and on one that fits.

Parts (one JSON record each, `--only P1-16,P3`):
  P1-16, P1-48  a 4.6B Llama shape (h 4096, MLP 14336, 32 q / 8 kv heads, 20 blocks, vocab 32000,
                seq 1024), 16 and 48 sequences per step (4 x 4 and 4 x 12), bf16 compute, fp32
                master, clip 1.0, durability none. Two settings: `stateless` (all state in host RAM,
                gpu_update auto) and `auto` (the plan's best placement).
  P3            a 1.5B Llama shape that fits the GPU, 16 x 1024 tokens per step: mtc (auto, stateless)
                vs GPU-resident PyTorch (bf16 autocast, fused AdamW on the GPU, activation
                checkpointing per block), eager and torch.compile'd; the ratio mtc best / baseline best
                (the goal's); torch.compile without checkpointing runs too, its ratio reported beside.
                Both sides run the same micro-batch (`--baseline-micro-batch`, 16: the whole step at
                once; `--p3-micro-batch` sets mtc's apart): until 2026-11-26 mtc ran 4 x 4 against
                the baseline's 1 x 16, a quarter-size matmul per kernel and four times the launches.
  P5            one layer shape at 10 and 40 blocks, stateless, a fixed activation budget: the ratio of
                GPU peak memory (deep / shallow). Default shape: P3's (h 2048); P1's at 40 blocks is 9B
                parameters, 162 GB of host state, more than the lent box's 128 GiB of RAM.

Per setting: median step time after warm-up, model TFLOP/s (6 x params x tokens / step time),
tokens/s, GPU busy % (CUDA: kernel time in one profiled extra step, from torch.profiler, over that
step's wall time), host-device traffic per step (computed from the placement; beside it the copy
engine's own counters) and the average GB/s it implies, optimizer time hidden vs exposed (from the
engine's timeline), GPU peak memory, host RSS per parameter, how often clipping fired, and how the
setting got its compiled plan: `plan.how` compiled or loaded, `plan.compile_or_load_s`.

Fused settings (the default on CUDA; `--kernels`) share one compiled plan per model shape: the
first setting of a shape traces it and compiles its templates (generated kernels, matmul-fusion
tuning) into a plan directory, as `mtc compile` does, and every setting trains from that directory
(`open_run(plan=DIR)` with an in-memory store), so later settings of the shape, in the same part or
another (P1-16 and P1-48 share theirs), load it instead of compiling again. Templates go through one
kernel cache beside the plans, so P5's two depths compile their common block template once. Plans
and cache live in a temporary directory per invocation, or in `--plans DIR`, which later invocations
load from (gpu_session.sh runs each train part as an invocation of its own).

On CUDA every setting runs in its own process (clean GPU memory, pinned-host cache and peak RSS;
one crash or timeout loses one setting), and an invocation stops starting settings past
--time-limit-s. Set-up (model init on the GPU, trace, state allocation) is timed apart from steps.

    python bench/bench_train.py --only P1-16                 # each invocation: at most --time-limit-s (480)
    python bench/bench_train.py --only P1-48
    python bench/bench_train.py --only P3
    python bench/bench_train.py --only P5
    python bench/bench_train.py --smoke                      # CPU, tiny shapes, every part, < 1 min
    python bench/bench_train.py --smoke --only P3 --kernels fused --warmup 0 --steps 1   # CPU: the compiled-plan path
    python bench/bench_train.py --smoke --world-size 2       # CPU (gloo): plain vs torchrun 1 vs torchrun 2 (bench/dp_runs.py)
    python bench/bench_train.py --world-size 1               # CUDA: the P3 shape, plain vs torchrun at one rank (within 2 %?)

--world-size N runs part DP only: the same `mtc train` config plain, under torchrun at one rank and at
N ranks (one process per rank, the global batch split between them); tokens/s per rank and the ratios.
"""

from __future__ import annotations

import time

_T0 = time.monotonic()  # --time-limit-s counts from here: the imports below take seconds of a device call

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import sys
import signal
import tempfile
import traceback
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel import: a --smoke --kernels fused run needs the interpreter

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dp_runs
from common import LLAMA, P1_SHAPE, P3_SHAPE, SMOKE_SHAPE, gpu_name, median, write_record

from mtc.compiler import compile_program
from mtc.config import OptimConfig, TrainConfig
from mtc.data import BatchSampler, TokenFile, write_token_file
from mtc.models import build, model_config
from mtc.plan import PLAN_KERNEL_FIELDS, PLAN_MODEL_FIELDS, PROGRAM_FILE, save_plan
from mtc.planner import local_update_rates
from mtc.runtime.pinned import host_buffer
from mtc.runtime.placement import describe, handed_layers, streamed_grads_on_device
from mtc.runtime.timeline import Timeline
from mtc.train import StepRecord, TrainResult, build_model, open_run, train
from mtc.tracer import LossModel, trace

PARTS = ("P1-16", "P1-48", "P3", "P5")
GOALS = {"P1-16": 230.0, "P1-48": 300.0}  # stateless model TFLOP/s
MEGATRAIN = {"P1-16": 93.0, "P1-48": 181.0}  # MegaTrain on the same box, model TFLOP/s
SPREAD_NOTE = 1.3  # the table lists a setting's measured steps when the slowest took this much longer than the fastest
# the mtc settings of P1 and P3 (`_setting`)
SETTINGS = ("stateless", "stateless-noprefetch", "stateless-nohandoff", "auto", "auto-recompute")
P3_GOAL, P5_GOAL = 1.0, 1.1


# -- measuring one mtc setting -----------------------------------------------------------------


class _Probe:
    """`on_step` hook: step marks, the copy engine's byte counters, steady RSS, one profiled step."""

    def __init__(self, warmup: int, measure: int, profile: bool, verbose: bool) -> None:
        self.warmup, self.end, self.profile, self.verbose = warmup, warmup + measure, profile, verbose
        self.marks: dict[int, dict[str, Any]] = {}
        self.first_begin: float | None = None
        self.prof: Any = None
        self.prof_error: str | None = None

    def __call__(self, rec: StepRecord) -> None:
        now = time.perf_counter()
        if self.first_begin is None:
            self.first_begin = now - rec.seconds
        prev = self.marks.get(rec.step - 1, {"h2d": 0, "d2h": 0})
        self.marks[rec.step] = {"t": now, "h2d": prev["h2d"] + rec.h2d_bytes, "d2h": prev["d2h"] + rec.d2h_bytes}
        if self.verbose:
            print(f"    step {rec.step}/{rec.total_steps}: {rec.seconds:8.3f} s  loss {rec.loss:.4f}  norm {rec.grad_norm:.3f}", flush=True)
        if rec.step == self.end:
            self.marks[rec.step]["rss"] = _proc_status("VmRSS")
            if self.profile:
                try:
                    from torch.profiler import ProfilerActivity, profile

                    self.prof = profile(activities=[ProfilerActivity.CUDA])
                    self.prof.start()
                except Exception as e:  # noqa: BLE001 - the profile is an extra; the record says why it is missing
                    self.prof, self.prof_error = None, f"{type(e).__name__}: {e}"
        elif rec.step == self.end + 1 and self.prof is not None:
            try:  # a failure here (CUPTI) must not lose the setting's measured steps
                torch.cuda.synchronize()
                self.prof.stop()
            except Exception as e:  # noqa: BLE001 - the record says why the busy figure is missing
                self.prof, self.prof_error = None, f"stopping the profiler: {type(e).__name__}: {e}"


def _proc_status(field: str) -> int | None:
    """A memory field of /proc/self/status in bytes (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _union_s(intervals: list[tuple[int, int]]) -> float:
    """Seconds covered by the union of [start, end) ns intervals."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e9


def _gpu_profile(prof: Any, step_s: float) -> dict[str, Any]:
    """GPU kernel and copy occupancy of the profiled step (union of intervals, so overlapping streams count once)."""
    kinds: dict[str, list[tuple[int, int]]] = {"kernel": [], "h2d": [], "d2h": [], "other": []}
    nbytes = {"h2d": 0, "d2h": 0}
    for e in prof.profiler.kineto_results.events():
        if not str(e.device_type()).endswith("CUDA"):
            continue
        name = e.name()
        kind = ("h2d" if name.startswith("Memcpy HtoD") else "d2h" if name.startswith("Memcpy DtoH")
                else "other" if name.startswith(("Memcpy", "Memset")) else "kernel")
        kinds[kind].append((e.start_ns(), e.end_ns()))
        if kind in nbytes:
            m = re.search(r'"bytes":\s*(\d+)', e.metadata_json() or "")
            nbytes[kind] += int(m.group(1)) if m else 0
    every = [iv for ivs in kinds.values() for iv in ivs]
    out: dict[str, Any] = {"method": "torch.profiler (CUPTI) over one extra step after the measured ones; "
                                     "busy = union of kernel intervals / that step's wall time",
                           "step_s": step_s, "gpu_events": len(every)}
    if not every:
        return out
    kernel_s = _union_s(kinds["kernel"])
    out.update(kernel_busy_s=kernel_s, busy_pct=100 * min(1.0, kernel_s / step_s), kernels=len(kinds["kernel"]),
               first_to_last_event_s=(max(e for _, e in every) - min(s for s, _ in every)) / 1e9)
    for d in ("h2d", "d2h"):
        busy = _union_s(kinds[d])
        out[f"{d}_busy_s"], out[f"{d}_bytes"] = busy, nbytes[d] or None
        out[f"{d}_gbps_while_copying"] = nbytes[d] / busy / 1e9 if busy and nbytes[d] else None
    return out


def _planned_bytes(res: Any, cfg: TrainConfig, act_out_per_step: float) -> dict[str, Any]:
    """Host<->device bytes per step implied by the placement (mirrors the executor's fetch plan)."""
    prog, place = res.program, res.placement
    cb = torch.empty((), dtype=getattr(torch, cfg.resolved_compute_dtype)).element_size()
    last = prog.n_layers - 1
    # GPU-updated layers handed over on the device (`TrainConfig.update_handoff`): their visits'
    # weights stay on the device once they have been updated (the first step's still cross)
    handed = handed_layers(res.gpu_update, res.prefetch, cb, cfg.update_handoff)
    weights = 0
    for call in prog.layers:  # embed + blocks: forward and backward visits; the head: one visit
        # its own weights and tied ones of other layers, each crossing unless its owner is resident
        # (a resident owner's copy into the slot stays on the device: the engine counts it apart)
        reads = {call.index: prog.layer_numel(call.index)}
        for k in dict.fromkeys(call.param_keys()):
            p = prog.params[k]
            if p.layer != call.index:
                reads[p.layer] = reads.get(p.layer, 0) + p.numel
        numel = sum(n for owner, n in reads.items() if place[owner] != "gpu" and owner not in handed)
        weights += numel * cb * (1 if call.index == last else 2)
    # a GPU-updated layer's gradient waits on the device unless the run has a fixed activation budget
    on_device = streamed_grads_on_device(cfg.activation_budget_gb)
    grads = sum(prog.layer_numel(i) * 4 for i in range(prog.n_layers)
                if place[i] != "gpu" and not (on_device and i in res.gpu_update))
    streamed = sum(prog.layer_numel(i) for i in res.gpu_update)
    carry = cfg.micro_batch_size * cfg.seq_len * model_config(cfg.model, **cfg.model_overrides).dim * cb
    acts = act_out_per_step * carry
    per_in = 12 if on_device else 16
    batch = cfg.grad_accum * 2 * cfg.micro_batch_size * cfg.seq_len * 8  # token ids and targets, int64
    h2d = weights + per_in * streamed + acts + batch  # streamed update in: master, m, v (+ the gradient from the host), fp32
    # out: master, m, v (+ the compute copy, but a handed-over layer's, which stays on the device)
    d2h = grads + (12 + (cb if cb != 4 else 0)) * streamed - cb * sum(prog.layer_numel(i) for i in handed) + acts
    return {"method": "computed from the placement: non-resident layers' compute-dtype weights x visits (2, head 1; "
                      "none for GPU-updated layers handed over on the device), "
                      "fp32 gradients of non-gpu layers (and of GPU-updated ones with a fixed activation budget), "
                      f"GPU-updated ram layers' state {per_in} B in / 12+c B out per param (12 handed over), offloaded boundary "
                      "activations (counted act_out spans) both ways, the micro-batches' token ids and targets up",
            "h2d_bytes": h2d, "batch_h2d": batch, "d2h_bytes": d2h, "weights_h2d": weights, "grads_d2h": grads,
            "streamed_update_params": streamed, "activation_bytes_each_way": acts}


def _stage_seconds(tl: Timeline, steps: range) -> dict[str, float]:
    """Host-side seconds per step, summed over threads, by stage (CUDA: enqueue or wait time)."""
    out: dict[str, float] = {}
    for s in tl.spans():
        if s.step in steps:
            out[s.stage] = out.get(s.stage, 0.0) + (s.end - s.start) / len(steps)
    return dict(sorted(out.items()))


def update_window(tl: Timeline, steps: range, n_layers: int) -> dict[str, Any] | None:
    """Where a step's time goes around the update window, from host-side span ends (medians over
    ``steps``, each timed from the previous step's norm sync, where its updates start): the CPU
    and GPU-side update chains' ends, the head's first compute (the forward, waits included, is
    done), and the next sync (the backward has ended). On CUDA the training thread waits on the
    updated weights, so the forward's spans track the GPU there; the backward's are enqueue times,
    but the sync that ends it waits for the GPU."""
    rows: dict[str, list[float]] = {}
    for k in steps:
        prev, cur = tl.spans("norm_sync", step=k - 1), tl.spans("norm_sync", step=k)
        head = [s for s in tl.spans("compute", step=k) if s.layer == n_layers - 1]
        if not (prev and cur and head):
            continue
        t0 = prev[-1].end
        cpu = [s.end for s in tl.spans("update", step=k - 1)]
        gpu = [s.end for s in tl.spans("streamed_back", step=k - 1)]  # new weights on the host (the next forward's wait)
        state = [s.end for s in tl.spans("state_back", step=k - 1)]  # and master, m, v (behind them when loaded ahead)
        got = {"step_s": cur[-1].end - t0, "forward_done_s": head[0].start - t0, "head_and_backward_s": cur[-1].end - head[0].start,
               "cpu_updates_done_s": max(cpu) - t0 if cpu else None, "gpu_updates_done_s": max(gpu) - t0 if gpu else None,
               "gpu_state_back_s": max(state) - t0 if state else None}
        for key, v in got.items():
            if v is not None:
                rows.setdefault(key, []).append(v)
    if not rows:
        return None
    return {"method": "medians over the measured steps, seconds from the previous step's norm sync (host-side span ends): "
                      "the last CPU update, the last GPU-side update's new weights back on the host (and its master, m, v: "
                      "gpu_state_back_s), the head's first compute "
                      "(the forward with its waits on updated weights done), and this step's sync (the backward done)",
            **{k: median(v) for k, v in rows.items()}}


def _initial_model(cfg: TrainConfig) -> nn.Module:
    """The preset model with its initial weights in float32 (a new run's master state, as `mtc
    train` builds it: not rounded to the compute dtype) on the CPU; on CUDA initialised on the GPU
    (seconds, where the CPU takes minutes for billions of normal_ draws), then moved over."""
    if not cfg.device.startswith("cuda"):
        return build_model(cfg, dtype="float32")
    model = to_host(build_model(cfg, device=cfg.device, dtype="float32"))
    torch.cuda.empty_cache()
    return model


@torch.no_grad()
def to_host(model: nn.Module) -> nn.Module:
    """``model`` with its parameters and buffers moved into the engine's host buffers
    (`mtc.runtime.pinned.host_buffer`, unpinned: page-aligned mappings that ask for huge pages),
    not torch's allocator: the copy first-touches ~18.5 GB for the 4.6B shape, and `.to("cpu")`
    took 14 s of each P1 setting's start on the H100 (records of 2026-11-26, ``setup_s.init_model``)."""
    moved: dict[int, torch.Tensor] = {}  # by the original's id: a tied weight stays one tensor
    for mod in model.modules():
        for name, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is None:
                continue
            if id(t) not in moved:
                host = host_buffer(t.numel(), t.dtype, pinned=False).view(t.shape).copy_(t)
                moved[id(t)] = nn.Parameter(host, requires_grad=t.requires_grad) if name in mod._parameters else host
            (mod._parameters if name in mod._parameters else mod._buffers)[name] = moved[id(t)]
    return model


# -- the compiled plan, once per model shape ---------------------------------------------------


def plan_name(cfg: TrainConfig) -> str:
    """The plan directory's name for ``cfg``: one per traced shape and kernel options (what
    `mtc compile` fixes), so the settings of a shape, and parts at the same shape, share it."""
    d = cfg.to_dict()
    fields = {k: d[k] for k in (*PLAN_MODEL_FIELDS, *PLAN_KERNEL_FIELDS)} | {"compute_dtype": cfg.resolved_compute_dtype}
    return f"{cfg.model}-{hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]}"


def _counts(compiled: dict) -> dict[str, int]:
    return {"compiled": sum(not ct.loaded for ct in compiled.values()), "loaded": sum(ct.loaded for ct in compiled.values())}


def prepare_plan(cfg: TrainConfig, plan_dir: Path, shared: Path) -> dict[str, Any]:
    """Trace the preset of ``cfg`` in its compute dtype (on meta: the shapes are what a trace
    needs, as `mtc compile` traces a preset) and compile its plan into ``plan_dir``, unless an
    earlier setting of this shape has. Templates go through ``shared``, one kernel cache for the
    whole invocation: a template another shape compiled (P5's depths share theirs) loads from it."""
    if (plan_dir / PROGRAM_FILE).is_file():
        return {"prepared_here": False, "prepare_s": None, "prepare_templates": None}
    t = time.perf_counter()
    program = trace(build_model(cfg, device="meta"), cfg.micro_batch_size, cfg.seq_len)
    # under the run's TF32 setting (part of the staleness key), or every setting compiles it again
    compiled = compile_program(program, shared, matmul_fusion=cfg.matmul_fusion, allow_tf32=cfg.allow_tf32)
    shutil.copytree(shared, plan_dir / "kernels", dirs_exist_ok=True)
    save_plan(program, plan_dir)  # last: its program file marks the plan complete
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what tuning the matmuls held must not shrink the placement's GPU budget
    return {"prepared_here": True, "prepare_s": time.perf_counter() - t, "prepare_templates": _counts(compiled)}


def _plan_record(plan_dir: Path | None, prepared: dict[str, Any] | None, res: TrainResult) -> dict[str, Any]:
    """How this setting got its compiled plan and what that took (``train_report``: train()'s lines,
    the plan's compile or load time and, on CUDA, graph replay per template)."""
    if res.compiled is None:
        return {"kernels": "unfused", "how": "none: the traced ATen templates run under autograd", "compile_or_load_s": None}
    assert plan_dir is not None and prepared is not None, "fused settings run from a plan directory"
    in_train = _counts(res.compiled)
    made = prepared["prepare_templates"] or {"compiled": 0}
    return {"kernels": "fused", "dir": plan_dir.name, **prepared, "train_s": res.compile_s, "train_templates": in_train,
            "how": "compiled" if made["compiled"] or in_train["compiled"] else "loaded",
            "compile_or_load_s": (prepared["prepare_s"] or 0.0) + (res.compile_s or 0.0),
            "method": "prepare = trace + compile_program into the plan directory (the first setting of a shape only); "
                      "train = train() compiling or loading the plan's templates; compile_or_load_s = both",
            "train_report": res.graph_report}


def predicted(cfg: TrainConfig, measured_step_s: float | None = None) -> dict[str, Any]:
    """`mtc plan`'s prediction for this setting: on this machine's calibrated profile when it
    matches the device, else on the built-in profile of the lent H100 box when this is an H100
    (its figures were measured there), else none (and why). With ``measured_step_s``, the ratio."""
    from mtc.calibrate import builtin
    from mtc.errors import MTCError
    from mtc.planner import local_profile, make_plan

    prof, why = local_profile(cfg.device)
    if prof is None:
        cuda = cfg.device.startswith("cuda") and torch.cuda.is_available()
        if not (cuda and "H100" in torch.cuda.get_device_name()):
            return {"error": f"{why}; no built-in profile for this device"}
        prof = builtin("h100-box")
    try:
        plan = make_plan(cfg, prof)
    except MTCError as e:
        return {"profile": prof.name, "error": str(e)}
    except Exception as e:  # noqa: BLE001  (a planner bug must not cost the finished setting its measurements)
        return {"profile": prof.name, "error": f"planner failed: {type(e).__name__}: {str(e)[:300]}"}
    st = plan.step
    tokens = cfg.micro_batch_size * cfg.seq_len * cfg.grad_accum
    out = {"profile": prof.name, "placement": describe(plan.placement), "gpu_update_layers": sorted(plan.gpu_update),
           "update_prefetch_layers": plan.prefetch, "saved_activation_layers": plan.saves, "step_s": st.step_s, "tokens_per_s": tokens / st.step_s,
           "bottleneck": st.bottleneck, "stages_s": st.stages(), "choice": plan.choice}
    if measured_step_s:
        out["measured_over_predicted"] = measured_step_s / st.step_s
    return out


def mtc_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec['cfg']`` for warm-up + measured (+ one profiled) steps; the setting's figures."""
    cfg = TrainConfig.from_dict(spec["cfg"])
    warmup, measure = spec["warmup"], spec["measure"]
    cuda = cfg.device.startswith("cuda")
    t0 = time.perf_counter()
    model = _initial_model(cfg)
    t1 = time.perf_counter()
    plan_dir = prepared = None
    if cfg.fused:  # the shape's plan, compiled by its first setting; train() loads it
        plan_dir = Path(spec["plans"]) / plan_name(cfg)
        prepared = prepare_plan(cfg, plan_dir, Path(spec["plans"]) / "kernels")
    tp = time.perf_counter()
    # an in-memory store (with durability none it holds nothing), from the plan directory if fused
    run = open_run(cfg, None, model=model, plan=plan_dir)
    del model  # run.params holds the initial weights until train() has filled the tiers
    t2 = time.perf_counter()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_reset = _reset_peak_rss()
    tl = Timeline(keep_steps=None)  # the bench sums spans over every measured step
    # the profiled step is an extra one after the measured ones (P5 has none)
    probe = _Probe(warmup, measure, spec["profile"] and cuda and cfg.steps > warmup + measure, spec["verbose"])
    res = train(cfg, None, spec["data"], run=run, timeline=tl, on_step=probe)
    res.store.close()
    steps = [r.seconds for r in res.records]
    timed = steps[warmup : warmup + measure]
    med = median(timed)
    n_params = res.program.n_params()
    tokens = cfg.micro_batch_size * cfg.seq_len * cfg.grad_accum
    window = range(warmup, warmup + measure)  # timeline steps (0-based) of the measured records
    stages = _stage_seconds(tl, window)
    act_out = sum(1 for s in tl.spans("act_out") if s.step in window) / measure
    planned = _planned_bytes(res, cfg, act_out)
    a, b = probe.marks.get(warmup, {}), probe.marks.get(warmup + measure, {})
    counted = None
    if a.get("h2d") is not None and b.get("h2d") is not None:
        counted = {"method": "StepRecord.h2d_bytes / d2h_bytes (bytes the copy engine issued), per measured step",
                   "h2d_bytes": (b["h2d"] - a["h2d"]) / measure, "d2h_bytes": (b["d2h"] - a["d2h"]) / measure}
    update = stages.get("update", 0.0) + stages.get("update_streamed", 0.0)
    exposed = stages.get("fetch_wait", 0.0)
    clip = cfg.optim.clip_norm
    numels = res.tiers.tier_numel()
    cpu_params = numels.get("ram", 0) + numels.get("disk", 0) - planned["streamed_update_params"]  # what the host AdamW updated
    out: dict[str, Any] = {
        "setting": spec["setting"], "config": cfg.to_dict(), "durability": cfg.durability,
        "placement_spec": cfg.placement, "placement": describe(res.placement), "tier_params": numels,
        "gpu_update_spec": cfg.gpu_update, "gpu_update_layers": sorted(res.gpu_update),
        "gpu_update_params": planned["streamed_update_params"],
        # of them, the first that many loaded their state during the backward (`update_prefetch`)
        "update_prefetch_spec": cfg.update_prefetch, "update_prefetch_layers": res.prefetch,
        # of those, the ones whose visits copied their new weights within the device (`update_handoff`)
        "update_handoff": cfg.update_handoff,
        "handoff_layers": sorted(i for i, s in enumerate(res.tiers.layers)
                                 if s.device_copy is not None and s.device_copy.done() and s.device_copy.exception() is None
                                 and s.device_copy.result() is not None),
        # blocks that kept their matmul and attention outputs from forward to backward (`plan_saves`)
        "save_activations_spec": cfg.save_activations, "saved_activation_layers": res.saves,
        "saved_activation_bytes": res.saved_bytes,
        # layer-boundary activations past activation_budget_gb, to host memory and back (P5's offload)
        "offloaded_activation_bytes_per_step": res.offloaded_activation_bytes / max(1, res.end_step - res.start_step),
        "peak_device_activation_bytes": res.peak_device_activation_bytes,
        "n_params": n_params, "tokens_per_step": tokens,
        "setup_s": {"init_model": t1 - t0, "plan_prepare": tp - t1, "open_run": t2 - tp,
                    "train_until_first_step": (probe.first_begin or t2) - t2, "train_wall": res.wall_s,
                    # of train_until_first_step: allocating the tiers and filling them with the initial state
                    "state_fill": res.state_s},
        "plan": _plan_record(plan_dir, prepared, res),
        "steps_s": steps, "warmup_steps": warmup, "measured_steps": measure,
        "median_step_s": med, "tokens_per_s": tokens / med, "model_tflops": 6 * n_params * tokens / med / 1e12,
        # the steps run back to back, so their mean is the throughput; the median is the headline (as
        # for the baselines), and the two differ where steps alternate (the H200's P1-16 stateless on
        # 2026-11-27: 0.93 / 2.62 s; of four steps the median happened to equal the mean, 1.775):
        # spread = slowest / fastest
        "mean_step_s": sum(timed) / len(timed), "step_spread": max(timed) / min(timed),
        # the cost model beside the measurement: what the first GPU session validates it with
        "predicted_by_mtc_plan": predicted(cfg, med),
        "losses": [r.loss for r in res.records], "grad_norms": [r.grad_norm for r in res.records],
        "clip_norm": clip, "clipped_steps": sum(1 for r in res.records if clip is not None and r.grad_norm > clip),
        "skipped_steps": sum(1 for r in res.records if r.skipped),
        "timeline_s_per_step": {"method": "host-side span seconds per measured step, summed over threads "
                                          "(CUDA: enqueue or wait time, not GPU time)", **stages},
        "update_window": update_window(tl, window, res.program.n_layers),
        "optimizer": {"host_adamw": res.host_adamw, "update_s": update, "update_gpu_enqueue_s": stages.get("update_gpu", 0.0),
                      # the host AdamW's rate in the run, beside the one the GPU-update split was chosen with
                      "cpu_update_gparams_s": cpu_params / stages["update"] / 1e9 if stages.get("update") else None,
                      "cpu_update_planned_gparams_s": local_update_rates(cfg).cpu_params_per_s / 1e9,
                      "fetch_wait_s": exposed, "weights_wait_s": stages.get("weights_wait", 0.0),
                      "hidden_s": max(0.0, update - exposed), "exposed_upper_s": exposed,
                      "method": "update = CPU (update) + GPU-streamed (update_streamed) spans; exposed <= fetch_wait "
                                "(fetches blocked on an update); weights_wait = the training thread blocked on weights"},
        "transfer_per_step": {"planned": planned, "counted": counted,
                              "h2d_gbps_avg": (counted or planned)["h2d_bytes"] / med / 1e9,
                              "d2h_gbps_avg": (counted or planned)["d2h_bytes"] / med / 1e9,
                              "gbps_method": "bytes per step / median step time (average over the step, not the link rate)"},
        "host": {"state_bytes": res.host_state_bytes, "peak_rss_bytes": _proc_status("VmHWM"),
                 "peak_rss_method": "VmHWM during train() (reset before it)" if rss_reset else "VmHWM of the process",
                 "steady_rss_bytes": b.get("rss")},
        "gpu_profile": None,
    }
    h = out["host"]
    h["peak_rss_per_param"] = h["peak_rss_bytes"] / n_params if h["peak_rss_bytes"] else None
    h["steady_rss_per_param"] = h["steady_rss_bytes"] / n_params if h["steady_rss_bytes"] else None
    if cuda:
        # the run's watcher resets the peak counter after every step (each record holds its step's
        # peak): the run's peak is the largest of them and what came after the last reset; the
        # caching allocator's reserved pool only grows (nothing empties it during train())
        out["gpu_peak_allocated_bytes"] = max([torch.cuda.max_memory_allocated()]
                                              + [r.gpu_peak_bytes for r in res.records if r.gpu_peak_bytes is not None])
        out["gpu_peak_reserved_bytes"] = max(torch.cuda.max_memory_reserved(), torch.cuda.memory_reserved())
        if probe.prof is not None:
            try:
                out["gpu_profile"] = _gpu_profile(probe.prof, steps[warmup + measure])
            except Exception as e:  # noqa: BLE001
                out["gpu_profile"] = {"error": f"{type(e).__name__}: {e}"}
        elif probe.prof_error:
            out["gpu_profile"] = {"error": probe.prof_error}
        _compute_check(out)
    else:
        out["gpu_peak_allocated_bytes"] = out["gpu_peak_reserved_bytes"] = None
    return out


def _compute_check(out: dict[str, Any]) -> None:
    """Beside the plan's prediction: its modelled GPU work (compute + GPU optimizer) over the kernel
    busy time of the profiled step, the figure the cost model's GPU side is checked with
    (tests/mtc/test_costmodel_h100.py); meaningful where the GPU bounds the step (busy near 100 %)."""
    pred, prof = out.get("predicted_by_mtc_plan") or {}, out.get("gpu_profile") or {}
    stages, busy = pred.get("stages_s") or {}, prof.get("kernel_busy_s")
    if "GPU compute" in stages and busy:
        modelled = stages["GPU compute"] + stages.get("GPU optimizer", 0.0)
        pred["gpu_work_modelled_s"], pred["gpu_work_modelled_over_kernel_busy"] = modelled, modelled / busy


# -- the GPU-resident PyTorch baseline ---------------------------------------------------------


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (activation checkpointing per block)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False)


def _resident_bytes(mcfg: Any, micro_batch: int, seq: int, *, checkpoint: bool = True) -> int:
    """Rough GPU need of the resident baseline: 16 B/param (fp32 weights, grads, m, v), the fp32
    residual stream at every block boundary, one block's recompute, fp32 logits + grads, 2 GiB
    slack; without checkpointing every block's saved values instead of one block's recompute (at
    least its matmul outputs in bf16, as torch.compile's partitioner keeps them: 2 x (4 dim +
    2 ffn) bytes per token; eager keeps more, and a run that does not fit records the error)."""
    tokens = micro_batch * seq
    block = 16 * max(mcfg.dim, mcfg.ffn_dim) * 2 if checkpoint else mcfg.n_layers * 2 * (4 * mcfg.dim + 2 * mcfg.ffn_dim)
    acts = tokens * (mcfg.n_layers * mcfg.dim * 4 + block + 12 * mcfg.vocab_size)
    return 16 * mcfg.n_params() + acts + 2 * 2**30


def resident_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Plain PyTorch training of the same model, resident on the device; step times and peak memory."""
    cfg = TrainConfig.from_dict(spec["cfg"])
    device = torch.device(cfg.device)
    mcfg = model_config(cfg.model, **cfg.model_overrides)
    mb = spec["micro_batch"]
    accum = cfg.micro_batch_size * cfg.grad_accum // mb
    ckpt = spec.get("checkpoint", True)
    out: dict[str, Any] = {"setting": spec["setting"], "micro_batch_size": mb, "grad_accum": accum,
                           "torch_compile": spec["compile"], "activation_checkpointing": ckpt, "n_params": mcfg.n_params(),
                           # mtc's compiler is not used; torch.compile compiles inside the first steps
                           "plan": {"kernels": "torch.compile" if spec["compile"] else "torch eager",
                                    "how": "torch.compile in the warm-up steps (see first_step_s)" if spec["compile"]
                                    else "none: eager PyTorch", "compile_or_load_s": None}}
    if device.type == "cuda":
        need, (free, _) = _resident_bytes(mcfg, mb, cfg.seq_len, checkpoint=ckpt), torch.cuda.mem_get_info(device)
        out.update(estimated_need_bytes=need, gpu_free_bytes=free)
        if need > free:
            out["skipped"] = f"does not fit: needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
            return out
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = build(cfg.model, **cfg.model_overrides)  # fp32 weights; bf16 comes from autocast
    for i, blk in enumerate(model.layers):
        wrapped = _Checkpointed(blk) if ckpt else blk
        model.layers[i] = torch.compile(wrapped) if spec["compile"] else wrapped
    lm = LossModel(model)
    o = cfg.optim
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    sampler = BatchSampler(TokenFile.open(spec["data"]), batch_size=mb, seq_len=cfg.seq_len, seed=cfg.seed)
    amp = cfg.resolved_compute_dtype == "bfloat16"
    times, norms, cursor = [], [], 0
    for _ in range(cfg.steps):
        _sync(device)
        t = time.perf_counter()
        for _ in range(accum):
            ids, tg = (x.to(device, non_blocking=True) for x in sampler.batch(cursor))
            cursor += 1
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = lm(ids, tg) / accum
            loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, o.clip_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t)
        if spec["verbose"]:
            print(f"    step {len(times)}/{cfg.steps}: {times[-1]:8.3f} s", flush=True)
    w = spec["warmup"]
    med = median(times[w:])
    tokens = mb * accum * cfg.seq_len
    out["plan"]["first_step_s"] = times[0]
    out.update(steps_s=times, warmup_steps=w, median_step_s=med, tokens_per_s=tokens / med,
               model_tflops=6 * mcfg.n_params() * tokens / med / 1e12, grad_norms=[float(n) for n in norms],
               gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else None)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- running jobs, each in its own process on CUDA ---------------------------------------------

JOBS = {"mtc": mtc_job, "resident": resident_job}
_RUNNING: list[Any] = []  # the spawned job in flight: killed with this process (SIGTERM from the session's timeout)
# called with (part, setting, result) after each job: main() rewrites the part's record with what
# has finished, so a run killed mid-part still leaves its finished settings on disk
_PROGRESS: Any = None


def _child(conn: Any, spec: dict[str, Any]) -> None:
    try:
        conn.send(JOBS[spec["kind"]](spec))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which records it
        conn.send({"setting": spec["setting"], "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    conn.close()


def run_job(spec: dict[str, Any], *, isolate: bool, timeout_s: float) -> dict[str, Any]:
    """Run one job in this process, or in a fresh spawned one killed after ``timeout_s``."""
    print(f"  {spec['part']} / {spec['setting']} ...", flush=True)
    t = time.perf_counter()
    if not isolate:
        try:
            out = JOBS[spec["kind"]](spec)
        except Exception as e:  # noqa: BLE001
            out = {"setting": spec["setting"], "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    else:
        ctx = mp.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(send, spec), name=f"bench-{spec['setting']}")
        proc.start()
        _RUNNING.append(proc)
        send.close()
        if recv.poll(timeout_s):
            try:
                out = recv.recv()
            except EOFError:
                out = {"setting": spec["setting"], "error": "the job's process died without a result"}
        else:
            out = {"setting": spec["setting"], "error": f"timed out after {timeout_s:.0f} s"}
            proc.kill()  # now: the time left belongs to the record and the next part
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        _RUNNING.remove(proc)
        if proc.exitcode not in (0, None) and "error" not in out:
            out["exitcode"] = proc.exitcode
    out["job_wall_s"] = time.perf_counter() - t
    if _PROGRESS is not None:
        _PROGRESS(spec["part"], spec["setting"], out)
    if "error" in out:
        print(f"    {spec['setting']} failed: {out['error']}", flush=True)
    return out


# -- the parts ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Env:
    """What every part needs: device, smoke or not, data, step counts, the time limit."""

    smoke: bool
    device: str
    data: str
    warmup: int
    measure: int
    profile: bool
    isolate: bool
    verbose: bool
    deadline: float
    min_job_s: float
    micro_batch: int  # sequences per micro-batch of the mtc runs (smoke: 2)
    kernels: str = "auto"  # TrainConfig.kernels of the mtc runs (auto: fused on CUDA, unfused on the CPU)
    plans: str = ""  # where fused settings keep their shape's compiled plan (one per shape; --plans, or per invocation)

    def split(self, seqs: int) -> tuple[int, int]:
        """(micro_batch_size, grad_accum) for ``seqs`` sequences per step (smoke: 2 x 2 or 2 x 3)."""
        if self.smoke:
            return 2, (3 if seqs == 48 else 2)
        return self.micro_batch, seqs // self.micro_batch


def _shape(env: Env, full: dict, n_layers: int | None = None) -> dict:
    """The part's shape, or the tiny smoke shape (2 blocks unless told), with ``n_layers`` set if given."""
    base = SMOKE_SHAPE if env.smoke else full
    return dict(base, n_layers=n_layers) if n_layers is not None else dict(base)


def _cfg(env: Env, shape: dict, *, micro_batch: int, accum: int, placement: str, steps: int,
         activation_budget_gb: float | None = None) -> TrainConfig:
    return TrainConfig(
        model="tiny" if env.smoke else LLAMA, model_overrides=dict(shape),
        steps=steps, micro_batch_size=micro_batch, seq_len=32 if env.smoke else 1024, grad_accum=accum,
        device=env.device, compute_dtype="float32" if env.smoke else "bfloat16", placement=placement, kernels=env.kernels,
        gpu_update="auto", durability="none", activation_budget_gb=activation_budget_gb,
        # lr 3e-4 (a 4.6B model's, not the tiny default's 3e-3): at 3e-3 the first H100 run's P1-16 loss
        # rose at its 7th step in both settings (11.2 -> 11.8 / 12.1, grad norm 42 / 148); throughput
        # does not depend on it; the first steps' gradient norms (13-23 there) are far above the clip norm
        optim=OptimConfig(lr=3e-4, min_lr=3e-5, clip_norm=1.0),
    )


def _run(env: Env, part: str, setting: str, kind: str, cfg: TrainConfig, **extra: Any) -> dict[str, Any]:
    left = env.deadline - time.monotonic()
    if left < env.min_job_s:
        print(f"  {part} / {setting}: skipped, {left:.0f} s left of the time limit", flush=True)
        return {"setting": setting, "skipped": f"out of time ({left:.0f} s left)"}
    spec = {"kind": kind, "part": part, "setting": setting, "cfg": cfg.to_dict(), "data": env.data,
            "warmup": env.warmup, "measure": env.measure, "profile": env.profile, "verbose": env.verbose, "plans": env.plans,
            **extra}
    return run_job(spec, isolate=env.isolate, timeout_s=left)


def part_p1(env: Env, part: str, settings: list[str]) -> dict[str, Any]:
    """4.6B shape, 16 or 48 sequences per step: stateless vs the plan's placement."""
    mb, accum = env.split(16 if part == "P1-16" else 48)
    steps = env.warmup + env.measure + (1 if env.profile else 0)
    runs = [_run(env, part, s, "mtc", _setting(_cfg(env, _shape(env, P1_SHAPE), micro_batch=mb, accum=accum, steps=steps,
                                                   placement="auto"), s))
            for s in settings]
    return {"settings": runs, "goal_stateless_tflops": GOALS[part], "megatrain_tflops": MEGATRAIN[part]}


def _setting(cfg: TrainConfig, setting: str) -> TrainConfig:
    """``cfg`` for a named setting: auto (the plan's placement), stateless (all state in host RAM),
    or stateless-noprefetch (the same, with no GPU-updated layer's state loaded during the backward:
    the A/B of `update_prefetch` in one run), or stateless-nohandoff (stateless with every visit
    reading the host copy of the weights: the A/B of `update_handoff`), or auto-recompute (auto
    with every block recomputed in its backward visit: the A/B of `save_activations`)."""
    if setting == "auto":
        return cfg
    if setting == "auto-recompute":
        return dataclasses.replace(cfg, save_activations="off")
    if setting == "stateless-nohandoff":
        return dataclasses.replace(cfg, placement="stateless", update_prefetch=None, update_handoff=False)
    return dataclasses.replace(cfg, placement="stateless", update_prefetch=0 if setting == "stateless-noprefetch" else None)


def part_p3(env: Env, settings: list[str], baseline_mb: int, use_compile: bool, mtc_mb: int | None = None) -> dict[str, Any]:
    """1.5B shape that fits the GPU: mtc vs GPU-resident PyTorch (eager and torch.compile); mtc's
    micro-batch ``mtc_mb`` (None: the baseline's, so both sides run the same kernel sizes)."""
    mb, accum = env.split(16) if env.smoke else (mtc_mb or baseline_mb, 16 // (mtc_mb or baseline_mb))
    steps = env.warmup + env.measure + (1 if env.profile else 0)
    bcfg = _cfg(env, _shape(env, P3_SHAPE), micro_batch=mb, accum=accum, steps=env.warmup + env.measure, placement="auto")
    base_mb = min(baseline_mb, mb * accum)

    def mtc(s: str) -> dict[str, Any]:
        return _run(env, "P3", s, "mtc", _setting(_cfg(env, _shape(env, P3_SHAPE), micro_batch=mb, accum=accum, steps=steps,
                                                      placement="auto"), s))

    def base(name: str, comp: bool, ckpt: bool) -> dict[str, Any]:
        return _run(env, "P3", name, "resident", bcfg, micro_batch=base_mb, compile=comp, checkpoint=ckpt)

    # torch_compile_no_ckpt: what a user whose model fits without checkpointing would run, the
    # fair comparison for mtc's blocks that keep their activations (save_activations auto)
    variants = ([("torch_compile_no_ckpt", True, False), ("torch_compile", True, True)] if use_compile else []) + [
        ("torch_eager", False, True)]
    # the comparison first: mtc's first setting and the torch.compile baselines, then the rest (a
    # time limit then cuts the A/B settings and the eager baseline, not the ratio)
    runs: list[dict[str, Any] | None] = [None] * len(settings)
    bases: list[dict[str, Any] | None] = [None] * len(variants)
    order = [("mtc", 0)] * bool(settings) + [("base", j) for j, v in enumerate(variants) if v[1]] + [
        ("mtc", i) for i in range(1, len(settings))] + [("base", j) for j, v in enumerate(variants) if not v[1]]
    for kind, i in order:
        if kind == "mtc":
            runs[i] = mtc(settings[i])
        else:
            bases[i] = base(*variants[i])
    if not use_compile:
        bases += [{"setting": n, "skipped": "smoke run or --no-torch-compile"} for n in ("torch_compile", "torch_compile_no_ckpt")]
    # the goal's baselines are the issue's: GPU-resident with activation checkpointing, eager and
    # torch.compile'd; torch.compile without checkpointing is reported beside them, not judged
    m, b = _best(runs), _best([r for r in bases if r.get("activation_checkpointing", True)])
    b_all = _best(bases)
    return {"settings": runs, "baselines": bases, "mtc_best_tokens_per_s": m, "baseline_best_tokens_per_s": b,
            "ratio_mtc_over_baseline": m / b if m and b else None, "goal_ratio": P3_GOAL,
            "goal_baselines": "activation checkpointing (torch_eager, torch_compile)",
            "baseline_best_any_tokens_per_s": b_all, "ratio_mtc_over_any_baseline": m / b_all if m and b_all else None,
            "mtc_micro_batch": mb, "baseline_micro_batch": base_mb}


def _best(runs: list[dict[str, Any]]) -> float | None:
    return max((r["tokens_per_s"] for r in runs if "tokens_per_s" in r), default=None)


def part_p5(env: Env, shape_name: str, depths: tuple[int, int], budget_gb: float) -> dict[str, Any]:
    """One layer shape at two depths, stateless, fixed activation budget: GPU peak memory must stay flat."""
    shape = P1_SHAPE if shape_name == "p1" else P3_SHAPE
    mb, accum = env.split(16)
    runs = []
    for n in depths:
        cfg = _cfg(env, _shape(env, shape, n), micro_batch=mb, accum=accum, steps=env.warmup + env.measure,
                   placement="stateless", activation_budget_gb=budget_gb)
        runs.append(_run(env, "P5", f"stateless-{n}-blocks", "mtc", cfg))
    peaks = [r.get("gpu_peak_allocated_bytes") for r in runs]
    ratio = peaks[1] / peaks[0] if all(peaks) else None
    return {"settings": runs, "shape": shape_name, "depths": list(depths), "activation_budget_gb": budget_gb,
            "gpu_peak_ratio_deep_over_shallow": ratio, "goal_ratio_at_most": P5_GOAL}


def part_dp(env: Env, world: int, root: Path, repeats: int) -> dict[str, Any]:
    """The same run plain, under torchrun at one rank and at ``world`` ranks (bench/dp_runs.py),
    in ``repeats`` interleaved rounds (order alternating); each setting's figures are the median
    over rounds, and the torchrun-1 overhead is the per-round ratio's median and spread."""
    mb, accum = (2, 2 * world) if env.smoke else (env.micro_batch, 16 // env.micro_batch)
    if accum % world:
        raise SystemExit(f"bench_train: --world-size {world} must divide the {accum} micro-batches per step; "
                         f"e.g. --world-size {math.gcd(accum, world)}")
    shape = _shape(env, P3_SHAPE)
    cfg = _cfg(env, shape, micro_batch=mb, accum=accum, steps=env.warmup + env.measure, placement="stateless")
    # what a data-parallel run takes (mtc.dist.check_launch): the other ranks start from rank 0's
    # step-0 commit, and only ram-tier state is sharded (no GPU-streamed updates)
    cfg = dataclasses.replace(cfg, durability="weights", gpu_update="none")
    config = root / "run.json"
    config.write_text(json.dumps(cfg.to_dict()))
    tokens = mb * accum * cfg.seq_len
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in dp_runs.settings(world)}
    for k in range(repeats):
        for name, ranks in dp_runs.round_order(k, dp_runs.settings(world)):
            why = dp_runs.dist_engine_missing() if (ranks or 1) > 1 else None
            if why is None and ranks and ranks > 1 and not env.smoke and torch.cuda.device_count() < ranks:
                why = f"NCCL needs one GPU per rank: this machine has {torch.cuda.device_count()}"
            left = env.deadline - time.monotonic()
            if why is None and left < env.min_job_s:
                why = f"out of time ({left:.0f} s left)"
            if why is not None:
                print(f"  DP / {name}: not run: {why}", flush=True)
                rounds[name].append({"setting": name, "ranks": ranks, "error": why})
                continue
            r = dp_runs.run_setting(name, ranks, config=config, data=Path(env.data), root=root / f"round{k}", warmup=env.warmup,
                                    tokens_per_step=tokens, timeout_s=left)
            rounds[name].append(r)
            if "error" in r:
                print(f"    {name} failed: {r['error']}", flush=True)
    results = [dp_runs.median_round(rs) for rs in rounds.values()]
    return {"settings": results, "world_size": world, "config": cfg.to_dict(), "dist_engine": dp_runs.dist_engine_missing() is None,
            **dp_runs.ratios(results, world), "torchrun_1_overhead": dp_runs.overhead(rounds),
            "predicted_by_mtc_plan": dp_runs.predicted(cfg, world)}


# -- the table ---------------------------------------------------------------------------------


def _f(x: float | None, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and math.isfinite(x) else "-"


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """Medians and ratios, one row per setting, goals beside."""
    head = (f"{'part':6s} {'setting':22s} {'placement':22s} {'gpu upd':>8s} {'step s':>8s} {'tok/s':>9s} {'TFLOP/s':>8s} "
            f"{'busy%':>6s} {'H2D GB/s':>8s} {'D2H GB/s':>8s} {'opt s':>6s} {'exp<=s':>6s} {'GPU GiB':>8s} {'RSS B/p':>8s} "
            f"{'clip':>5s} {'plan s':>9s} {'pred s':>7s}")
    print("\n" + head)
    for part, rec in results.items():
        if part == "DP":
            _print_dp(rec)
            continue
        for r in rec.get("settings", []) + rec.get("baselines", []):
            name = r["setting"]
            if "median_step_s" not in r:
                print(f"{part:6s} {name:22s} {r.get('error') or r.get('skipped')}")
                continue
            prof, tr, opt = r.get("gpu_profile") or {}, r.get("transfer_per_step") or {}, r.get("optimizer") or {}
            gpu = r.get("gpu_peak_allocated_bytes")
            rss = (r.get("host") or {}).get("steady_rss_per_param")
            upd = r.get("gpu_update_params")
            upd_s = f"{upd / 1e9:.2f}B" if upd else "-"
            clip = f"{r['clipped_steps']}/{len(r['steps_s'])}" if "clipped_steps" in r else "-"
            plan = r.get("plan") or {}
            plan_s = (f"{plan['how'][0]} {plan['compile_or_load_s']:7.1f}" if plan.get("compile_or_load_s") is not None
                      else "-")
            pred = (r.get("predicted_by_mtc_plan") or {}).get("step_s")
            print(f"{part:6s} {name:22s} {r.get('placement', 'resident'):22.22s} {upd_s:>8s} "
                  f"{r['median_step_s']:8.3f} {r['tokens_per_s']:9.0f} {r['model_tflops']:8.1f} {_f(prof.get('busy_pct'), '6.1f')} "
                  f"{_f(tr.get('h2d_gbps_avg'), '8.1f')} {_f(tr.get('d2h_gbps_avg'), '8.1f')} {_f(opt.get('update_s'), '6.2f')} "
                  f"{_f(opt.get('exposed_upper_s'), '6.2f')} {_f(gpu and gpu / 2**30, '8.2f')} {_f(rss, '8.1f')} {clip:>5s} "
                  f"{plan_s:>9s} {_f(pred, '7.3f')}")
            if r.get("step_spread", 1.0) > SPREAD_NOTE:
                print(f"{'':6s}   steps uneven: {', '.join(f'{t:.3f}' for t in r['steps_s'][r['warmup_steps']:r['warmup_steps'] + r['measured_steps']])} s "
                      f"(mean {r['mean_step_s']:.3f}, slowest / fastest {r['step_spread']:.2f})")
            pr = r.get("predicted_by_mtc_plan") or {}
            if pr.get("gpu_work_modelled_over_kernel_busy"):
                print(f"{'':6s}   GPU work: modelled {pr['gpu_work_modelled_s']:.3f} s, the profiled step's kernels "
                      f"{prof['kernel_busy_s']:.3f} s ({pr['gpu_work_modelled_over_kernel_busy']:.2f}x)")
            win = r.get("update_window")
            if win:  # where the step goes around the update window (seconds from the last sync)
                print(f"{'':6s}   window s: forward done {win['forward_done_s']:.3f}, CPU updates done "
                      f"{_f(win.get('cpu_updates_done_s'), '.3f')}, GPU-side weights back {_f(win.get('gpu_updates_done_s'), '.3f')} "
                      f"(state {_f(win.get('gpu_state_back_s'), '.3f')}), "
                      f"head + backward {win['head_and_backward_s']:.3f}; prefetched layers {r.get('update_prefetch_layers')}"
                      + (f", of which handed over on the device {len(r['handoff_layers'])}" if r.get("handoff_layers") else ""))
        if part in GOALS:
            st = next((r for r in rec["settings"] if r["setting"] == "stateless" and "model_tflops" in r), None)
            got = f"{st['model_tflops']:.1f}" if st else "-"
            print(f"{part:6s} goal: stateless >= {GOALS[part]:.0f} model TFLOP/s (got {got}); MegaTrain on this box {MEGATRAIN[part]:.0f}")
        elif part == "P3":
            print(f"P3     mtc best / baseline best tokens/s: {_f(rec.get('ratio_mtc_over_baseline'), '.2f')} (goal >= {P3_GOAL}; "
                  f"baselines with activation checkpointing, as the issue defines them); against every baseline, "
                  f"torch.compile without checkpointing included: {_f(rec.get('ratio_mtc_over_any_baseline'), '.2f')}")
        elif part == "P5" and "depths" in rec:  # (a part cut off by the time limit has no ratio)
            print(f"P5     GPU peak {rec['depths'][1]} / {rec['depths'][0]} blocks: {_f(rec['gpu_peak_ratio_deep_over_shallow'], '.3f')} "
                  f"(goal <= {P5_GOAL}; activation budget {rec['activation_budget_gb']} GB)")
    print("busy%: GPU kernel time in one profiled step / its wall time; GB/s: bytes per step / step time; opt s: "
          "optimizer update seconds per step; exp<=s: fetch_wait (upper bound on exposed optimizer time); RSS B/p: "
          "steady host RSS per parameter; plan s: compiling (c) or loading (l) the fused plan, trace and tuning included "
          "(each shape's first setting compiles it, later ones load it); pred s: `mtc plan`'s step time for the setting "
          "(this machine's calibrated profile, else the built-in h100-box on an H100; '-' without one)")


def _print_dp(rec: dict[str, Any]) -> None:
    """Part DP's rows: step time and tokens/s per rank per setting, then the ratios."""
    for r in rec["settings"]:
        if "median_step_s" not in r:
            print(f"{'DP':6s} {r['setting']:22s} {r.get('error')}")
            continue
        print(f"{'DP':6s} {r['setting']:22s} {'ranks ' + str(r['ranks']):22s} {'':>8s} {r['median_step_s']:8.3f} "
              f"{r['tokens_per_s_per_rank']:9.0f} per rank")
    w = rec["world_size"]
    many = f"; torchrun-{w} per rank / plain: {_f(rec.get(f'torchrun_{w}_per_rank_over_plain'), '.3f')}" if w > 1 else ""
    print(f"DP     torchrun-1 / plain tokens/s (medians over rounds): {_f(rec['torchrun_1_over_plain'], '.3f')} "
          f"(goal >= {rec['goal_torchrun_1_over_plain']})" + many)
    ov = rec.get("torchrun_1_overhead") or {}
    if "ratio" in ov:
        r, noise = ov["ratio"], ov["noise_by_setting"]
        quart = f", quartiles {r['q1']:.3f}-{r['q3']:.3f}" if "q1" in r else ""
        print(f"DP     torchrun-1 / plain per round: median {r['median']:.3f}, range {r['min']:.3f}-{r['max']:.3f}{quart} "
              f"over {r['n']} rounds; noise (round medians' max/min - 1): "
              + ", ".join(f"{k} {_f(v and 100 * v, '.1f')}%" for k, v in noise.items())
              + f"; launch + start-up overhead {ov['launch_overhead_s']['median']:+.1f} s per run")
        if ov.get("launcher_cpu_cores"):
            c = ov["launcher_cpu_cores"]
            print(f"DP     torchrun's agent process while steps ran: {c['median']:.4f} of one core (median; range "
                  f"{c['min']:.4f}-{c['max']:.4f}), CPU taken from the rank's host")
        print(f"DP     verdict: {ov['verdict']}")
    elif ov:
        print(f"DP     torchrun-1 overhead: {ov['error']}")
    pred = rec.get("predicted_by_mtc_plan") or {}
    if "error" in pred:
        print(f"DP     mtc plan's prediction: {pred['error']}")
    else:
        print(f"DP     mtc plan's prediction on profile {pred['profile']!r}: " + "; ".join(
            f"{k.replace('_', ' ')}: {v['tokens_per_s_per_rank']:.0f} tokens/s per rank ({v['bottleneck']})"
            for k, v in pred.items() if k.startswith("world_")))


def main() -> None:
    """Parse, make the token file, run the chosen parts, write one record per part, print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma list of parts (default all: {','.join(PARTS)})")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 3 steps: the code paths, not speed")
    ap.add_argument("--settings", default="stateless,auto",
                    help="P1/P3 mtc settings, in order (stateless, stateless-noprefetch, stateless-nohandoff, auto, auto-recompute)")
    ap.add_argument("--warmup", type=int, help="steps left out of the median (default 2; 1 with --smoke)")
    ap.add_argument("--steps", type=int, help="measured steps after warm-up (default 4; 2 with --smoke)")
    ap.add_argument("--no-profile", action="store_true", help="CUDA: skip the profiled extra step (no GPU busy %%)")
    ap.add_argument("--no-torch-compile", action="store_true", help="P3: leave out the torch.compile baseline")
    ap.add_argument("--kernels", choices=("auto", "fused", "unfused"), default="auto",
                    help="mtc settings' kernels (default auto: fused on CUDA; --smoke --kernels fused runs the Triton "
                         "interpreter). Fused settings compile each shape's plan once and later settings load it")
    ap.add_argument("--micro-batch", type=int, default=4, help="mtc sequences per micro-batch; 16 and 48 per step (default 4)")
    ap.add_argument("--baseline-micro-batch", type=int, default=16, help="P3 resident baseline micro-batch (default 16)")
    ap.add_argument("--p3-micro-batch", type=int, help="P3 mtc micro-batch (default: the baseline's)")
    ap.add_argument("--p5-shape", choices=["p3", "p1"], default="p3", help="P5 layer shape (p1 needs ~165 GB of RAM at 40 blocks)")
    ap.add_argument("--p5-budget-gb", type=float, help="P5 activation_budget_gb (default 0.5; --smoke: 2^-15, two block "
                    "inputs of the smoke shape, so the offload path runs)")
    ap.add_argument("--plans", help="directory of the compiled plans, one per model shape (default: a new temporary one per "
                    "invocation); name one to share them between invocations: gpu_session.sh's P1-48 then loads the "
                    "plan its P1-16 compiled")
    ap.add_argument("--time-limit-s", type=float, default=480, help="start no setting after this (default 480)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="each setting in its own process (default: on CUDA yes, with --smoke no)")
    ap.add_argument("--quiet", action="store_true", help="no line per step")
    ap.add_argument("--world-size", type=int, help="run part DP only: plain vs torchrun at 1 and at N ranks (see above)")
    ap.add_argument("--repeats", type=int, help="part DP: interleaved rounds of its settings, medians over them (default 3; "
                    "1 with --smoke; 5 or more for the torchrun-1 overhead's spread)")
    a = ap.parse_args()
    parts = [p.strip() for p in a.only.split(",") if p.strip()]
    if a.world_size is not None:
        if a.world_size < 1:
            ap.error(f"--world-size must be at least 1, got {a.world_size}")
        parts = ["DP"]
    bad = [p for p in parts if p not in (*PARTS, "DP")]
    if bad:
        ap.error(f"unknown part(s) {', '.join(bad)}; choose from {', '.join(PARTS)}, e.g. --only P1-16,P3")
    for flag, v in (("--micro-batch", a.micro_batch), ("--baseline-micro-batch", a.baseline_micro_batch),
                    ("--p3-micro-batch", a.p3_micro_batch or a.baseline_micro_batch)):
        if v < 1 or 16 % v or (flag == "--micro-batch" and 48 % v):
            ap.error(f"{flag} must divide the sequences per step (16, and 48 for --micro-batch), got {v}; e.g. 4 or 8")
    settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    if not settings or any(s not in SETTINGS for s in settings):
        ap.error(f"--settings takes {', '.join(SETTINGS)} (any of them, in order), got {a.settings!r}")
    if not a.smoke and not torch.cuda.is_available():
        ap.error("the real benchmark needs a CUDA device; use --smoke on the CPU")
    start = _T0
    tmp = Path(tempfile.mkdtemp(prefix="mtc-bench-train-"))
    vocab = SMOKE_SHAPE["vocab_size"] if a.smoke else P1_SHAPE["vocab_size"]  # every part's shape shares it
    tokens = np.random.default_rng(0).integers(0, vocab, 200_000 if a.smoke else 4_000_000).astype(np.uint16)
    write_token_file(tmp / "tokens.bin", tokens, vocab_size=vocab, tokenizer="synthetic")
    env = Env(smoke=a.smoke, device="cpu" if a.smoke else "cuda", data=str(tmp / "tokens.bin"),
              warmup=a.warmup if a.warmup is not None else (1 if a.smoke else 2),
              measure=a.steps or ((6 if a.world_size else 2) if a.smoke else 4), profile=not a.smoke and not a.no_profile,
              isolate=a.isolate if a.isolate is not None else not a.smoke, verbose=not a.quiet,
              deadline=start + a.time_limit_s, min_job_s=0 if a.smoke else 45,
              micro_batch=a.micro_batch, kernels=a.kernels, plans=str(Path(a.plans).resolve() if a.plans else tmp / "plans"))
    # no CUDA call in this process: a context here would hold GPU memory the settings' processes measure
    print(f"bench_train{' smoke (CPU, tiny shapes)' if a.smoke else ''}: parts {', '.join(parts)}, "
          f"time limit {a.time_limit_s:.0f} s", flush=True)
    results: dict[str, dict[str, Any]] = {}
    paths: dict[str, Path] = {}
    done: dict[str, dict[str, Any]] = {}
    device = None if a.smoke else gpu_name()  # no CUDA context in this process (see above)

    def record(part: str, rec: dict[str, Any]) -> Path:
        name = f"bench_train-{'smoke-' if a.smoke else ''}{part}"
        paths[part] = write_record(name, json.loads(json.dumps(rec, default=str)), paths.get(part), device=device)
        return paths[part]

    def progress(part: str, setting: str, out: dict[str, Any]) -> None:
        done.setdefault(part, {})[setting] = out
        record(part, {"part": part, "smoke": a.smoke, "partial": "the part did not finish: its finished settings",
                      "settings_done": done[part]})

    def terminated(signum: int, _frame: Any) -> None:  # the device call's timeout: stop the job, keep the records
        for proc in list(_RUNNING):
            proc.kill()
        raise SystemExit(f"bench_train: stopped by signal {signum}; records so far: {', '.join(map(str, paths.values()))}")

    global _PROGRESS
    _PROGRESS = progress
    signal.signal(signal.SIGTERM, terminated)
    for part in parts:
        t = time.monotonic()
        if part == "DP":
            rec = part_dp(env, a.world_size, tmp, a.repeats or (1 if a.smoke else 3))
        elif part.startswith("P1"):
            rec = part_p1(env, part, settings)
        elif part == "P3":
            rec = part_p3(env, settings, a.baseline_micro_batch, use_compile=not a.smoke and not a.no_torch_compile,
                          mtc_mb=a.p3_micro_batch)
        else:
            budget = a.p5_budget_gb if a.p5_budget_gb is not None else 2.0**-15 if a.smoke else 0.5
            rec = part_p5(env, a.p5_shape, (2, 4) if a.smoke else (10, 40), budget)
        rec = {"part": part, "smoke": a.smoke, "part_wall_s": time.monotonic() - t,
               "env": {k: v for k, v in dataclasses.asdict(env).items() if k not in ("data", "deadline", "plans")}, **rec}
        results[part] = rec
        print(f"record: {record(part, rec)}", flush=True)
    print_table(results)
    print(f"total {time.monotonic() - start:.1f} s")
    shutil.rmtree(tmp, ignore_errors=True)  # part DP leaves store directories there


if __name__ == "__main__":
    main()
