"""Run configuration: nested dataclasses, loadable from JSON or TOML, dumped as JSON with every run."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

from mtc.errors import ConfigError

__all__ = ["OptimConfig", "TrainConfig", "load_config"]


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with decoupled weight decay, global-norm clipping, linear warmup then cosine decay."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0

    def validate(self) -> None:
        """Raise ConfigError for values AdamW cannot use."""
        if not (self.lr > 0 and self.min_lr >= 0 and self.min_lr <= self.lr):
            raise ConfigError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.eps <= 0:
            raise ConfigError("warmup_steps and weight_decay must be >= 0 and eps > 0")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ConfigError(f"clip_norm must be positive or null (no clipping), got {self.clip_norm}")


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything a training run needs besides the store directory and the data file."""

    model: str = "tiny"
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    steps: int = 200
    micro_batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    seed: int = 0
    device: str = "cpu"
    # "auto": bfloat16 on CUDA (fp32 master), float32 on the CPU (the parity contract)
    compute_dtype: str = "auto"
    allow_tf32: bool = True  # fp32 compute on CUDA runs matmuls in TF32 unless this is False
    io_threads: int = 4
    kernels: str = "auto"  # "fused" (generated Triton kernels), "unfused" (ATen templates), "auto": fused on CUDA
    # Where each layer's fp32 state (master, m, v) lives: "auto" (from the budgets), "gpu", "ram",
    # "disk", "stateless" (all in host RAM, nothing persistent on the GPU), or per-layer ranges
    # such as "gpu:0-3,ram:4-19,disk:20-31" (layer 0 is the embed stage, the last is the head).
    placement: str = "auto"
    # Which `ram` layers the GPU updates (state streamed over PCIe): "auto" (cost model), "none",
    # "all", or layer ranges such as "0-3,7".
    gpu_update: str = "auto"
    # Durability of the store: "full" (two generations of master, m, v: exact crash-safe resume),
    # "weights" (two generations of master weights only: resume restarts Adam's moments), "none".
    durability: str = "full"
    commit_every: int = 1  # commit (write state behind, then the atomic record) every N steps
    activation_budget_gb: float | None = None  # GPU bytes for layer-boundary activations; beyond: pinned host
    ram_budget_gb: float | None = None  # host RAM for state (auto placement); None: available memory minus a margin
    gpu_budget_gb: float | None = None  # GPU memory for resident state (auto placement); None: free memory minus workspace
    optim_threads: int = 0  # CPU AdamW threads; 0: all cores
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)

    def validate(self) -> None:
        """Raise ConfigError for inconsistent settings."""
        for name in ("steps", "micro_batch_size", "seq_len", "grad_accum", "io_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        from mtc.models import model_config  # here, not at import: config must stay importable alone

        model_config(self.model, **self.model_overrides)  # unknown preset or field: ConfigError
        if self.compute_dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"compute_dtype must be 'auto', 'float32' or 'bfloat16', got {self.compute_dtype!r}")
        if self.durability not in ("full", "weights", "none"):
            raise ConfigError(f"durability must be 'full', 'weights' or 'none', got {self.durability!r}")
        if self.commit_every < 1:
            raise ConfigError(f"commit_every must be >= 1, got {self.commit_every}")
        if self.kernels not in ("auto", "fused", "unfused"):
            raise ConfigError(f"kernels must be 'auto', 'fused' or 'unfused', got {self.kernels!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.optim.validate()

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
        """Build from a dict, rejecting unknown keys with the list of known ones."""
        d = dict(d)
        optim = d.pop("optim", {}) or {}
        _check_keys(cls, d, "")
        _check_keys(OptimConfig, optim, "optim.")
        cfg = cls(**d, optim=OptimConfig(**optim))
        cfg.validate()
        return cfg


def _check_keys(cls: type, d: dict[str, Any], prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)} - {"optim"}
    bad = sorted(set(d) - known)
    if bad:
        raise ConfigError(f"unknown config key(s) {', '.join(prefix + b for b in bad)}; known: {', '.join(sorted(known))}")


def load_config(path: str | Path) -> TrainConfig:
    """Read a TrainConfig from a .json or .toml file."""
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
    return TrainConfig.from_dict(d)
