"""The training loop: trace (or load the plan), check the machine, open the store, stream steps.

A store directory is the whole run: ``plan/`` (the traced Program), the state arrays, the commit
record and ``logs/`` (resolved config, metrics). The state lives in the placement's tiers (GPU,
host RAM, disk) while the run goes; every ``commit_every`` steps (and at the end) it is written
behind into the store's other generation and an atomic commit record follows, off the critical
path. Opening a store with a commit resumes there: same plan, state, data cursor and RNG state,
so a run stopped (or killed) after a commit continues exactly as if it had not stopped.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch
from torch import nn

from mtc import changes as _changes
from mtc import dist as _dist
from mtc import shards as _shards
from mtc import user_model
from mtc.batch_source import BatchSource
from mtc.config import TrainConfig, check_device
from mtc.data import BatchSampler, TokenFile, check_data_identity, check_fits, check_store_tokenizer, check_tokenizer_identity
from mtc.data.tokens import check_tokenizer_file
from mtc.errors import ConfigError, DataError, MTCError, PlanError, StoreError
from mtc.graphs.program import Program
from mtc.metrics import peak_rate
from mtc.models import build, model_config
from mtc.param_groups import apply_decay_groups, apply_frozen
from mtc.plan import load_plan, save_plan
from mtc.runtime import placement as pl
from mtc.runtime.executor import IGNORE_INDEX, StreamingExecutor
from mtc.runtime.graph_replay import graph_report, mixed_saves_bytes, replay_graphs
from mtc.runtime.optimizer import StepStats, StreamingAdamW
from mtc.runtime.pinned import host_buffer, pinning_report
from mtc.runtime.runners import CompiledRunner, LayerRunner
from mtc.runtime.schedule import lr_at
from mtc.runtime.state import flatten_layer
from mtc.runtime.tiers import StateTiers, state_kinds
from mtc.runtime.timeline import Timeline
from mtc.runtime.transfer import CopyEngine
from mtc.store import CommitRecord, TensorStore, state_array_name
from mtc.store.directory import os_error_reason
from mtc.trace_cache import trace_preset
from mtc.tracer import trace
from mtc.watch import RunWatcher, check_eval_data, mfu_devices
from mtc.weight_sources import record_write_start

if TYPE_CHECKING:
    from mtc.planner import UpdateRates
    from mtc.stagewatch import StageWatch

__all__ = ["Engine", "Run", "StepRecord", "TrainResult", "TrainingError", "at_dtype", "build_engine", "build_model", "init_state",
           "open_run", "plan_placement", "restore_matmul_precision", "run_disk_compute", "set_matmul_precision", "train"]


class TrainingError(MTCError):
    """Training cannot go on (e.g. too many consecutive steps with a non-finite loss)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepRecord:
    """Metrics of one optimizer step (``step`` counts completed steps, from 1)."""

    step: int
    total_steps: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    tokens: int  # positions the step computed: grad_accum x micro_batch_size x seq_len, padding included
    tokens_per_s: float  # of those positions (as throughput is quoted; the loss's share is `targets`)
    targets: int  # of those positions, the loss targets: not padding, not masked (SFT prompts)
    skipped: bool
    committed: bool
    h2d_bytes: int  # host-to-device bytes issued during the step (weights, optimizer state, activations)
    d2h_bytes: int  # device-to-host bytes issued during the step (gradients, optimizer state, activations)
    # mtc.watch.RunWatcher's figures (model FLOPs as mtc.metrics.model_flops; MFU over peak_tflops)
    tflops: float = 0.0
    mfu: float | None = None
    peak_tflops: float | None = None
    gpu_peak_bytes: int | None = None
    host_rss_bytes: int = 0
    phase_s: dict[str, float] = dataclasses.field(default_factory=dict)
    val_loss: float | None = None  # on the held-out split, with this step's weights (--eval-every)
    eval_s: float = 0.0


@dataclasses.dataclass(slots=True)
class Run:
    """An opened run: its store, program, the commit it starts from, and the initial weights."""

    store: TensorStore
    program: Program
    last: CommitRecord | None  # None: a new run (step 0 not committed yet, or durability 'none')
    params: dict[str, torch.Tensor] | None  # a new run's initial parameters (None when resuming)
    changes: list[str] = dataclasses.field(default_factory=list)  # fields --allow-change let differ on resume
    change_values: dict = dataclasses.field(default_factory=dict)  # {field: [old, new]} of those changes
    # an in-memory run opened from a plan directory: its compiled templates (`mtc compile`,
    # `mtc.compile`), copied into the run's kernel cache so they load instead of compiling
    plan_kernels: Path | None = None
    # a new run's plan directory (None: a resume, or a Program): where its compiled templates came from
    plan_source: Path | None = None

    @property
    def start_step(self) -> int:
        """The step training continues from."""
        return self.last.step if self.last is not None else 0


@dataclasses.dataclass(slots=True, repr=False)
class TrainResult:
    """What a call to `train` did. Its ``store`` is open (read the weights from it) until `close`;
    ``with train(...) as res:`` closes it at the end of the block."""

    start_step: int
    end_step: int
    losses: list[float]
    wall_s: float
    store: TensorStore
    program: Program
    generation: int
    placement: list[str]
    gpu_update: set[int]
    timeline: Timeline
    records: list[StepRecord]
    host_state_bytes: int
    tiers: StateTiers
    compiled: dict | None = None
    compile_s: float | None = None  # compiling or loading the fused plan's templates (None: unfused)
    graph_report: list[str] = dataclasses.field(default_factory=list)  # CUDA-graph replay per template (runtime/graph_replay.py)
    host_adamw: str = ""  # the host AdamW's implementation and how it used the cores (timed at start where it matters)
    prefetch: int = 0  # GPU-updated layers whose state loaded during the backward (`plan_prefetch`)
    state_s: float | None = None  # allocating the tiers and filling them (a new run's initial state, or a resume's read)
    saves: list[int] = dataclasses.field(default_factory=list)  # blocks that kept their activations (`plan_saves`)
    saved_bytes: int = 0  # what they kept on the device per step, all micro-batches
    # layer-boundary activations beyond `activation_budget_gb`, copied to host memory and back, over
    # the whole call; and the most the device held of them at once
    offloaded_activation_bytes: int = 0
    peak_device_activation_bytes: int = 0

    def close(self) -> None:
        """Close the run's store (its lock goes: the run can be resumed, in this process too)."""
        self.store.close()

    def __enter__(self) -> TrainResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        loss = f", last loss {self.losses[-1]:.4f}" if self.losses else ""
        where = self.store.path if self.store.path is not None else "in memory"
        return (f"TrainResult(steps {self.start_step}->{self.end_step}{loss}, {self.wall_s:.1f} s, "
                f"{self.program.n_layers} layers {pl.describe(self.placement)}, store {where})")


def build_model(cfg: TrainConfig, *, device: str | torch.device = "cpu", dtype: str | None = None) -> nn.Module:
    """The preset model of ``cfg``, initialised from ``cfg.seed`` (use device='meta' for shapes only),
    in ``dtype`` (default: the run's compute dtype; a new run's initial fp32 master state is built
    in float32); ``cfg.model`` may also be a factory's import path (see `mtc.user_model`)."""
    want = getattr(torch, dtype or cfg.resolved_compute_dtype)
    if cfg.model == user_model.CUSTOM:
        raise ConfigError("this run's model came from Python without an import path, so mtc cannot build its initial "
                          "weights: pass the model (mtc.train(model=...)), or record a factory: "
                          "mtc.save_plan(program, DIR, factory='package.module:function')")
    if user_model.is_factory_path(cfg.model):
        return user_model.build_from_factory(cfg.model, seed=cfg.seed, device=device).to(want)
    check_seq_len(cfg)
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = build(cfg.model, **cfg.model_overrides)
    return model.to(want)


def check_seq_len(cfg: TrainConfig) -> None:
    """ConfigError when ``cfg.seq_len`` exceeds the preset model's ``max_seq_len``."""
    mcfg = model_config(cfg.model, **cfg.model_overrides)
    if cfg.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}")


def _check_factory_unchanged(cfg: TrainConfig, program: Program, plan: object) -> None:
    """ConfigError when the factory a plan records now builds another model than the plan's (its
    code changed, its shapes not: the plan would silently train the old graph). The factory is
    traced again on the meta device, at the plan's shape and dtype, and the fingerprints compared."""
    b, t = program.batch["ids"].shape
    traced = trace(build_model(cfg, device="meta"), b, t)
    if user_model.program_fingerprint(traced) != user_model.program_fingerprint(program):
        src = plan if not isinstance(plan, Program) else "the plan given"
        raise ConfigError(f"factory {cfg.model} now builds another model than {src} was traced from (same parameters, "
                          f"other computation); compile it again: `mtc compile --model {cfg.model} -o {src}`, or "
                          "restore the factory's code")


def at_dtype(model: nn.Module, dtype: str) -> nn.Module:
    """``model`` in ``dtype`` for tracing; a copy when it is in another dtype (the caller's model is not changed)."""
    want = getattr(torch, dtype)
    first = next(model.parameters(), None)
    if first is None or first.dtype == want:
        return model
    return copy.deepcopy(model).to(want)


def _rng_state() -> dict[str, str]:
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def _set_rng_state(state: dict[str, str]) -> None:
    if "torch" in state:
        raw = base64.b64decode(state["torch"])
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


# fields that change how a run executes but not what it computes: free to differ on resume
_EXECUTION_FIELDS = ("disk_compute", "io_threads", "kernels", "placement", "gpu_update", "update_prefetch", "update_handoff", "optim_threads", "commit_every",
                     "host_adamw", "activation_budget_gb", "ram_budget_gb", "gpu_budget_gb", "durability", "max_nonfinite_steps",
                     "allow_tf32", "eval_every", "eval_batches", "cuda_graphs", "dist_timeout_s",
                     "matmul_fusion", "dp_collectives", "rank_dir", "save_activations")


# fields a resumed run may change when the user names them in --allow-change (recorded in the
# commit history); mtc.changes says why every other field may not
CHANGEABLE = _changes.CHANGEABLE


def _comparable(d: dict) -> dict:
    """The fields that must agree on resume; fields added since the store was made take their defaults."""
    defaults = TrainConfig().to_dict()
    full = {**defaults, **d, "optim": {**defaults["optim"], **(d.get("optim") or {})}}
    if full.get("compute_dtype") == "auto":  # what it means on the run's device: 'auto' on the CPU is float32
        full["compute_dtype"] = "bfloat16" if str(full.get("device", "")).startswith("cuda") else "float32"
    return {k: v for k, v in full.items() if k not in _EXECUTION_FIELDS and k in defaults}


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "model_overrides":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# -- placement and the fit check ---------------------------------------------------------------


def run_disk_compute(cfg: TrainConfig, program: Program, *, ram_bytes: int | None = None) -> str:
    """Where this run's disk layers keep their compute copy (`mtc.runtime.placement.resolve_disk_compute`)
    within ``ram_bytes`` (None: `_ram_budget`)."""
    numels = [program.layer_numel(i) for i in range(program.n_layers)]
    cbytes = torch.empty((), dtype=getattr(torch, cfg.resolved_compute_dtype)).element_size()
    explicit = None if cfg.placement.strip() == "auto" else pl.resolve_placement(cfg.placement, program.n_layers)
    return pl.resolve_disk_compute(cfg.disk_compute, explicit, numels, cbytes,
                                   ram_bytes=_ram_budget(cfg, program) if ram_bytes is None else ram_bytes,
                                   device_is_cuda=cfg.device.startswith("cuda"), tied_weights=_ties_weights(program))


def _ties_weights(program: Program) -> bool:
    """Whether a layer reads a weight another layer owns (tied embeddings): the executor's weight
    slots then hold two layers' weights (`mtc.runtime.placement.pipeline_host_bytes`)."""
    return any(program.params[k].layer != call.index for call in program.layers for k in call.param_keys())


def plan_placement(cfg: TrainConfig, program: Program, *, disk_compute: str | None = None) -> tuple[list[str], set[int]]:
    """Each layer's tier and the `ram` layers the GPU updates, from the config and the machine
    (``disk_compute``: the run's `run_disk_compute`, when the caller resolved it already)."""
    numels = [program.layer_numel(i) for i in range(program.n_layers)]
    cbytes = torch.empty((), dtype=getattr(torch, cfg.resolved_compute_dtype)).element_size()
    auto = None
    if cfg.placement.strip() == "auto":
        cuda = cfg.device.startswith("cuda")
        gpu = 0
        if cuda:
            gpu = cfg.gpu_budget_gb * 2**30 if cfg.gpu_budget_gb is not None else max(0, _gpu_free(cfg) - _gpu_workspace(cfg, program, cbytes))
        # the RAM budget holds the state tiers and the pipeline's buffers of each candidate placement
        budget = _ram_budget(cfg, program)
        dc = disk_compute if disk_compute is not None else run_disk_compute(cfg, program, ram_bytes=budget)
        auto = pl.auto_placement(numels, cbytes, gpu_bytes=int(gpu), ram_bytes=int(budget), disk_compute=dc,
                                 grads_on_device=cuda,
                                 pipeline=lambda p: pl.pipeline_host_bytes(p, numels, disk_compute=dc, device_is_cuda=cuda,
                                                                           tied_weights=_ties_weights(program)),
                                 # a --gpu-budget-gb is for state: resident layers' graphs are workspace beyond it
                                 gpu_extra=_graph_gpu_extra(cfg, program, cbytes) if cuda and cfg.gpu_budget_gb is None else None)
    placement = pl.resolve_placement(cfg.placement, program.n_layers, auto=auto)
    rates = _gpu_update_rates(cfg)
    cuda = cfg.device.startswith("cuda")
    on_device = pl.streamed_grads_on_device(cfg.activation_budget_gb)  # (a data-parallel run plans in mtc.dist_plan)
    gpu_left = _gpu_left(cfg, program, placement, cbytes) if cuda and cfg.gpu_update.strip() == "auto" else None
    gpu_update = pl.resolve_gpu_update(cfg.gpu_update, placement, numels, device_is_cuda=cuda, cpu_params_per_s=rates.cpu_params_per_s,
                                       pcie_bytes_per_s=rates.pcie_bytes_per_s, grads_on_device=on_device, compute_bytes=cbytes,
                                       gpu_bytes=gpu_left, prefetch=cfg.update_prefetch,
                                       one_way_bytes_per_s=rates.pcie_one_way_bytes_per_s)
    return placement, gpu_update


def plan_prefetch(cfg: TrainConfig, program: Program, placement: list[str], gpu_update: set[int]) -> int:
    """How many of the GPU-updated ram layers load their state during the backward
    (`mtc.runtime.placement.choose_prefetch`): ``cfg.update_prefetch``, or on CUDA as many as fit
    in the GPU memory left beside the placement's state, the workspace and the update's buffers."""
    numels = [program.layer_numel(i) for i in range(program.n_layers)]
    cbytes = torch.empty((), dtype=getattr(torch, cfg.resolved_compute_dtype)).element_size()
    cuda = cfg.device.startswith("cuda") and torch.cuda.is_available()
    left = _gpu_left(cfg, program, placement, cbytes) if cuda and gpu_update and cfg.update_prefetch is None else None
    return pl.choose_prefetch(cfg.update_prefetch, gpu_update, numels, cbytes, gpu_bytes=left,
                              grads_on_device=pl.streamed_grads_on_device(cfg.activation_budget_gb))


def trade_prefetch_for_saves(cfg: TrainConfig, program: Program | None) -> tuple[TrainConfig, str]:
    """``cfg`` with ``update_prefetch`` 0 when `mtc.planner.make_plan`, on this machine's
    calibrated profile (`mtc.planner.local_profile`), predicts the step faster with that GPU
    memory keeping blocks' activations instead (a step bound by GPU compute), and the plan's
    reason; else ``cfg`` unchanged and "" (no profile for this device: the memory-based choices
    stand, prefetch first). ``program`` None: the preset's, traced on the meta device."""
    from mtc.planner import local_profile, make_plan, trades_prefetch_for_saves

    if not cfg.device.startswith("cuda"):
        return cfg, ""
    prof, _ = local_profile(cfg.device)
    if prof is None or not trades_prefetch_for_saves(cfg, prof):
        return cfg, ""
    plan = make_plan(cfg, prof, program=program)
    if plan.cfg.update_prefetch == 0:
        return dataclasses.replace(cfg, update_prefetch=0), f"{plan.choice} (profile {prof.name})"
    return cfg, ""


def plan_saves(cfg: TrainConfig, program: Program, compiled: dict | None, placement: list[str], gpu_update: set[int],
               prefetch: int = 0, *, micro_batches: int | None = None, gpu_free: int | None = None) -> list[int]:
    """The blocks that keep their forward's saved values on the device until their backward
    visit (`cfg.save_activations`, chosen by `mtc.runtime.placement.choose_saves` from each
    compiled block's exact saved bytes): 'auto' fills, on CUDA, the GPU memory the placement, the
    workspace and the GPU-side updates leave, for every micro-batch of the step
    (``micro_batches``: this rank's, default ``cfg.grad_accum``); none on the CPU or with a fixed
    ``activation_budget_gb``. Unfused blocks keep their autograd graphs (`mtc.runtime.runners`),
    whose size no compiled template states: only an explicit choice keeps them. An explicit
    choice that some compiled block cannot take (no split graphs) raises ConfigError. ``gpu_free``:
    the device's free memory before the run allocated its state (the placement's state is
    subtracted here; read after `StateTiers`, it would be subtracted twice), default read now."""
    spec = cfg.save_activations.strip()
    blocks = [c.index for c in program.layers if program.templates[c.template].kind == "block"]
    if compiled is None:  # unfused
        try:
            return [] if spec == "auto" else pl.choose_saves(spec, blocks, [0] * len(blocks), [""] * len(blocks),
                                                              micro_batches=1, gpu_bytes=None, replay_copy=False)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    split = [i for i in blocks if compiled[program.layers[i].template].save_graph is not None]
    if spec not in ("off", "auto") and len(split) < len(blocks):
        why = "; ".join(sorted({f"{ct.template_id}: {ct.split_note or 'compiled without split graphs'}" for ct in compiled.values()
                                if ct.save_graph is None and program.templates[ct.template_id].kind == "block"}))
        raise ConfigError(f"--save-activations {spec}: {len(blocks) - len(split)} of {len(blocks)} blocks cannot keep their "
                          f"activations ({why}); use --save-activations auto or off")
    left = None
    tids = [program.layers[i].template for i in split]
    mixed: dict[str, int] = {}  # a template whose streamed layers may replay a joint and a backward graph per slot
    if spec == "auto" and split and cfg.device.startswith("cuda") and cfg.activation_budget_gb is None:
        cbytes = torch.empty((), dtype=getattr(torch, cfg.resolved_compute_dtype)).element_size()
        numels = [program.layer_numel(i) for i in range(program.n_layers)]
        left = _gpu_left(cfg, program, placement, cbytes, free=gpu_free) - pl.streamed_gpu_bytes(
            gpu_update, numels, cbytes, prefetch=prefetch, grads_on_device=pl.streamed_grads_on_device(cfg.activation_budget_gb))
        left -= pl.prefetch_margin(cfg.update_prefetch, prefetch)
        if cfg.cuda_graphs != "off":
            from mtc.costmodel import shape_from_program

            buffers = shape_from_program(program, cfg.model, cbytes).graph_buffers
            mixed = {t: mixed_saves_bytes(buffers[i]) for i, t in zip(split, tids, strict=True) if placement[i] != "gpu"}
    try:
        return pl.choose_saves(spec, split, [compiled[t].saved_bytes() for t in tids], tids,
                               micro_batches=cfg.grad_accum if micro_batches is None else micro_batches,
                               gpu_bytes=left, replay_copy=cfg.cuda_graphs != "off", mixed=mixed)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _gpu_left(cfg: TrainConfig, program: Program, placement: list[str], cbytes: int, *, free: int | None = None) -> int:
    """The GPU memory left for GPU-side updates' buffers beside the placement's state and the
    workspace, of ``free`` bytes (default: what the device has free now, none of it allocated yet)."""
    numels = [program.layer_numel(i) for i in range(program.n_layers)]
    left = pl.gpu_state_bytes(placement, numels, cbytes)
    if cfg.gpu_budget_gb is not None:
        return int(cfg.gpu_budget_gb * 2**30) - left
    # resident layers' CUDA graphs take their share beside it
    extra = _graph_gpu_extra(cfg, program, cbytes)
    free = _gpu_free(cfg) if free is None else free
    return free - _gpu_workspace(cfg, program, cbytes) - left - sum(extra[i] for i, t in enumerate(placement) if t == "gpu")


def _gpu_update_rates(cfg: TrainConfig) -> UpdateRates:
    """The rates the GPU-update cost model weighs for this run: this host's calibrated profile's
    when it matches the device (`mtc.planner.local_update_rates`), else the defaults."""
    from mtc.planner import local_update_rates

    return local_update_rates(cfg)


def _graph_gpu_extra(cfg: TrainConfig, program: Program, cbytes: int) -> list[int]:
    """Per layer, the GPU bytes its own CUDA graphs add when it is resident (`mtc.planner.graph_gpu_extra`)."""
    from mtc.costmodel import shape_from_program
    from mtc.planner import graph_gpu_extra

    return graph_gpu_extra(cfg, shape_from_program(program, cfg.model, cbytes))


def _gpu_budget(cfg: TrainConfig, program: Program, cbytes: int) -> int:
    """GPU bytes for state: ``--gpu-budget-gb``, else free memory less one layer's workspace."""
    return int(cfg.gpu_budget_gb * 2**30) if cfg.gpu_budget_gb is not None else max(0, _gpu_free(cfg) - _gpu_workspace(cfg, program, cbytes))


def _ram_budget(cfg: TrainConfig, program: Program) -> int:
    """Host RAM bytes for state: ``--ram-budget`` (GB, as GiB), else available memory minus a margin
    and, on the CPU device, minus the step's compute (`mtc.planner.ram_budget_for_state`)."""
    from mtc.costmodel import shape_from_program
    from mtc.planner import ram_budget_for_state

    cbytes = torch.empty((), dtype=getattr(torch, cfg.resolved_compute_dtype)).element_size()
    return ram_budget_for_state(cfg, shape_from_program(program, cfg.model, cbytes), None, cuda=cfg.device.startswith("cuda"))


def _gpu_free(cfg: TrainConfig) -> int:
    if not torch.cuda.is_available():
        return 0
    free, _ = torch.cuda.mem_get_info(torch.device(cfg.device))
    return free


def _gpu_workspace(cfg: TrainConfig, program: Program, cbytes: int) -> int:
    """GPU memory besides resident state: weight ring, gradient slabs, activations, one layer's work."""
    from mtc.costmodel import shape_from_program
    from mtc.planner import gpu_workspace

    return gpu_workspace(cfg, shape_from_program(program, cfg.model, cbytes))


def preflight(cfg: TrainConfig, program: Program, placement: list[str], store_dir: Path | None, *, new_run: bool,
              gpu_update: set[int] | None = None, seeded: TensorStore | None = None,
              resumed: TensorStore | None = None) -> None:
    """Refuse, before anything is written, a run this machine cannot hold: the plan's fit checks
    (`mtc.planner.check_fit`: disk for both generations, host RAM, GPU memory), one line each.
    ``seeded``: a store seeded by `mtc import` or --init-from, which the run starts from.
    ``resumed``: the store a run resumes in (its durability or placement may have changed: the
    state it holds already is written over, so it counts as free)."""
    from mtc.planner import check_fit

    written = _state_bytes(seeded, program, (1,)) if seeded is not None else None
    held = _state_bytes(resumed, program, (0, 1)) if resumed is not None else None
    check_fit(cfg, program, placement, gpu_update or set(), store_dir, new_run=new_run, seeded_written=written,
              resumed_held=held)


def _state_bytes(st: TensorStore, program: Program, generations: tuple[int, ...]) -> int:
    """Bytes of chunk data in the store's state arrays of ``generations`` and its gradient scratch:
    a seeded store's generation 1 is what an earlier attempt of the run wrote (the seed is
    generation 0); both generations are what a resumed run writes over."""
    from mtc.runtime.grad_spill import grad_scratch_name

    names = [state_array_name(i, k, g) for i in range(program.n_layers) for k in ("master", "m", "v") for g in generations]
    names += [grad_scratch_name(i) for i in range(program.n_layers)]
    total = 0
    for name in names:
        if st.has_array(name):
            for c in range(st.array_info(name).n_chunks):
                path = st.chunk_path(name, c)
                if path is not None and path.exists():
                    total += path.stat().st_size
    return total


# -- opening a run -----------------------------------------------------------------------------


def open_run(
    cfg: TrainConfig, store_dir: str | Path | None, *, model: nn.Module | None = None, overwrite: bool = False,
    plan: str | Path | Program | None = None, data: TokenFile | BatchSource | None = None, allow_change: tuple[str, ...] = (),
    init_from: str | Path | None = None,
) -> Run:
    """Open (resume) or create the run in ``store_dir``; None means an in-memory store (tests).

    A new run traces ``model`` (default: the preset of ``cfg``) or takes the program of the plan
    directory ``plan`` (from `mtc compile`, whose generated kernels are copied along), checks that
    the machine can hold it, then creates the store and saves the plan. Its initial state is
    written and committed as step 0 by `train` (from RAM, in the chosen durability mode). A resumed
    run uses the plan saved in its store. With ``data``, the token file is checked against the
    model's vocabulary and the sequence length first, and on resume against the data the run
    was committed with. ``allow_change`` names fields (of `CHANGEABLE`) a resumed run may change.
    ``init_from`` (a run's store or a Hugging Face checkpoint directory) first seeds a new store
    with its weights (see `mtc.warmstart`): the run starts from them with fresh optimizer state.
    Every check runs before anything is written.
    """
    _changes.config_changes({}, {}, allow_change, str(store_dir))  # unknown or never-changeable names: refused first
    cfg.validate()
    check_device(cfg)
    if cfg.fused and cfg.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            "--kernels fused on the CPU runs Triton's interpreter, which must be enabled before start: "
            "set TRITON_INTERPRET=1 (slow: for tests), or pass --unfused on the CPU"
        )
    if isinstance(data, BatchSource) and cfg.eval_every:
        raise ConfigError(f"eval_every={cfg.eval_every} validates on a token file's val split, and batches from Python have "
                          "none: pass eval_every=0 (and evaluate the run with `mtc eval RUN --data FILE`), "
                          "or give a token file as data")
    if isinstance(data, TokenFile):
        check_fits(data, cfg.seq_len, split="train")  # (the split training samples: checked now, before the store is written)
        check_eval_data(data, (cfg.micro_batch_size, cfg.seq_len), cfg)
    path = Path(store_dir) if store_dir is not None else None
    if init_from is not None:  # seed the store, then open it below like any seeded store
        from mtc.warmstart import init_from as seed_store

        if path is None:
            raise ConfigError("init_from needs a store directory to write the starting weights into")
        if isinstance(data, TokenFile):
            data.check_vocab(model_config(cfg.model, **cfg.model_overrides).vocab_size)
            # the source's tokenizer (a run's RUN/tokenizer/, a checkpoint's own) must have made the
            # data: refused before the new store is seeded
            src = Path(init_from)
            check_tokenizer_file(src / "tokenizer" / "tokenizer.json" if (src / "commit.json").is_file()
                                 else src / "tokenizer.json", data)
        seed_store(init_from, path, cfg, overwrite=overwrite)
        overwrite = False
    if path is not None and (path / "commit.json").exists() and not overwrite:
        store = TensorStore.open(path, io_threads=cfg.io_threads)
        try:
            last = store.last_commit()
            if last is None:
                raise StoreError(f"store {path} has no commit; remove it or pass overwrite to start over")
            if _shards.is_sharded(last) and not _dist.current_world().distributed:
                # its state is in the ranks' shard stores: one process would look for it in the run
                # directory, and the arrays it created there on the way made `mtc verify` call the
                # healthy run damaged
                n = _shards.shard_world(last)
                raise StoreError(f"store {path} is a data-parallel run, last committed at world size {n} (its state is in "
                                 f"the ranks' shard stores): resume it with `torchrun --nproc-per-node {n} -m mtc train ...`, "
                                 f"or run `mtc reshard {path} --world-size 1` first to continue in one process")
            from mtc.warmstart import is_seeded, open_seeded

            if is_seeded(last):  # imported or --init-from weights at step 0: a new run starts from them
                program = open_seeded(cfg, path, last, plan=plan)
                if apply_decay_groups(program, cfg.optim) is not program:
                    raise ConfigError("optim.no_decay / optim.decay_min_ndim: an imported or --init-from run keeps the "
                                      "default weight-decay groups (its state was laid out for them); drop these fields")
                if isinstance(data, TokenFile):
                    data.check_vocab(_model_vocab(program))
                    check_store_tokenizer(path, data)  # RUN/tokenizer/ (an import's) must be the data's tokenizer
                placement, gpu_update = plan_placement(cfg, program)
                # (GPU-updated layers' gradients and scratch count toward the GPU check)
                preflight(cfg, program, placement, path, new_run=False, gpu_update=gpu_update, seeded=store)
                save_plan(program, path / "plan")
                return Run(store, program, last, None, [])
            saved, now = _flat(_comparable(last.config)), _flat(_comparable(cfg.to_dict()))
            changes = _changes.config_changes(saved, now, allow_change, str(path))
            values = _changes.change_values(saved, now, changes)
            if data is not None:
                # another tokenizer is refused whatever --allow-change says: the ids would mean other tokens
                check_tokenizer_identity(last.meta.get("data"), data.identity(), where=f"store {path}")
                check_store_tokenizer(path, data)
                check_data_identity(last.meta.get("data"), data.identity(), "data" in allow_change)
                try:
                    check_data_identity(last.meta.get("data"), data.identity(), False)
                except DataError:
                    changes.append("data")
                    values["data"] = [(last.meta.get("data") or {}).get("path"), data.identity().get("path")]
            program = load_plan(path / "plan")
            if plan is not None:  # the plan given must be the one the store was made with
                user_model.check_same_plan(plan, program, str(path))
            if data is not None:
                data.check_vocab(_model_vocab(program))
            if not _dist.current_world().distributed:  # (a data-parallel rank's fit: its own shard, checked by mtc.shards)
                placement, gpu_update = plan_placement(cfg, program)
                preflight(cfg, program, placement, path, new_run=False, gpu_update=gpu_update, resumed=store)
        except BaseException:
            store.close()
            raise
        return Run(store, program, last, None, changes, values)
    # the initial master state is the fp32 initialisation, not its rounding to the compute dtype
    preset = model is None and not user_model.is_factory_path(cfg.model)
    model = model if model is not None else build_model(cfg, dtype="float32")
    if isinstance(plan, Program):
        program = plan
    elif plan is not None:
        program = load_plan(plan)
        rec = user_model.read_model_record(plan)
        if rec and rec.get("program_sha256") not in (None, user_model.program_fingerprint(program)):
            raise PlanError(f"plan {plan}: its program.json is not the program its model.json was written for (a "
                            "compile into the directory still running, or files of two plans); compile the plan again")
    elif preset:  # a preset's trace needs only its shapes: on meta (the same program), kept between runs
        program = trace_preset(cfg)
    else:
        program = trace(at_dtype(model, cfg.resolved_compute_dtype), cfg.micro_batch_size, cfg.seq_len)
    user_model.check_params_match(model, program, f"plan {plan}" if plan is not None else "the traced program")
    if plan is not None and user_model.is_factory_path(cfg.model):
        _check_factory_unchanged(cfg, program, plan)
    program = apply_decay_groups(apply_frozen(program, model), cfg.optim)
    if data is not None:
        data.check_vocab(_model_vocab(program))
    placement, gpu_update = plan_placement(cfg, program)
    preflight(cfg, program, placement, path, new_run=True, gpu_update=gpu_update)
    store = TensorStore.create(path, io_threads=cfg.io_threads, overwrite=overwrite)
    try:
        if path is not None:
            try:
                save_plan(program, path / "plan")
                user_model.write_model_record(path / "plan", cfg.to_dict(), program)  # what a resume checks a plan against
                if plan is not None and not isinstance(plan, Program) and Path(plan, "kernels").is_dir():  # generated once, by `mtc compile`
                    shutil.copytree(Path(plan, "kernels"), path / "plan" / "kernels", dirs_exist_ok=True)
            except OSError as e:  # ENOSPC, EROFS, EACCES: nothing is committed yet
                raise StoreError(f"could not write the plan into {path / 'plan'}: {e.strerror or e}; nothing was "
                                 "committed: fix that and the same command starts the run over") from e
    except BaseException:
        store.close()
        raise
    # an in-memory store has no plan dir to copy a plan's kernels into now: train() seeds its cache from them
    kernels = Path(plan, "kernels") if path is None and plan is not None and not isinstance(plan, Program) else None
    source = Path(plan) if plan is not None and not isinstance(plan, Program) else None
    return Run(store, program, None, {k: v.detach() for k, v in model.named_parameters()}, plan_kernels=kernels,
               plan_source=source)


def last_committed_step(store_dir: str | Path) -> int | None:
    """The step of a store directory's last commit (None: no commit), read without taking its lock."""
    f = Path(store_dir) / "commit.json"
    if not f.is_file():
        return None
    try:
        return int(json.loads(f.read_text())["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise StoreError(f"commit record {f} is malformed ({e}); see `mtc verify` and `mtc repair`") from None


# -- the loop ----------------------------------------------------------------------------------


class _Loader:
    """Samples the next step's micro-batches on its own thread while the current step runs.

    For a CUDA run (``pin``) each step's batches are copied into page-locked buffers allocated once
    and reused in turn, so their copies to the device are asynchronous and no step allocates
    pinned memory. `PINNED_SETS` sets suffice: while step k runs, the queue holds k+1 and k+2 and
    the thread fills k+3; step k-1's set is free again because its copies to the device were
    queued before its loss, which the training loop read before it asked for step k."""

    _QUEUED = 2
    PINNED_SETS = _QUEUED + 2  # the step's own, the queued ones, the one being filled

    def __init__(self, sampler: BatchSampler, grad_accum: int, start: int, pin: bool, *, offset: int = 0,
                 stride: int | None = None, count_all: bool = False) -> None:
        # data parallel: this rank's micro-batches are [offset, offset + grad_accum) of each step's
        # `stride` (the global grad_accum), so the ranks split the global batch contiguously.
        # ``count_all``: `targets` counts the whole global step's (rank 0 reports them; the batches
        # are a pure function of their index, so it reads the other ranks' targets to count them)
        self.sampler, self.n, self.pin = sampler, grad_accum, pin
        self.offset, self.stride = offset, stride if stride is not None else grad_accum
        self.count_all = count_all
        self.targets = 0  # loss targets (not IGNORE_INDEX) of the step `next` returned last
        self._sets: list[list[torch.Tensor] | None] = [None] * self.PINNED_SETS
        self.pinned_allocations = 0  # page-locked buffers allocated so far (one set's worth per set, then none)
        self._q: queue.Queue = queue.Queue(maxsize=self._QUEUED)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(start,), name="mtc-loader", daemon=True)
        self._thread.start()

    def _into_pinned(self, k: int, mbs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``mbs`` copied into the ``k``-th step's set of reused page-locked buffers (allocated on first use;
        a batch of another shape or dtype than the set's gets buffers of its own, and the step then
        refuses it by shape, or trains on it)."""
        flat = [t for pair in mbs for t in pair]
        bufs = self._sets[k % self.PINNED_SETS]
        if bufs is None or [(b.shape, b.dtype) for b in bufs] != [(t.shape, t.dtype) for t in flat]:
            bufs = [host_buffer(t.numel(), t.dtype, pinned=True).view(t.shape) for t in flat]
            self.pinned_allocations += len(bufs)
            self._sets[k % self.PINNED_SETS] = bufs
        for b, t in zip(bufs, flat, strict=True):
            b.copy_(t)
        return [(bufs[2 * j], bufs[2 * j + 1]) for j in range(len(mbs))]

    def _run(self, cursor: int) -> None:
        k = 0
        while not self._stop.is_set():
            try:
                mbs = [self.sampler.batch(cursor + self.offset + j) for j in range(self.n)]
                others = [j for j in range(self.stride) if not self.offset <= j < self.offset + self.n] \
                    if self.count_all else []
                targets = sum(int((y != IGNORE_INDEX).sum()) for _, y in mbs) + sum(
                    int((self.sampler.batch(cursor + j)[1] != IGNORE_INDEX).sum()) for j in others)
                if self.pin:
                    mbs = self._into_pinned(k, mbs)
                item: object = (mbs, targets)
            except BaseException as e:  # handed to the consumer, which raises it
                item = e
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            cursor += self.stride
            k += 1

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's micro-batches."""
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        mbs, self.targets = item
        return mbs

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout=5)


def _strict(rec: dict) -> dict:
    """``rec`` with non-finite floats as None: metrics.jsonl is strict JSON (Python's NaN / Infinity
    tokens are not JSON; jq and JSON.parse reject the line). A skipped step says so in ``skipped``."""
    def value(v: object) -> object:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return _strict(v) if isinstance(v, dict) else v

    return {k: value(v) for k, v in rec.items()}


def _open_metrics(path: Path) -> TextIO:
    """``logs/metrics.jsonl`` for appending, its last line whole: a line a crash tore is cut off, so
    the next record starts a line of its own (the step it was for is redone and logged again)."""
    try:
        with open(path, "ab+") as f:
            end = f.seek(0, os.SEEK_END)
            if end:
                f.seek(max(0, end - (1 << 16)))
                tail = f.read()
                start, cut = end - len(tail), tail.rfind(b"\n")
                if tail and not tail.endswith(b"\n"):
                    if cut >= 0 or start == 0:
                        f.truncate(start + cut + 1)  # (cut -1 at the file's start: the file was one torn line)
                    else:  # no line end in the last 64 KiB: not a record; end it rather than guess
                        f.write(b"\n")
        return open(path, "a")
    except OSError as e:
        raise StoreError(f"opening {path} failed ({os_error_reason(e)}); the store's last commit is intact: free space "
                         "(or fix the file system), then resume with the same command") from e


def set_matmul_precision(cfg: TrainConfig, device: torch.device) -> tuple[bool, bool]:
    """On CUDA, let fp32 matmuls (and cuDNN's convolutions) run in TF32 as ``cfg.allow_tf32`` says
    (on by default: fp32 compute without it runs at a fraction of the tensor cores' rate); the CPU's
    flags stay as they are. Returns the flags as they were, for `restore_matmul_precision`."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.allow_tf32
    return before


def restore_matmul_precision(before: tuple[bool, bool]) -> None:
    """Put back the flags `set_matmul_precision` found."""
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def train(
    cfg: TrainConfig,
    store_dir: str | Path | None,
    data: str | Path | TokenFile | BatchSource,
    *,
    model: nn.Module | None = None,
    stop_after: int | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    overwrite: bool = False,
    run: Run | None = None,
    timeline: Timeline | None = None,
    serialize: bool = False,
    allow_change: tuple[str, ...] = (),
    notify: Callable[[str], None] | None = None,
    init_from: str | Path | None = None,
    watch: StageWatch | None = None,
) -> TrainResult:
    """Train to ``cfg.steps`` (or stop once ``stop_after`` steps are done), resuming if possible.

    ``on_step`` is called after every step (the CLI draws its progress bar there). The returned
    store is open; close it (or read the weights from it) when done. ``serialize`` waits for
    every copy and kernel as it is issued (the race tests' reference schedule). ``notify`` receives
    messages for the user (the CLI prints them), e.g. what an interruption is waiting for.
    ``init_from``: start a new run from the weights of a run's store or a Hugging Face checkpoint.
    ``watch`` compares each step's stages with the run's plan and may notify once (a slow disk).
    """
    t0 = time.perf_counter()
    _dist.check_launch(cfg, _dist.current_world(), store_dir)  # before joining the other ranks
    world = _dist.init_world(cfg.device, cfg.dist_timeout_s)  # one rank without torchrun: nothing happens
    tokens = data if isinstance(data, (TokenFile, BatchSource)) else TokenFile.open(data)
    if not world.is_root and run is None:  # the other ranks open rank 0's store once it holds the start state
        run = _dist.open_follower(cfg, store_dir)
    if run is None:
        try:
            run = open_run(cfg, store_dir, model=model, overwrite=overwrite, data=tokens, allow_change=allow_change,
                           init_from=init_from)
        except BaseException as e:
            _dist.root_failed(world, e)  # the other ranks wait for the store: they stop with this reason
            raise
    if world.is_root:
        _dist.root_ready(world)  # the other ranks may open the run directory and its plan now
    try:
        _dist.check_same_config(world, cfg)  # before any rank writes its shard
    except BaseException:
        run.store.close()
        raise
    st, program = run.store, run.program
    if isinstance(tokens, BatchSource):  # a list too short is known now, not after the steps it can feed
        first_step = run.start_step
        try:
            tokens.check_length(run.last.data_cursor if run.last is not None else 0,
                                max(0, (cfg.steps if stop_after is None else min(cfg.steps, stop_after)) - first_step),
                                cfg.grad_accum)
        except BaseException:
            st.close()
            raise
    timeline = timeline if timeline is not None else Timeline()
    device = torch.device(cfg.device)
    cdtype = getattr(torch, cfg.resolved_compute_dtype)
    tf32 = set_matmul_precision(cfg, device)
    parts: list = []
    record_gates: list[threading.Event] = []  # commits waiting for their step's metrics record (`_after_record`)
    try:
        # a data-parallel rank's store holds its shard only: its disk layers keep the compute copy in RAM
        dc = "ram" if world.distributed else run_disk_compute(cfg, program)
        # GPU memory for the update prefetch's buffers, or for blocks' saved activations (the cost model's pick)
        pcfg, why = (cfg, "") if world.distributed else trade_prefetch_for_saves(cfg, program)
        if why and notify is not None:
            notify(why)
        placement, gpu_update = plan_placement(pcfg, program, disk_compute=dc)
        placement, gpu_update = _dist.data_parallel_placement(world, cfg, placement, gpu_update, program,
                                                              gpu_bytes=_gpu_budget(cfg, program, cdtype.itemsize) if device.type == "cuda" else None)
        _dist.check_same_placement(world, pl.describe(placement), sorted(gpu_update))  # before any rank writes its shard
        numels = [program.layer_numel(i) for i in range(program.n_layers)]
        spill = pl.choose_grad_spill(placement, numels, cdtype.itemsize, ram_bytes=_ram_budget(cfg, program),
                                     disk_compute=dc, device_is_cuda=device.type == "cuda", tied_weights=_ties_weights(program),
                                     gpu_bytes=_gpu_budget(cfg, program, cdtype.itemsize) if device.type == "cuda" else None)
        prefetch = 0 if world.distributed else plan_prefetch(pcfg, program, placement, gpu_update)
        gpu_free = _gpu_free(cfg) if device.type == "cuda" else None  # before the state below takes its share
        t_state = time.perf_counter()
        tiers = StateTiers(program, placement, device, cdtype, streamed=gpu_update, disk_compute=dc,
                           spill_grads=spill, rank=world.rank, world_size=world.world_size,
                           sharded=world.distributed,
                           streamed_grads_on_device=pl.streamed_grads_on_device(cfg.activation_budget_gb, distributed=world.distributed))
        durable = cfg.durability != "none"
        committed_start = True  # a commit names the start state's generation (disk layers must not overwrite it)
        shard_st = None
        if world.distributed:  # each rank's shard in its own store, one global commit (mtc.shards)
            first = CommitRecord(step=0, generation=0, data_cursor=0, rng_state=_rng_state(), config=cfg.to_dict(),
                                 time_unix=time.time(), durability=cfg.durability, meta={"data": tokens.identity()})
            shard_st, last = _shards.start_state(Path(store_dir), st, program, tiers, world.rank, world.world_size, run.last,
                                                 run.params, first, cfg.io_threads)
            parts.append(shard_st)
        elif run.last is None:  # a new run: initial state from the model, committed as step 0
            init_state(st, tiers, program, run.params, cfg.durability)
            last = CommitRecord(step=0, generation=0, data_cursor=0, rng_state=_rng_state(), config=cfg.to_dict(),
                                time_unix=time.time(), durability=cfg.durability, meta={"data": tokens.identity()})
            if durable and world.is_root:
                st.commit(last)
            committed_start = durable
        else:
            tiers.create_arrays(st, cfg.durability)
            last = run.last
            tiers.load(st, last.generation, last.config.get("durability", "full"))
        run.params = None  # the tiers hold the state now
        state_s = time.perf_counter() - t_state
        metrics = None
        if st.path is not None and world.is_root:
            logs = st.path / "logs"
            logs.mkdir(exist_ok=True)
            # the cost model's rates, when it chose the GPU-updated layers
            rates = _gpu_update_rates(cfg).line() if device.type == "cuda" and cfg.gpu_update.strip() == "auto" else None
            resolved = dict(cfg.to_dict(), resolved_placement=pl.describe(placement), gpu_update_layers=sorted(gpu_update),
                            gpu_update_rates=rates, update_prefetch_layers=prefetch,
                            resolved_disk_compute=dc,
                            resolved_compute_dtype=cfg.resolved_compute_dtype,
                            mfu_denominator=peak_rate(device, cfg.resolved_compute_dtype, allow_tf32=cfg.allow_tf32).source)
            (logs / f"config-step{last.step}.json").write_text(json.dumps(resolved, indent=1))
            metrics = _open_metrics(logs / "metrics.jsonl")
            parts.append(metrics)
        _set_rng_state(last.rng_state)
        if isinstance(tokens, BatchSource):
            sampler = tokens.sampler(cfg.micro_batch_size, cfg.seq_len)
        else:
            sampler = BatchSampler(tokens, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        compile_s = time.perf_counter()
        if world.distributed and cfg.fused:  # rank 0 compiles, the others load its kernels (mtc.dp_compile)
            from mtc.compiler import compile_program
            from mtc.dp_compile import compile_on_ranks

            compiled = compile_on_ranks(program, Path(store_dir), world.is_root,
                                        functools.partial(compile_program, matmul_fusion=cfg.matmul_fusion,
                                                                allow_tf32=cfg.allow_tf32), parts)
        else:
            compiled = _compile(cfg, program, st, run.plan_kernels)
        compile_s = time.perf_counter() - compile_s
        if compiled is not None and run.plan_source is not None and world.is_root:
            if (note := plan_refresh_note(run.plan_source, compiled)) is not None:
                from mtc.compiler import log_stderr

                (notify or log_stderr)(note)  # (from Python too: the stale templates' lines went to stderr)
        run_tuning_s = _attention_tuning_s() if compiled is not None else 0.0  # the run's share is measured from here
        runners: dict[str, LayerRunner] | None = None
        if compiled is not None:
            runners = {tid: CompiledRunner(ct, program.templates[tid]) for tid, ct in compiled.items()}
            runners = replay_graphs(runners, program.templates, compiled, device, mode=cfg.cuda_graphs,
                                    log=notify)
        saves = plan_saves(cfg, program, compiled, placement, gpu_update, prefetch,
                           micro_batches=cfg.grad_accum // world.world_size, gpu_free=gpu_free)
        kept = 0 if compiled is None else sum(compiled[program.layers[i].template].saved_bytes() for i in saves) * (
            cfg.grad_accum // world.world_size)
        if notify is not None and (saves or cfg.save_activations != "auto"):
            what = ("their autograd graphs (unfused: size not known ahead)" if compiled is None else
                    f"their matmul and attention outputs ({kept / 2**30:.2f} GiB on the device)")
            notify(f"saved activations: {len(saves)} blocks keep {what} for the backward, the others recompute them")
        eng = build_engine(cfg, program, tiers, gpu_update, st, timeline, runners=runners, serialize=serialize, prefetch=prefetch,
                           saves=saves)
        if device.type == "cuda" and notify is not None:
            notify(pinning_report())  # exact-size registered host memory, or torch's rounded allocator and why
        host_adamw = eng.optimizer.host_strategy.describe(eng.optimizer.host_impl)
        if eng.optimizer.host_strategy.rates and notify is not None:
            notify(host_adamw)
        if world.distributed:
            _dist.check_same_start(world, last.step, last.generation, tokens.identity())
            _dist.attach(eng, tiers, world, shard_st, device=_dist.device_collectives(cfg))
        parts.extend([eng.copies, eng.executor, eng.optimizer])
        watcher = RunWatcher(cfg, program, tiers, eng.executor.runners, timeline, tokens, device,
                             devices=mfu_devices(device, world.world_size, world.local_world_size), rank=world.rank,
                             world_size=world.world_size)
        disk_layers = any(t == "disk" for t in placement)
        executor, opt = eng.executor, eng.optimizer
        opt.disk_generation = last.generation
        # durability none: disk layers keep one generation, updated in place (nothing resumes from
        # it), once they have left the one a durable commit names
        tiers.disk_in_place = not durable
        tiers.protected_generation = last.generation if committed_start else None
        step, committed_gen, cursor = last.step, last.generation, last.data_cursor
        meta: dict = {"data": tokens.identity(), "changes": list(last.meta.get("changes", []))}
        if world.distributed:  # the commit records which world wrote it (any world size resumes it)
            meta["world_size"] = world.world_size
        if run.changes:  # what --allow-change let differ, recorded in every later commit
            meta["changes"].append({"from_step": last.step, "fields": run.changes, "values": run.change_values})
        # Adam restarts where the commit kept no moments (durability weights): zero moments (the
        # tiers' start) and bias correction counted from this step, as a new AdamW over the saved
        # weights would; a full commit carries the step its moments started at (and the skipped steps
        # since, which Adam does not count) on to the next run: `_commit_meta`
        opt.moments_from = int(last.meta.get("moments_from", 0)) if last.durability == "full" else last.step
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        every = 1 if any(t == "disk" for t in placement) else cfg.commit_every  # disk layers write every step
        pacer = _CommitPacer()
        local = cfg.grad_accum // world.world_size
        loader = _Loader(sampler, local, cursor, pin=device.type == "cuda", offset=world.rank * local, stride=cfg.grad_accum,
                         count_all=world.is_root)
        parts.append(loader)
        losses: list[float] = []
        records: list[StepRecord] = []
        bad_run = 0
        max_bad = cfg.max_nonfinite_steps
        while step < end:
            ts = time.perf_counter()
            timeline.begin_step(step)
            lr = lr_at(step, cfg.steps, cfg.optim)
            # (before begin_step: with the weights handoff it queues the step's state loads at once)
            b_in, b_out = eng.copies.h2d_bytes, eng.copies.d2h_bytes
            opt.begin_step(step, lr)
            # (the loader reuses the pinned set of step - 1 once this returns: its copies to the device
            # were done when finish_step read step - 1's loss, which the compute stream queued after them)
            mbs = loader.next()
            out = executor.run_step(mbs, opt)
            next_step, next_cursor = step + 1, cursor + cfg.grad_accum
            commit_now = durable and (next_step == end or (next_step % every == 0 if every else pacer.due(opt.commit_future)))
            if world.distributed and not every:  # paced by rank 0's timing: every rank must commit alike
                commit_now = _dist.agree(commit_now)
            commit_fn = None
            if commit_now:  # in a data-parallel run rank 0 writes the store and its commit records
                step_meta = _commit_meta(meta, opt, next_step)
                commit_fn = (_committer(st, next_step, next_cursor, cfg, step_meta) if not world.distributed
                             else _shard_committer(st, shard_st, world, next_step, next_cursor, cfg, step_meta))
                if metrics is not None and not serialize:  # (serialize waits for the commit inside finish_step)
                    record_gates.append(threading.Event())
                    commit_fn = _after_record(record_gates[-1], commit_fn)
            if st.path is not None and world.is_root and (commit_now or disk_layers):  # before any state write starts (mtc eval --step)
                gens = ({1 - committed_gen} if commit_now else set()) | ({tiers.disk_write_generation()} if disk_layers else set())
                for g in sorted(gens):
                    record_write_start(st.path, next_step, g)
            stats: StepStats = opt.finish_step(out.loss, commit=commit_fn, write_generation=1 - committed_gen)
            if commit_now:
                committed_gen = 1 - committed_gen
                pacer.started(opt.commit_future)
            step, cursor = next_step, next_cursor
            bad_run = bad_run + 1 if stats.skipped else 0
            tokens_n = cfg.grad_accum * cfg.micro_batch_size * cfg.seq_len
            secs = time.perf_counter() - ts
            rec = StepRecord(step=step, total_steps=cfg.steps, loss=stats.loss, lr=lr, grad_norm=stats.grad_norm,
                             seconds=secs, tokens=tokens_n, tokens_per_s=tokens_n / secs, targets=loader.targets,
                             skipped=stats.skipped,
                             committed=commit_now, h2d_bytes=eng.copies.h2d_bytes - b_in, d2h_bytes=eng.copies.d2h_bytes - b_out,
                             **watcher.after_step(step, tokens_n, ts, ts + secs))
            losses.append(stats.loss)
            records.append(rec)
            if watch is not None:  # the previous step's updates and writes are done now: its spans are complete
                msg = watch.after_step(timeline, step - 2, step - 1 - last.step)
                if msg is not None and notify is not None:
                    notify(msg)
            if metrics is not None:  # rank 0's only
                try:
                    metrics.write(json.dumps(_strict(dataclasses.asdict(rec)), allow_nan=False) + "\n")
                    metrics.flush()
                except OSError as e:
                    raise StoreError(f"writing {metrics.name} failed after step {step} ({os_error_reason(e)}); the "
                                     "store's last commit is intact: free space (or fix the file system), then resume "
                                     "with the same command") from e
                _open_gates(record_gates)
            if on_step is not None:
                on_step(rec)
            if bad_run >= max_bad:
                opt.wait()
                raise TrainingError(
                    f"{bad_run} consecutive steps had a non-finite loss or gradient norm (last: loss {stats.loss}, "
                    f"norm {stats.grad_norm}) and were skipped; lower the learning rate (--lr) or check the data"
                )
        opt.wait()
        host_bytes = tiers.host_bytes()
        graph_lines = graph_report(eng.executor.runners)
        acts = eng.executor.acts
        if compiled is not None:
            from mtc.compiler import format_plan_times, plan_times

            # attention shapes the plan did not record are timed on their first launch in the run
            run_tuning_s = _attention_tuning_s() - run_tuning_s
            graph_lines.insert(0, f"{format_plan_times(plan_times(compiled))} ({compile_s:.2f} s in all); "
                                  f"attention timed during the run {run_tuning_s:.2f} s")
        if graph_lines and st.path is not None:
            (st.path / "logs" / f"cuda_graphs-step{last.step}.txt").write_text("\n".join(graph_lines) + "\n")
    except BaseException as e:
        _open_gates(record_gates)  # a stopped run's commit in flight lands (without its step's record), as before
        opt = next((p for p in parts if isinstance(p, StreamingAdamW)), None)
        if not isinstance(e, Exception) and notify is not None and opt is not None and not opt.commit_future.done():
            # the first Ctrl-C lets the commit in flight land (bounded by one generation's write);
            # a second one interrupts this wait and abandons it: the store keeps the commit before
            gen = pl.disk_bytes_needed(placement, [s.numel for s in tiers.layers], cfg.durability) / 2
            notify(f"finishing the commit in flight (at most one state generation, {gen / 2**30:.2f} GiB, "
                   "to write); press Ctrl-C again to abandon it")
        try:
            _close_parts(parts, st)
        except BaseException:
            # a second Ctrl-C stops the wait, not the work: the worker threads still run what was
            # queued (Python cannot stop them) and write into the store, so its lock is released by
            # a thread of its own once that work has ended (`StreamingAdamW.settle`); without it the
            # lock stayed held by this process for good, and every later mtc.train of the store was
            # refused. (A daemon: a process that exits releases the lock anyway.)
            threading.Thread(target=_close_parts, args=(parts, st, opt), name="mtc-close-after-interrupt",
                             daemon=True).start()
        raise
    finally:
        restore_matmul_precision(tf32)
    try:
        for p in reversed(parts):
            p.close()
    except BaseException:  # a Ctrl-C here too: the lock is released once the queued work has ended, as above
        opt = next((p for p in parts if isinstance(p, StreamingAdamW)), None)
        threading.Thread(target=_close_parts, args=(parts, st, opt), name="mtc-close-after-interrupt", daemon=True).start()
        raise
    return TrainResult(
        start_step=last.step, end_step=step, losses=losses, wall_s=time.perf_counter() - t0, store=st, program=program,
        generation=committed_gen, placement=placement, gpu_update=gpu_update, timeline=timeline, records=records,
        host_state_bytes=host_bytes, tiers=tiers, compiled=compiled, compile_s=compile_s if compiled is not None else None,
        graph_report=graph_lines, host_adamw=host_adamw, prefetch=prefetch, state_s=state_s, saves=saves, saved_bytes=kept,
        offloaded_activation_bytes=acts.offloaded_bytes, peak_device_activation_bytes=acts.peak_device_bytes,
    )


def _close_parts(parts: list, st: TensorStore, opt: StreamingAdamW | None = None) -> None:
    """Close a failed run's ``parts`` (last opened first), then its store, which releases its lock;
    with ``opt``, first wait until the optimizer's started updates, writes and commits have ended."""
    if opt is not None:
        opt.settle()
    for p in reversed(parts):
        with contextlib.suppress(Exception):  # a failure while closing would only hide the first
            p.close()
    st.close()


@dataclasses.dataclass(slots=True)
class Engine:
    """The parts that run steps: copies, executor, optimizer (close in that reverse order)."""

    copies: CopyEngine
    executor: StreamingExecutor
    optimizer: StreamingAdamW

    def close(self) -> None:
        """Stop every worker thread."""
        self.optimizer.close()
        self.executor.close()
        self.copies.close()


def build_engine(cfg: TrainConfig, program: Program, tiers: StateTiers, gpu_update: set[int], store: TensorStore,
                 timeline: Timeline, *, runners: dict[str, LayerRunner] | None = None, serialize: bool = False,
                 on_visit: Callable[[str, int], None] | None = None, prefetch: int = 0, saves: Sequence[int] = ()) -> Engine:
    """Wire the copy engine, executor and optimizer of a run over ``tiers`` (``prefetch``: the
    GPU-updated layers whose state loads during the backward, `plan_prefetch`; ``saves``: the blocks
    that keep their activations between visits, `plan_saves`)."""
    device = torch.device(cfg.device)
    copies = CopyEngine(device, timeline, serialize=serialize)
    budget = int(cfg.activation_budget_gb * 2**30) if cfg.activation_budget_gb is not None else None
    executor = StreamingExecutor(program, tiers, device=device, engine=copies, timeline=timeline, runners=runners,
                                 activation_budget_bytes=budget, on_visit=on_visit, saves=saves)
    try:
        opt = StreamingAdamW(program, tiers, cfg.optim, engine=copies, timeline=timeline, threads=cfg.optim_threads,
                             host_impl=cfg.host_adamw, gpu_update=gpu_update, store=store, durability=cfg.durability,
                             prefetch=prefetch, handoff=cfg.update_handoff)
    except BaseException:
        executor.close()  # their threads would outlive the failed set-up
        copies.close()
        raise
    return Engine(copies, executor, opt)


def init_state(st: TensorStore, tiers: StateTiers, program: Program, params: dict[str, torch.Tensor] | None,
               durability: str) -> None:
    """A new run's state: create the store's state arrays, fill the tiers from the initial
    parameters and write generation 0 of what the store keeps (disk-tier layers always: the store
    is their tier), one layer at a time. An engine over ``tiers`` needs this before it is built."""
    assert params is not None, "a new run carries its initial parameters"
    tiers.create_arrays(st, durability)
    for s in tiers.layers:
        if not s.numel:
            continue
        # a ram layer's weights go straight into its master buffer, a gpu layer's through a staging
        # buffer every gpu layer reuses (no host copy allocated per layer)
        flat = flatten_layer(program, s.layer, params, out=tiers.initial_master(s.layer))
        for p in program.layer_params(s.layer):  # in the tiers now: the initial copy goes as the tiers fill
            params.pop(p.key, None)
        tiers.set_layer(s.layer, flat, fresh=True)
        kinds = state_kinds(s.tier, durability)
        # generation 0's moments are zeros: a ram layer's own (fresh) m and v are, and they stay so
        # until training starts; other tiers take one buffer of zeros for both (page-aligned, as the
        # store's O_DIRECT writes want it, and never written: its pages stay unallocated)
        zeros = s.m if flat is s.master else host_buffer(flat.numel(), flat.dtype, pinned=False) if "m" in kinds else None
        futs = [st.write_async(state_array_name(s.layer, k, 0), flat if k == "master" else zeros) for k in kinds]
        for f in futs:  # (a staging buffer is refilled by the next gpu layer only after its writes)
            f.result()
    tiers.release_staging()


class _CommitPacer:
    """``commit_every = 0``: commit once the last commit has landed and the time since it started
    is at least 20 times what it took, so writing state behind costs at most ~5 % of the disk's
    and the run's time, whatever the model size and disk speed; a crash loses at most about 20
    commit durations of training (a tiny model's quick steps: tens of steps, a few seconds)."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._took = 0.0

    def started(self, fut: object) -> None:
        """A commit was handed to the commit thread now."""
        self._start = time.perf_counter()
        fut.add_done_callback(lambda _f: setattr(self, "_took", time.perf_counter() - self._start))

    def due(self, fut: object) -> bool:
        """Whether this step should commit."""
        if self._start is None:
            return True
        return fut.done() and time.perf_counter() - self._start >= 20 * self._took


def _commit_meta(meta: dict, opt: StreamingAdamW, steps_done: int) -> Callable[[], dict]:
    """The meta of the commit after ``steps_done`` steps, read when the record is written (after
    `finish_step` has learned whether the step was skipped): ``meta`` with the Adam offset
    (`StreamingAdamW.moments_offset`) a resume from it needs, as ``moments_from``."""
    def at() -> dict:
        offset = opt.moments_offset(steps_done)
        return dict(meta, moments_from=offset) if offset else meta

    return at


def _shard_committer(st: TensorStore, shard_st: TensorStore, world: _dist.World, step: int, cursor: int, cfg: TrainConfig,
                     meta: Callable[[], dict]) -> Callable[[int, BaseException | None], None]:
    """A data-parallel step's commit: every rank's shard record, then rank 0's global record (`mtc.shards`)."""
    rng = _rng_state()  # captured now, on the training thread: the state after this step's batches
    config = cfg.to_dict()

    def record(gen: int) -> CommitRecord:
        return CommitRecord(step=step, generation=gen, data_cursor=cursor, rng_state=rng, config=config,
                            time_unix=time.time(), durability=cfg.durability, meta=meta())

    return _shards.committer(st, shard_st, world.rank, world.world_size, record)


def _after_record(gate: threading.Event, commit: Callable[..., None]) -> Callable[..., None]:
    """``commit`` (run on the optimizer's writer thread), once ``gate`` is set: after the step's
    metrics record is written. A commit lands in the background while the training thread goes on
    to the step's record, and an eval due at that step takes seconds before it: a run killed then
    resumed after the landed step, whose record (and val_loss) was never written, for good. Held
    back, the commit is the previous one and the step is redone and logged."""
    def gated(gen: int, *error: BaseException | None) -> None:  # (a data-parallel commit also takes the writes' error)
        gate.wait()
        commit(gen, *error)

    return gated


def _open_gates(gates: list[threading.Event]) -> None:
    """Let every commit waiting in `_after_record` land (each set before the list forgets it: an
    interrupt in between leaves the rest to the stopped run's own call)."""
    for g in gates:
        g.set()
    gates.clear()


def _committer(st: TensorStore, step: int, cursor: int, cfg: TrainConfig, meta: Callable[[], dict]) -> Callable[[int], None]:
    rng = _rng_state()  # captured now, on the training thread: the state after this step's batches
    config = cfg.to_dict()

    def commit(gen: int) -> None:
        st.commit(CommitRecord(step=step, generation=gen, data_cursor=cursor, rng_state=rng, config=config,
                               time_unix=time.time(), durability=cfg.durability, meta=meta()))

    return commit


def _compile(cfg: TrainConfig, program: Program, st: TensorStore, plan_kernels: Path | None = None) -> dict | None:
    """The compiled templates for a fused run, else None. Kernels are cached in the store's plan
    dir; an in-memory store gets a fresh cache, seeded with ``plan_kernels`` (the compiled templates
    of the plan directory it was opened from, copied: the plan directory is never written)."""
    if not cfg.fused:
        return None
    from mtc.compiler import compile_program

    if st.path is not None:
        cache = st.path / "plan" / "kernels"
    else:
        cache = Path(tempfile.mkdtemp(prefix="mtc-kernels-"))
        # removed when the process ends (not the run: kernels imported from it may be specialised again later)
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        if plan_kernels is not None and plan_kernels.is_dir():
            shutil.copytree(plan_kernels, cache, dirs_exist_ok=True)
    return compile_program(program, cache, matmul_fusion=cfg.matmul_fusion, allow_tf32=cfg.allow_tf32)


def plan_refresh_note(plan: Path, compiled: dict) -> str | None:
    """For a new run from the plan directory ``plan``: when templates had to be compiled (the plan
    held none, or stale ones), how many, and the command that refreshes the plan so that later runs
    load them (the run compiled into its own copy: the plan directory is never written). None when
    everything loaded."""
    from mtc.plan import compile_command
    from mtc.user_model import plan_train_fields

    fresh = [tid for tid, ct in compiled.items() if not ct.loaded]
    if not fresh:
        return None
    why = ("it holds none: traced, not compiled" if not Path(plan, "kernels", "compiled").is_dir()
           else "stale or missing: the lines above say which")
    secs = sum(compiled[t].seconds for t in fresh)
    return (f"plan {plan}: {len(fresh)} of {len(compiled)} templates compiled for this run ({why}; {secs:.1f} s); "
            f"`{compile_command(plan, plan_train_fields(plan))}` refreshes the plan so later runs load them")


def _attention_tuning_s() -> float:
    """Seconds this process has spent timing attention kernel candidates (kernels/tuning.py)."""
    from mtc.kernels.flash_attention import tuning_seconds

    return tuning_seconds()


def _model_vocab(program: Program) -> int:
    """Vocabulary size, read off the loss stage's logits width (the head's last weight dim 0)."""
    head = program.layers[-1]
    widths = [program.params[k].spec.shape[0] for k in head.param_keys() if len(program.params[k].spec.shape) == 2]
    return max(widths) if widths else 0
