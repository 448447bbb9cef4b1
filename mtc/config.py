"""Run configuration: nested dataclasses, loadable from JSON or TOML, dumped as JSON with every run.

Every field is checked by `mtc.schema` from its type annotation and its `Rule` (ranges, choices,
syntax), so a TOML file, a JSON file, a command-line flag and Python code meet the same rules and
the same messages. The layer-spec parsers (`parse_placement`, `parse_layer_set`) resolve the
placement strings once the engine knows the model's layer count; `check_device` asks torch
whether the device exists (kept out of `validate` so a CUDA config can be built on a CPU machine).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from mtc.errors import ConfigError
from mtc.rank_dirs import check_template as _rank_dir_template
from mtc.schema import Rule, check_dataclass, check_value, describe, field, field_types, parse_text, unwrap_optional

__all__ = [
    "SEED_MAX",
    "OptimConfig",
    "TrainConfig",
    "auto_device",
    "check_device",
    "check_device_name",
    "config_file_fields",
    "field_help",
    "field_metavar",
    "load_config",
    "lr_pair",
    "min_lr_for",
    "parse_field",
    "parse_layer_set",
    "parse_placement",
    "set_field",
]

TIERS = ("gpu", "ram", "disk")
_PLACEMENT_WORDS = ("auto", *TIERS, "stateless")
_LAYER_SET_WORDS = ("auto", "none", "all")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_CUDA_INDEX = re.compile(r"cuda:(\d+)")


# ---- layer specs: "0-3,7" and "gpu:0-3,ram:4-19,disk:20-31" ----

def _ranges(text: str) -> list[tuple[int, int]]:
    """Inclusive (lo, hi) pairs of "0-3,7"; ValueError with the reason when malformed."""
    out = []
    for item in text.split(","):
        m = _RANGE.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"{item.strip()!r} is not a layer number or range such as '4' or '0-3'")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise ValueError(f"range {item.strip()!r} runs backwards; write it as '{hi}-{lo}'")
        out.append((lo, hi))
    return out


def _tier_ranges(spec: str) -> list[tuple[str, int, int]]:
    """(tier, lo, hi) for each item of "gpu:0-3,ram:4-19"; ValueError naming a bad tier or an overlap."""
    out: list[tuple[str, int, int]] = []
    for item in spec.split(","):
        tier, sep, rng = item.strip().partition(":")
        if not sep or tier not in TIERS:
            raise ValueError(f"{item.strip()!r} is not tier:ranges with a tier in {', '.join(TIERS)}, e.g. 'ram:4-19'")
        for lo, hi in _ranges(rng):
            for t2, lo2, hi2 in out:
                if lo <= hi2 and lo2 <= hi:  # a layer in two tiers would be stored twice
                    layer = max(lo, lo2)
                    raise ValueError(f"layer {layer} is in both {t2}:{lo2}-{hi2} and {tier}:{lo}-{hi}; give each layer one tier")
            out.append((tier, lo, hi))
    return out


def _compact(layers: list[int]) -> str:
    """'4-5, 9' for [4, 5, 9]."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _check_n_layers(n_layers: int) -> None:
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ConfigError(f"n_layers must be an integer >= 1, got {n_layers!r} ({type(n_layers).__name__})")


def _beyond(name: str, spec: str, hi: int, n_layers: int) -> ConfigError:
    return ConfigError(
        f"config field {name}: layer {hi} is beyond the model's last layer {n_layers - 1} (it has {n_layers} layers, "
        f"0 the embed stage and {n_layers - 1} the head), got {spec!r}; use layers 0-{n_layers - 1}"
    )


def parse_placement(spec: str, n_layers: int) -> list[str]:
    """One placement per layer (0 = embed stage, n_layers - 1 = head) for a `TrainConfig.placement` string.

    A single word ("auto", "gpu", "ram", "disk", "stateless") applies to every layer ("auto" is left
    for the engine to resolve from the budgets). Ranges such as "gpu:0-3,ram:4-19,disk:20-31" must
    cover every layer exactly once: ConfigError names uncovered, overlapping or out-of-range layers.
    """
    _check_n_layers(n_layers)
    spec = check_value("placement", spec, str, _PLACEMENT_RULE)
    if spec in _PLACEMENT_WORDS:
        return [spec] * n_layers
    tiers: list[str | None] = [None] * n_layers
    for tier, lo, hi in _tier_ranges(spec):
        if hi >= n_layers:
            raise _beyond("placement", spec, hi, n_layers)
        tiers[lo:hi + 1] = [tier] * (hi - lo + 1)
    missing = [i for i, t in enumerate(tiers) if t is None]
    if missing:
        raise ConfigError(
            f"config field placement: {'layer' if len(missing) == 1 else 'layers'} {_compact(missing)} "
            f"{'has' if len(missing) == 1 else 'have'} no tier (the model has {n_layers} layers, "
            f"0-{n_layers - 1}), got {spec!r}; give every layer one of {', '.join(TIERS)}, e.g. 'gpu:0-1,ram:2-{n_layers - 1}'"
        )
    return [t for t in tiers if t is not None]


def parse_layer_set(spec: str, n_layers: int) -> set[int] | None:
    """The layers a `TrainConfig.gpu_update` string names: None for "auto" (the engine's cost model
    decides), the empty set for "none", every layer for "all", else the layers of ranges like "0-3,7"."""
    _check_n_layers(n_layers)
    spec = check_value("gpu_update", spec, str, _GPU_UPDATE_RULE)
    if spec == "auto":
        return None
    if spec in ("none", "all"):
        return set(range(n_layers)) if spec == "all" else set()
    out: set[int] = set()
    for lo, hi in _ranges(spec):
        if hi >= n_layers:
            raise _beyond("gpu_update", spec, hi, n_layers)
        out.update(range(lo, hi + 1))
    return out


def _count(text: str) -> None:
    if not text.strip().isdigit():
        raise ValueError("expected auto, off, all or a number of blocks such as 8")


def _cuda_index(device: str) -> None:
    if not _CUDA_INDEX.fullmatch(device):
        raise ValueError("a device is 'cpu', 'cuda' or 'cuda:N'")


def _glob_list(text: str) -> None:
    items = text.split(",")
    if text.strip() and any(not i.strip() for i in items):
        raise ValueError("an empty pattern between commas; write patterns such as '*.bias,*norm*'")


_PLACEMENT_RULE = Rule(choices=_PLACEMENT_WORDS, syntax=_tier_ranges, syntax_doc="tier:ranges such as 'gpu:0-3,ram:4-19,disk:20-31'")
_GPU_UPDATE_RULE = Rule(choices=_LAYER_SET_WORDS, syntax=_ranges, syntax_doc="layer ranges such as '0-3,7'")


# ---- the configs ----

# The largest float32. The AdamW update hands its scalars to fp32 kernels (torch's checked scalar
# arguments, Triton's fp32 ones): a larger value stops the run inside the update ("cannot be
# converted to type float without overflow") after set-up has written the store.
_FLOAT32_MAX = (2 - 2**-23) * 2**127
# torch.manual_seed and torch.Generator.manual_seed take any uint64 (and numpy's SeedSequence any
# non-negative integer); a larger seed stops the run in the model's initialisation
SEED_MAX = 2**64 - 1


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with decoupled weight decay, global-norm clipping, linear warmup then cosine decay."""

    lr: float = field(3e-3, gt=0, le=_FLOAT32_MAX, help="peak learning rate")
    min_lr: float = field(3e-4, ge=0, le=_FLOAT32_MAX,
                          help="learning rate at the end of the cosine decay (at most lr); when lr is given without it: "
                               "lr / 10, or a resumed run's own ratio to lr")
    warmup_steps: int = field(10, ge=0, help="steps of linear warmup to lr")
    weight_decay: float = field(0.1, ge=0, le=_FLOAT32_MAX, help="AdamW decoupled weight decay")
    beta1: float = field(0.9, ge=0, lt=1, help="AdamW beta1")
    beta2: float = field(0.95, ge=0, lt=1, help="AdamW beta2")
    eps: float = field(1e-8, gt=0, help="AdamW epsilon")
    clip_norm: float | None = field(1.0, gt=0, help="clip the global gradient norm to this; none: no clipping")
    # Weight-decay groups (see mtc.param_groups): part of the state's flat layout, fixed for a run.
    no_decay: str = field("", syntax=_glob_list, syntax_doc="comma-separated fnmatch patterns such as '*.bias,*norm*'",
                          help="parameter names (fnmatch patterns, comma-separated) that never decay")
    decay_min_ndim: int = field(2, ge=0, help="parameters with fewer dimensions never decay (0: all may decay)")

    def validate(self) -> None:
        """Raise ConfigError for values AdamW cannot use (fields named optim.*)."""
        check_dataclass(self, prefix="optim.")
        if self.min_lr > self.lr:
            raise ConfigError(
                f"config field optim.min_lr: expected at most optim.lr ({self.lr:g}), got {self.min_lr!r} (float); "
                "lower min_lr or raise lr"
            )
        # the update's step size, lr / (1 - beta1**t), is largest at its first step (at most
        # lr / (1 - beta1)); it and the decay factor 1 - lr * weight_decay must fit in a float32 too
        if self.lr / (1 - self.beta1) > _FLOAT32_MAX:
            raise ConfigError(
                f"config field optim.lr: AdamW's first step size, lr / (1 - beta1) = {self.lr / (1 - self.beta1):g}, "
                f"overflows a float32 (max {_FLOAT32_MAX:g}), got lr {self.lr!r} with beta1 {self.beta1!r}; lower lr"
            )
        if self.lr * self.weight_decay > _FLOAT32_MAX:
            raise ConfigError(
                f"config field optim.weight_decay: lr * weight_decay = {self.lr * self.weight_decay:g} overflows a "
                f"float32 (max {_FLOAT32_MAX:g}), got weight_decay {self.weight_decay!r} with lr {self.lr!r}; "
                "lower weight_decay or lr"
            )


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything a training run needs besides the store directory and the data file."""

    model: str = field("tiny", help="model preset, or a factory's import path package.module:function, or 'custom' "
                       "(a model given from Python)")
    model_overrides: dict[str, Any] = field(default_factory=dict, help="preset fields to replace, e.g. n_layers = 2")
    steps: int = field(200, ge=1, help="optimizer steps to train to")
    micro_batch_size: int = field(16, ge=1, help="sequences per micro-batch")
    seq_len: int = field(128, ge=1, help="tokens per sequence")
    grad_accum: int = field(1, ge=1, help="micro-batches per optimizer step")
    # >= 0: the data sampler keys numpy's SeedSequence with it; <= 2**64 - 1: torch's manual_seed
    seed: int = field(0, ge=0, le=SEED_MAX, help="seed of the initial weights and the data order")
    # cpu here, but mtc train and mtc.train fill in a device named nowhere (`auto_device`)
    device: str = field("cpu", choices=("cpu", "cuda"), syntax=_cuda_index, syntax_doc="'cuda:N'",
                        help="device to compute on",
                        default_doc="when neither this flag nor a config file names one, a resumed run's device, else "
                        "cuda where this machine has one, else cpu")
    # "auto": bfloat16 on CUDA (fp32 master), float32 on the CPU (the parity contract)
    compute_dtype: str = field("auto", choices=("auto", "float32", "bfloat16"),
                               help="dtype of the forward and backward; auto: bfloat16 on CUDA, float32 on the CPU")
    allow_tf32: bool = field(True, help="let fp32 matmuls on CUDA run in TF32")
    io_threads: int = field(4, ge=1, help="threads reading and writing the store")
    kernels: str = field("auto", choices=("auto", "fused", "unfused"),
                         help="fused (generated Triton kernels; on the CPU only with TRITON_INTERPRET=1) or "
                         "unfused (ATen templates); auto: fused on CUDA")
    # Layer 0 is the embed stage, the last is the head; "stateless" keeps all state in host RAM
    # and nothing persistent on the GPU.
    placement: str = field("auto", rule=_PLACEMENT_RULE,
                           help="where each layer's fp32 state (master, m, v) lives; auto: from the budgets")
    gpu_update: str = field("auto", rule=_GPU_UPDATE_RULE,
                            help="which ram layers the GPU updates (state streamed over PCIe); auto: by the cost model")
    # the state does not depend on the gradient: loaded ahead, only the kernel and the copy back
    # remain between the step's norm and the next forward (mtc.runtime.optimizer)
    update_prefetch: int | None = field(None, ge=0,
                                        help="GPU-updated ram layers whose state loads during the backward (GPU memory: "
                                        "14 B per parameter of each); none: as many as fit in the GPU memory left "
                                        "(0 with --activation-budget-gb)")
    # a layer loaded ahead keeps its new weights in its GPU scratch set until its next update: the
    # step's visits copy them from there on the device instead of over PCIe and back
    # (mtc.runtime.optimizer, `LayerState.device_copy`); off: every visit reads the host copy, as
    # before 2026-11-27 (the A/B of bench_train's P1_AB)
    update_handoff: bool = field(True, help="GPU-updated ram layers loaded ahead give the next forward and backward "
                                 "their new weights on the device (a copy within GPU memory, not 3 x 2 B per "
                                 "parameter over PCIe: back, and to each visit); bf16 compute only")
    # "full": two generations of master, m, v (exact crash-safe resume); "weights": two generations
    # of master weights only (resume restarts Adam's moments); "none".
    durability: str = field("full", choices=("full", "weights", "none"), help="what a commit makes crash-safe")
    commit_every: int = field(0, ge=0, help="commit (write state behind, then the atomic record) every N steps; 0: auto, "
                              "as often as keeps commits under 5%% of the run's time (each once the last has landed)")
    # A block may keep its matmul and attention outputs on the GPU from its forward visit to its
    # backward visit instead of recomputing them (graphs/split.py): about a fifth of a block's
    # compute, for ~86 KB per token of a Llama-8B-wide block in bf16 (mtc.train.plan_saves);
    # "auto" fills the GPU memory the placement leaves (fused plans), and is off with a fixed
    # --activation-budget-gb (whose GPU peak must not grow with the model). Unfused blocks keep
    # their autograd graphs, when told to (their size is not estimated).
    save_activations: str = field("auto", choices=("auto", "off", "all"), syntax=_count, syntax_doc="a number of blocks",
                                  help="blocks that keep their forward's activations on the device for the backward instead "
                                  "of recomputing them: auto (fused plans on CUDA: as many as fit in the GPU memory left; "
                                  "none on the CPU, unfused or with --activation-budget-gb), off, all, or N (the last N)")
    activation_budget_gb: float | None = field(None, gt=0,
                                               help="GPU GB for layer-boundary activations (beyond: pinned host); none: no limit")
    ram_budget_gb: float | None = field(None, gt=0, help="host RAM GB for state (auto placement); none: available memory minus a margin")
    gpu_budget_gb: float | None = field(None, gt=0, help="GPU GB for resident state (auto placement); none: free memory minus workspace")
    # "store" keeps no host RAM per disk parameter (the weights are read at each visit, 4 bytes per
    # parameter per visit more disk traffic); "ram" keeps the compute-dtype copy pinned.
    # (auto is resolved against the RAM budget: mtc.runtime.placement.resolve_disk_compute)
    disk_compute: str = field("auto", choices=("auto", "ram", "store"),
                              help="where disk layers' compute copy lives: pinned ram, or read from the store per visit; "
                              "auto: store for float32 compute, ram for bfloat16 while the RAM budget holds it")
    optim_threads: int = field(0, ge=0, help="CPU AdamW threads; 0: all cores")
    # torch's fused CPU kernel ran ~2x the exact path on the 2-core box (bench/bench_adamw.py) and
    # stays within the parity tolerance, but is not bit-identical to torch.optim.AdamW
    host_adamw: str = field("auto", choices=("auto", "exact", "fused"),
                            help="CPU AdamW of ram and disk layers: exact (torch.optim.AdamW's single-tensor math, bit "
                            "for bit) or fused (torch's one-pass CPU kernel, ~2x faster, not bit-identical); auto: fused "
                            "on CUDA, exact on the CPU")
    # A step whose loss or grad norm is not finite is skipped; this many in a row stop the run.
    max_nonfinite_steps: int = field(3, ge=1, help="stop with an error after this many consecutive non-finite steps")
    # Validation on the held-out split (the token file's last 5 %), on the weights of the step reported.
    eval_every: int = field(0, ge=0, help="log the validation loss every N steps and at the last step; 0: never")
    eval_batches: int = field(8, ge=1, help="held-out batches (of micro_batch_size x seq_len) per validation")
    optim: OptimConfig = field(default_factory=OptimConfig, help="optimizer settings")
    # Fused plans on CUDA: each compiled forward / joint graph replayed as a CUDA graph (one launch per
    # layer call); a graph that cannot be captured runs eagerly and the run says why.
    cuda_graphs: str = field("auto", choices=("auto", "off"),
                             help="replay compiled layers as CUDA graphs: auto (fused plans on CUDA) or off")
    # Fused plans: a matmul absorbs the norm before it and the activation / residual add after it
    # (kernels/matmul_fusion.py) where that times faster than cuBLAS + a separate kernel (auto: per
    # shape, on CUDA; never on the CPU); 'on' fuses wherever the pattern matches, 'off' nowhere.
    matmul_fusion: str = field("auto", choices=("auto", "on", "off"),
                               help="fuse norms / activations / residual adds into matmuls: auto (where faster, timed "
                               "per shape on CUDA), on, off; part of the compiled plan (mtc compile --matmul-fusion)")
    # torchrun launches: every collective gives up after this long, so a dead rank stops the others
    dist_timeout_s: float = field(60.0, gt=0, help="data-parallel runs: seconds a collective waits for the other ranks "
                                  "before the run fails")
    dp_collectives: str = field("auto", choices=("auto", "host", "device"),
                                help="data-parallel runs: where gradients are reduce-scattered and weights all-gathered: "
                                "device (NCCL on the GPUs; gloo on the CPU device), host (gloo in host memory), or auto "
                                "(device on CUDA with NCCL, else host)")
    # data-parallel runs: each rank's shard store, e.g. on its node's local disk (mtc.rank_dirs)
    rank_dir: str | None = field(None, syntax=_rank_dir_template, syntax_doc="a path template such as '/nvme/run/rank-{rank}'",
                                 help="data-parallel runs: where each rank keeps its shard store, a path template with "
                                 "{rank}, {world_size}, {local_rank}, {node}, {host}; none: RUN/ranks/rank-R-of-N")

    def validate(self) -> None:
        """Raise ConfigError (naming the field, the value and what is expected) for any bad setting."""
        check_dataclass(self)
        from mtc.models import FAMILIES, model_class, model_config, model_names, preset_names  # config must stay importable alone

        if self.model == "custom" or ":" in self.model:  # a user's model (mtc.user_model): nothing preset to check
            if self.model_overrides:
                raise ConfigError(f"config field model_overrides: only presets take overrides, model {self.model!r} "
                                  "is a user's model; change the model itself")
            if ":" in self.model:
                from mtc.user_model import is_factory_path

                if not is_factory_path(self.model):
                    raise ConfigError(f"config field model: {self.model!r} is neither a preset nor an import path "
                                      "package.module:function; known presets: " + ", ".join(preset_names()))
            return
        if self.model not in model_names():
            raise ConfigError(
                f"config field model: unknown preset {self.model!r}; known presets: {', '.join(preset_names())}; "
                f"families (shape all in model_overrides): {', '.join(FAMILIES)}; your own model: its factory's "
                f"import path, package.module:function (e.g. {self.model}:build)"
            )
        base = model_class(self.model)
        types_ = field_types(base)
        for key, value in self.model_overrides.items():
            if key not in types_:
                raise ConfigError(
                    f"config field model_overrides.{key}: preset {self.model!r} ({base.__name__}) has no field "
                    f"{key!r}; fields are: {', '.join(types_)}"
                )
            tp = types_[key][0]
            # Every numeric field of the model configs is a size or a scale: positive.
            rule = Rule(ge=1) if tp is int else Rule(gt=0) if tp is float else Rule()
            self.model_overrides[key] = check_value(f"model_overrides.{key}", value, tp, rule)
        mcfg = model_config(self.model, **self.model_overrides)  # cross-field checks: ConfigError
        if self.seq_len > mcfg.max_seq_len:
            raise ConfigError(
                f"config field seq_len: expected at most the max_seq_len {mcfg.max_seq_len} of preset {self.model!r}, "
                f"got {self.seq_len}; shorten --seq-len or raise model_overrides.max_seq_len"
            )

    @property
    def fused(self) -> bool:
        """Whether this run uses the compiled (fused) plan."""
        return self.kernels == "fused" or (self.kernels == "auto" and self.device.startswith("cuda"))

    @property
    def resolved_compute_dtype(self) -> str:
        """The compute dtype this run uses: 'auto' is bfloat16 on CUDA and float32 on the CPU."""
        if self.compute_dtype != "auto":
            return self.compute_dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-able)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Build and validate from a dict, rejecting unknown keys with the list of known ones."""
        if not isinstance(d, dict):
            raise ConfigError(f"a config must be a table of fields, got {type(d).__name__}; see `mtc train --help` for the fields")
        d = dict(d)
        optim = d.pop("optim", None)
        if optim is None:
            optim = {}
        if not isinstance(optim, dict):
            raise ConfigError(f"config field optim: expected a table of OptimConfig fields, got {optim!r} ({type(optim).__name__})")
        _check_keys(cls, d, "")
        _check_keys(OptimConfig, optim, "optim.")
        lr = optim.get("lr")
        if "min_lr" not in optim and isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0:
            defaults = OptimConfig()
            optim = {**optim, "min_lr": min_lr_for(lr, defaults.lr, defaults.min_lr)}  # (a bad lr: validate names it)
        cfg = cls(**d, optim=OptimConfig(**optim))
        cfg.validate()
        return cfg


def min_lr_for(lr: float, ref_lr: float, ref_min_lr: float) -> float:
    """The min_lr of a run that names ``lr`` but not min_lr: the reference's (the defaults', or the
    resumed run's) min_lr at the same ratio to lr, so the cosine still decays (from the defaults:
    to lr / 10) where a fixed default above a low lr would leave it flat; the reference's own lr
    keeps its min_lr exactly (a resume with the same command recomputes nothing)."""
    if lr == ref_lr:
        return ref_min_lr
    return min(lr, lr * (ref_min_lr / ref_lr))


def lr_pair(config: dict[str, Any] | None) -> tuple[float, float] | None:
    """(lr, min_lr) of a stored config dict (a commit's record), the reference `min_lr_for` scales;
    None without one (a new run, or a damaged record: opening the store says so)."""
    try:
        return float(config["optim"]["lr"]), float(config["optim"]["min_lr"])
    except (TypeError, KeyError, ValueError):
        return None


def _check_keys(cls: type, d: dict[str, Any], prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)} - {"optim"}
    bad = sorted(set(d) - known)
    if bad:
        raise ConfigError(f"unknown config key(s) {', '.join(prefix + b for b in bad)}; known: {', '.join(sorted(known))}")


def load_config(path: str | Path) -> TrainConfig:
    """Read and validate a TrainConfig from a .json or .toml file."""
    return TrainConfig.from_dict(config_file_fields(path))


def config_file_fields(path: str | Path) -> dict[str, Any]:
    """The fields a .json or .toml config file sets, as written (unvalidated: see `load_config`)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        if p.suffix == ".toml":
            d = tomllib.loads(p.read_text())
        elif p.suffix == ".json":
            d = json.loads(p.read_text())
        else:
            raise ConfigError(f"config file {p} must end in .json or .toml")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {p} does not parse: {e}") from None
    return d


def auto_device() -> str:
    """The device of a new run that names none: ``cuda`` where torch sees a CUDA device, else ``cpu``
    (`TrainConfig` itself defaults to the CPU; the CLI and `mtc.train` pick this instead)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- single fields by dotted name (the CLI's flags) ----

def _lookup(path: str) -> tuple[Any, Rule, Any]:
    """(type, Rule, default) of field ``path`` ("steps", "optim.lr")."""
    cls: type = TrainConfig
    *outer, name = path.split(".")
    for part in outer:
        cls = field_types(cls)[part][0]
    tp, rule = field_types(cls)[name]
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return tp, rule, default


def _show(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def field_help(path: str) -> str:
    """Help text of field ``path``: what it does, what it accepts, and its default."""
    tp, rule, default = _lookup(path)
    return f"{rule.help}; {describe(tp, rule)} (default: {rule.default_doc or _show(default)})"


def field_metavar(path: str) -> str:
    """A short name for a flag's value: N, X, {a,b,c} or SPEC, with |none when it may be none."""
    tp, rule, _ = _lookup(path)
    inner, nullable = unwrap_optional(tp)
    if inner is int or inner is float:
        name = "N" if inner is int else "X"
    elif rule.choices and rule.syntax is None:
        name = "{" + ",".join(rule.choices) + "}"
    else:
        name = "SPEC"
    return name + ("|none" if nullable else "")


def parse_field(path: str, text: str | bool, *, flag: str | None = None) -> Any:
    """The value of field ``path`` given as command-line text (or a bool from an on/off flag), checked.

    ConfigError names the field (and ``flag``), the value received and what is expected.
    """
    tp, rule, _ = _lookup(path)
    label = f"{path} ({flag})" if flag else path
    if isinstance(text, bool):
        return check_value(label, text, tp, rule)
    return parse_text(label, text, tp, rule)


def set_field(cfg: TrainConfig, path: str, value: Any) -> None:
    """Set field ``path`` ("steps", "optim.lr") of ``cfg``; call `validate` afterwards."""
    *outer, name = path.split(".")
    obj: Any = cfg
    for part in outer:
        obj = getattr(obj, part)
    setattr(obj, name, value)


def check_device(cfg: TrainConfig) -> None:
    """Raise ConfigError when ``cfg.device`` names a CUDA device this machine does not have."""
    check_device_name(cfg.device)


def check_device_name(device: str) -> None:
    """Raise ConfigError unless ``device`` is 'cpu', 'cuda' or 'cuda:N' and this machine has it
    (`mtc eval` and `mtc generate` take a device outside a config)."""
    if device not in ("cpu", "cuda") and not _CUDA_INDEX.fullmatch(device):
        raise ConfigError(f"--device {device!r}: a device is 'cpu', 'cuda' or 'cuda:N'")
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: this machine has no CUDA device (torch.cuda.is_available() is False); use --device cpu"
        )
    m = _CUDA_INDEX.fullmatch(device)
    n = torch.cuda.device_count()
    if m is not None and int(m[1]) >= n:
        raise ConfigError(f"--device {device}: this machine has {n} CUDA device(s), cuda:0-cuda:{n - 1}; use --device cuda:0")
