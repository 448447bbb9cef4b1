"""The Python API for any model: `train`, `compile` and `save_plan` as ``mtc.train`` etc.

```python
import mtc
res = mtc.train(model=MyLM(), data="data/corpus.bin", store="runs/mine", steps=500, seq_len=256,
                micro_batch_size=8, optim={"lr": 1e-3})
plan = mtc.compile(mymodels.build, "plans/mine", batch_size=8, seq_len=256)   # trace + kernels
mtc.train(plan=plan, model=mymodels.build, data=batches, store="runs/mine2")
```

``model`` is an ``nn.Module``, a factory (a callable returning one: called after seeding torch with
``seed``), an import path ``package.module:function`` or a preset name. ``plan`` is a traced
`Program` (`mtc.trace`), a plan directory (`mtc.save_plan`, `mtc.compile`, `mtc compile`) or
what `compile` returns. ``data`` is a token file or an iterable of ``(ids, targets)`` micro-batches
(see `mtc.batch_source` for how a resume treats an iterable). Config fields are keyword arguments
(``optim`` as a dict or an `OptimConfig`), on top of ``config`` (a `TrainConfig`, dict or file).

A store with a commit resumes: ``mtc.train(store="runs/mine", data=..., steps=1000,
allow_change=["steps"])`` needs no model; its config starts from the one last committed. What the
store records for a model that is no preset: the config's ``model`` field (the factory's import
path, or ``"custom"``) and, in ``plan/model.json``, the program's fingerprint, checked when a
resume is given a plan or a model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch import nn

from mtc import user_model
from mtc.batch_source import BatchSource
from mtc.config import OptimConfig, TrainConfig, auto_device, config_file_fields, lr_pair, min_lr_for
from mtc.data import TokenFile
from mtc.errors import ConfigError
from mtc.graphs.program import Program, dtype_name

__all__ = ["Compiled", "compile", "save_plan", "train"]

ModelArg = nn.Module | Callable[[], nn.Module] | str


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class Compiled:
    """A compiled plan directory (program, kernels, report); usable wherever a path is (``os.fspath``)."""

    path: Path
    program: Program
    report: str

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        # the program's own repr lists every binding of every template: print(.report) for the detail
        b, t = self.program.batch["ids"].shape
        return f"Compiled({str(self.path)!r}, {self.program.n_layers} layers, batch {b}x{t}; .report for the kernels)"


def save_plan(program: Program, path: str | os.PathLike[str], *, factory: str | Callable[[], nn.Module] | None = None) -> Path:
    """Write ``program`` into the plan directory ``path``; with ``factory`` (an import path or an
    importable function), `mtc train --plan` can also start new runs from it (the factory makes the
    initial weights). Returns the directory."""
    fpath = factory if isinstance(factory, str) else user_model.factory_path(factory) if factory is not None else None
    if factory is not None and fpath is None:
        raise ConfigError(f"factory {factory!r} has no import path (a lambda, a local function or one in __main__); "
                          "define it at module level in an importable module")
    if fpath is not None:
        user_model.resolve_factory(fpath)
    return _save_with_record(program, path, fpath or user_model.CUSTOM)


def _save_with_record(program: Program, path: str | os.PathLike[str], model: str, **kernel_fields: str) -> Path:
    from mtc.plan import save_plan as _save

    out = _save(program, path)
    b, t = program.batch["ids"].shape
    fields = {"model": model, "model_overrides": {}, "micro_batch_size": b, "seq_len": t,
              "compute_dtype": _traced_dtype(program), **kernel_fields}
    user_model.write_model_record(out, fields, program)
    return out


def _traced_dtype(program: Program) -> str:
    d = str(program.meta.get("param_dtype", "float32"))
    return d if d in ("float32", "bfloat16") else "float32"


def _model_name(model: Any) -> str:
    """The config's ``model`` field for a model argument."""
    if isinstance(model, str):
        return model
    if isinstance(model, nn.Module):
        return user_model.CUSTOM
    return user_model.factory_path(model) or user_model.CUSTOM


def _instance(model: ModelArg, cfg: TrainConfig, device: str = "cpu", dtype: str | None = None) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, str):
        from mtc.train import build_model

        return build_model(dataclasses.replace(cfg, model=model), device=device, dtype=dtype)
    if not callable(model):
        raise ConfigError(f"model must be an nn.Module, a callable returning one, an import path or a preset name, "
                          f"got {type(model).__name__}")
    return user_model.build_from_factory(model, seed=cfg.seed, device=device)


def _config(config: TrainConfig | dict | str | os.PathLike[str] | None, fields: dict[str, Any], base: dict | None,
            stored_device: str | None = None, saved_optim: tuple[float, float] | None = None) -> TrainConfig:
    """The run's config: ``config`` (else the resumed run's ``base``, else the defaults) with ``fields``
    over it; a device named nowhere is the resumed run's (``stored_device``), else CUDA where there is one;
    an unnamed min_lr keeps the resumed run's ratio to lr (``saved_optim``: its lr, min_lr)."""
    if isinstance(config, TrainConfig):
        d = config.to_dict()
    elif isinstance(config, dict):
        d = copy.deepcopy(config)
    elif config is not None:
        raw = config_file_fields(config)
        d = {**TrainConfig.from_dict(raw).to_dict(), "device": raw.get("device")}
    else:
        d = copy.deepcopy(base) if base is not None else {**TrainConfig().to_dict(), "device": None}
    optim = d.get("optim")
    pre = None  # (lr, min_lr) before optim=
    if isinstance(optim, dict) and all(isinstance(optim.get(k), (int, float)) for k in ("lr", "min_lr")) and optim["lr"] > 0:
        pre = (optim["lr"], optim["min_lr"])
    if d.get("device") is None:  # named nowhere: the resumed run's, else CUDA where this machine has one
        d["device"] = stored_device or auto_device()
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for k, v in fields.items():
        if k not in known:
            raise ConfigError(f"mtc.train got an unknown config field {k!r}; fields are: {', '.join(sorted(known))}")
        if k == "optim":
            v = dataclasses.asdict(v) if isinstance(v, OptimConfig) else v
            if not isinstance(v, dict):
                raise ConfigError(f"optim must be a dict of OptimConfig fields or an OptimConfig, got {type(v).__name__}")
            d["optim"] = {**d.get("optim", {}), **v}
        else:
            d[k] = v
    # a min_lr named (in optim= or the config) is kept; unnamed, it keeps its ratio to lr: the resumed
    # run's, else the config's before optim= (the defaults: lr / 10), as `mtc train` does
    given = fields.get("optim") or {}
    # (only an lr given in optim= without min_lr: a config's own min_lr, a TrainConfig's included, is
    # the user's, and an OptimConfig given as optim= names every field)
    lr_alone = isinstance(given, dict) and "lr" in given and "min_lr" not in given and not _names_min_lr(config)
    lr = d["optim"].get("lr") if isinstance(d.get("optim"), dict) else None
    ref = saved_optim or pre
    # (an lr of another type is left for the config's check to name)
    if lr_alone and ref is not None and isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0:
        d["optim"]["min_lr"] = min_lr_for(lr, *ref)
    return TrainConfig.from_dict({k: v for k, v in d.items() if k in known})


def _names_min_lr(config: TrainConfig | dict | str | os.PathLike[str] | None) -> bool:
    """Whether a config dict or file names optim.min_lr itself (a TrainConfig always holds one: its
    min_lr keeps its ratio to a new lr like the defaults')."""
    if config is None or isinstance(config, TrainConfig):
        return False
    optim = (config if isinstance(config, dict) else config_file_fields(config)).get("optim")
    return isinstance(optim, dict) and "min_lr" in optim


def _saved_config(store: str | os.PathLike[str] | None) -> dict | None:
    """The config of a store's last commit (None: no store or no commit), read without its lock."""
    if store is None:
        return None
    f = Path(store) / "commit.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())["config"]
    except (ValueError, KeyError):
        return None  # open_run reports the damage with the fix


def _data(data: Any) -> TokenFile | BatchSource:
    if isinstance(data, (TokenFile, BatchSource)):
        return data
    if isinstance(data, (str, os.PathLike)):
        return TokenFile.open(data)
    if isinstance(data, Iterable):
        return BatchSource(data)
    raise ConfigError(f"data must be a token file path or an iterable of (ids, targets) batches, got {type(data).__name__}")


def train(
    model: ModelArg | None = None,
    *,
    data: str | os.PathLike[str] | TokenFile | Iterable[Any],
    store: str | os.PathLike[str] | None = None,
    plan: Program | str | os.PathLike[str] | None = None,
    config: TrainConfig | dict | str | os.PathLike[str] | None = None,
    allow_change: Iterable[str] = (),
    stop_after: int | None = None,
    overwrite: bool = False,
    on_step: Callable[[Any], None] | None = None,
    init_from: str | os.PathLike[str] | None = None,
    **fields: Any,
) -> Any:
    """Train ``model`` (or ``plan``) on ``data`` into ``store`` (None: in memory), or resume the store.

    Returns `mtc.train.TrainResult` (its ``store`` is open: read weights from it, then close it).
    A traced ``plan`` is used as it is (no re-trace); its micro-batch shape and dtype become the
    run's. New runs need initial weights: ``model`` (an instance, a factory, an import path), or a
    plan directory that records a factory, or ``init_from``: a run's store or a Hugging Face
    checkpoint directory whose weights (and model, tokenizer/ and hf/) a new run in ``store``
    starts from with fresh optimizer state, as ``mtc train --init-from``. ConfigError (one line)
    for anything that does not fit.
    """
    from mtc.dist import current_world
    from mtc.plan import load_plan
    from mtc.train import at_dtype, open_run
    from mtc.train import train as _train

    world = current_world()
    if world.world_size > 1:
        # every rank would open (or create) the store as if alone: rank 1 stopped on rank 0's lock,
        # saying another run held the store
        raise ConfigError(f"mtc.train runs in one process, and this one is rank {world.rank} of {world.world_size} under "
                          "torchrun: launch the CLI on every rank instead (`torchrun --nproc-per-node N -m mtc train "
                          "--plan DIR ...`, with DIR from mtc.compile or mtc.save_plan(program, DIR, factory=...)), or run "
                          "this script without torchrun")
    if plan is not None and not isinstance(plan, Program):
        plan = os.fspath(plan)  # a directory, or what `compile` returned
    saved = _saved_config(store) if not overwrite else None
    resuming = saved is not None
    if init_from is not None and model is not None and not isinstance(model, str):
        raise ConfigError(f"init_from={os.fspath(init_from)!r} takes the weights and the model from there; drop model= (to "
                          "start from a module's own weights, load them into it and pass it as model= without init_from)")
    program = plan if isinstance(plan, Program) else load_plan(plan) if plan is not None else None
    pfields: dict[str, Any] = {}
    if program is not None:
        b, t = program.batch["ids"].shape
        pfields = {"micro_batch_size": b, "seq_len": t}
        if not resuming:  # the plan fixes the dtype as `mtc train --plan` does (a resume keeps the store's)
            pfields["compute_dtype"] = fields.get("compute_dtype", _traced_dtype(program))
        rec = user_model.read_model_record(plan) if plan is not None and not isinstance(plan, Program) else None
        if rec is not None and not resuming:  # the kernels' options the plan was compiled with (as `mtc train --plan`)
            from mtc.plan import PLAN_KERNEL_FIELDS

            pfields.update({k: fields.get(k, rec[k]) for k in PLAN_KERNEL_FIELDS if k in rec})
        if model is None and rec is not None:
            model = rec.get("factory") or (rec["model"] if rec.get("model") != user_model.CUSTOM else None)
    if model is not None:
        pfields["model"] = _model_name(model)
    elif program is not None and not resuming and init_from is None:
        raise ConfigError("a plan gives the program but not the initial weights: pass model= (an nn.Module, a factory or "
                          "an import path), or save the plan with a factory (mtc.save_plan(program, DIR, factory=...))")
    for k, v in pfields.items():
        if k in fields and fields[k] != v:
            raise ConfigError(f"the plan was traced for {k}={v}, not {fields[k]}; drop {k}= or trace again")
    if resuming and model is None:
        pfields.setdefault("model", saved.get("model"))
        if saved.get("model_overrides"):
            pfields.setdefault("model_overrides", saved["model_overrides"])
    elif init_from is not None and model is None:  # a new run of the source's model (`mtc train --init-from`)
        from mtc.warmstart import source_model

        for k, v in source_model(init_from).items():
            pfields.setdefault(k, v)
    from mtc.warmstart import run_device

    stored_device = run_device(store) if resuming else None
    base = saved if config is None else None
    if base is not None and stored_device is None:  # a seeded store (an import): a new run, its device free
        base = {**base, "device": None}
    cfg = _config(config, {**fields, **pfields}, base, stored_device, lr_pair(saved))
    if program is not None and cfg.resolved_compute_dtype != _traced_dtype(program):
        raise ConfigError(f"the plan was traced in {_traced_dtype(program)}, this run computes in {cfg.resolved_compute_dtype} "
                          f"(device {cfg.device}); pass compute_dtype={_traced_dtype(program)!r} or trace the model in that dtype")
    source = _data(data)
    inst = None
    if not resuming and init_from is None:  # (open_run seeds the store from init_from and takes its program)
        if model is None:
            model = cfg.model  # a preset (or a factory path) named in the config
        inst = _instance(model, cfg, dtype="float32")  # the initial master state: the fp32 initialisation
        if program is None:
            from mtc.tracer import trace

            program = trace(at_dtype(inst, cfg.resolved_compute_dtype), cfg.micro_batch_size, cfg.seq_len)
    elif isinstance(model, nn.Module):
        from mtc.plan import load_plan as _load

        user_model.check_params_match(model, _load(Path(store) / "plan"), f"the model of store {store}",
                                      "; or pass overwrite=True to start a new run in this store")
    # a plan directory goes to open_run as a path, so its generated kernels are copied into the store
    run = open_run(cfg, store, model=inst, plan=plan if isinstance(plan, str) else program, data=source, overwrite=overwrite,
                   allow_change=tuple(allow_change), init_from=os.fspath(init_from) if init_from is not None else None)
    del inst  # a model built here: its weights go into the tiers layer by layer and need not outlive that
    return _train(cfg, store, source, run=run, stop_after=stop_after, on_step=on_step)


def compile(
    model: ModelArg | Program,
    path: str | os.PathLike[str],
    *,
    batch_size: int = 1,
    seq_len: int = 128,
    dtype: str | None = None,
    matmul_fusion: str = "auto",
) -> Compiled:
    """Trace ``model`` (unless it is a traced `Program`) at (batch_size, seq_len) and generate its fused
    kernels into the plan directory ``path``; `mtc train --plan` and ``mtc.train(plan=...)`` run it.

    A factory or import path is built on the meta device (no weights allocated) and recorded, so
    new runs can start from the plan; ``dtype`` is the compute dtype ('float32' or 'bfloat16';
    default: the model's); ``matmul_fusion``: 'auto' (fuse norms / activations into matmuls where
    that times faster on CUDA), 'on' or 'off', recorded in the plan. The returned `Compiled` holds
    the report the CLI prints.
    """
    from mtc.compiler import compile_program, write_report
    from mtc.tracer import trace

    if dtype is not None and dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if matmul_fusion not in ("auto", "on", "off"):
        raise ConfigError(f"matmul_fusion must be 'auto', 'on' or 'off', got {matmul_fusion!r}")
    factory: str | None = None
    if isinstance(model, Program):
        program = model
    else:
        if isinstance(model, str):
            factory = model if user_model.is_factory_path(model) else None
            cfg = TrainConfig(model=model, seq_len=seq_len, micro_batch_size=batch_size, compute_dtype=dtype or "float32")
            cfg.validate()
            inst = _instance(model, cfg, device="meta")
        elif isinstance(model, nn.Module):
            inst = model
        else:
            factory = user_model.factory_path(model)
            inst = _instance(model, TrainConfig(), device="meta")
        first = next(inst.parameters(), None)
        want = dtype or (dtype_name(first.dtype) if first is not None else "float32")
        from mtc.train import at_dtype

        program = trace(at_dtype(inst, want), batch_size, seq_len,
                        name=model if isinstance(model, str) else type(inst).__name__)
    preset = isinstance(model, str) and factory is None
    out = _save_with_record(program, path, model if preset else factory or user_model.CUSTOM, matmul_fusion=matmul_fusion)
    # under the TF32 setting a run of the plan has by default (`TrainConfig.allow_tf32`)
    compiled = compile_program(program, out / "kernels", matmul_fusion=matmul_fusion, allow_tf32=TrainConfig().allow_tf32)
    return Compiled(out, program, write_report(program, compiled, out))
