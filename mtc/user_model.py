"""Users' own models: factories by import path, and what a plan or store records to resume them.

A run's ``model`` field is a preset name, a factory's import path ``package.module:function``
(any callable returning an ``nn.Module``: a function or an ``nn.Module`` class), or ``"custom"``: a
model handed over from Python whose factory has no import path (a lambda, a local function, an
instance). A store needs no factory to resume: its ``plan/`` holds the traced program and its
arrays the weights. To start a run mtc needs initial weights, hence a model instance or a factory.

Plans and stores carry ``model.json``: the config fields the program was traced for (see
`mtc.plan.PLAN_MODEL_FIELDS`), the factory path (when known) and the program's fingerprint, so a
resume with ``--plan DIR`` or ``mtc.train(plan=...)`` can check it is the plan the store was made
with.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtc.errors import ConfigError, PlanError
from mtc.graphs.program import Program

__all__ = [
    "CUSTOM",
    "build_from_factory",
    "check_params_match",
    "check_same_plan",
    "factory_path",
    "is_factory_path",
    "plan_train_fields",
    "program_fingerprint",
    "read_model_record",
    "resolve_factory",
    "write_model_record",
]

CUSTOM = "custom"  # the model field of a run whose model came from Python without an import path
MODEL_FILE = "model.json"
_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


def is_factory_path(text: str) -> bool:
    """Whether ``text`` has the form ``package.module:function`` (checked, not imported)."""
    return bool(_PATH.fullmatch(text))


def factory_path(obj: Any) -> str | None:
    """The import path of a module-level function or class, or None when it has none (lambda, local, __main__)."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not mod or not qual or mod == "__main__" or "<" in qual:
        return None
    path = f"{mod}:{qual}"
    try:
        return path if resolve_factory(path) is obj else None
    except ConfigError:
        return None


def resolve_factory(path: str) -> Callable[..., Any]:
    """The callable named by ``package.module:function``; ConfigError (one line) when it cannot be had.

    Like ``python -m``, the current directory is searched first, so a model in ``./mymodels.py``
    is ``mymodels:build``.
    """
    if not is_factory_path(path):
        raise ConfigError(f"model {path!r}: expected a preset name or an import path package.module:factory "
                          "(e.g. mymodels:build_model, where build_model() returns an nn.Module)")
    mod_name, _, attr = path.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"model {path}: cannot import module {mod_name!r} ({e}); check the name, run from the directory "
                          "that holds it, or add that directory to PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: say where, keep one line
        raise ConfigError(f"model {path}: importing {mod_name} raised {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))
                           and getattr(getattr(module, n), "__module__", None) == mod_name)  # its own functions and classes
            raise ConfigError(f"model {path}: module {mod_name} has no attribute {attr!r}; it defines: "
                              f"{', '.join(names[:12]) or 'nothing public'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"model {path}: {attr} is not callable (type {type(obj).__name__}); name a function or class "
                          "that returns an nn.Module")
    return obj


def build_from_factory(factory: str | Callable[..., Any], *, seed: int | None = None, device: str = "cpu") -> nn.Module:
    """Call ``factory`` (an import path or a callable) with no arguments, after seeding torch's RNG
    with ``seed``, under ``torch.device(device)`` ('meta': structure only); check it made an nn.Module."""
    fn = resolve_factory(factory) if isinstance(factory, str) else factory
    name = factory if isinstance(factory, str) else getattr(factory, "__qualname__", repr(factory))
    if seed is not None:
        torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = fn()
    except Exception as e:  # noqa: BLE001 - any error of the user's factory becomes one line
        raise ConfigError(f"model factory {name} raised {type(e).__name__}: {e}; call it in Python to see the traceback") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model factory {name} returned a {type(model).__name__}, not an nn.Module")
    return model


def program_fingerprint(program: Program) -> str:
    """sha256 of what makes two programs the same model: templates (graph hashes), the chain of
    calls, parameter names, shapes and owners, and the batch shape (not the flat offsets, which
    the weight-decay groups re-lay)."""
    doc = {
        "layers": [c.template for c in program.layers],
        "params": {k: [list(p.spec.shape), p.spec.dtype, p.layer] for k, p in program.params.items()},
        "batch": {k: list(v.shape) for k, v in program.batch.items()},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def check_params_match(model: nn.Module, program: Program, where: str, fix: str = "") -> None:
    """ConfigError unless ``model``'s parameters have the names and shapes of ``program``'s;
    ``fix`` is a further way out for the message."""
    have = {k: tuple(p.shape) for k, p in model.named_parameters()}
    want = {k: p.spec.shape for k, p in program.params.items()}
    if have == want:
        return
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    shapes = [f"{k} {have[k]} vs {want[k]}" for k in want if k in have and have[k] != want[k]]
    parts = ([f"missing {', '.join(missing[:3])}"] if missing else []) + ([f"not in it {', '.join(extra[:3])}"] if extra else [])
    parts += [f"shape {s}" for s in shapes[:3]]
    raise ConfigError(f"the model's parameters do not match {where} ({'; '.join(parts)}); use the model the plan was "
                      f"traced from, or trace this one{fix}")


def write_model_record(plan_dir: str | Path, fields: dict[str, Any], program: Program) -> None:
    """Write ``model.json`` into ``plan_dir``: the traced-for config fields, factory and fingerprint."""
    from mtc.plan import PLAN_KERNEL_FIELDS, PLAN_MODEL_FIELDS, write_atomic

    doc = {k: fields[k] for k in PLAN_MODEL_FIELDS} | {k: fields[k] for k in PLAN_KERNEL_FIELDS if k in fields}
    doc["factory"] = fields["model"] if is_factory_path(str(fields["model"])) else None
    doc["program_sha256"] = program_fingerprint(program)
    write_atomic(Path(plan_dir, MODEL_FILE), json.dumps(doc, indent=1))


def read_model_record(plan_dir: str | Path) -> dict[str, Any] | None:
    """The ``model.json`` of a plan directory, or None when it has none."""
    f = Path(plan_dir, MODEL_FILE)
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise PlanError(f"{f} is not valid JSON ({e}); re-save the plan") from None


def plan_train_fields(plan_dir: str | Path) -> dict[str, Any]:
    """The TrainConfig fields a plan fixes (model, model_overrides, micro-batch shape, compute dtype,
    and the kernel options it was compiled with, where recorded).

    From its ``model.json`` (`mtc compile`, `mtc.save_plan(..., factory=...)`), or, for a plan
    saved from Python without one, read off the program: ``model = "custom"`` and the traced shape.
    """
    from mtc.plan import PLAN_KERNEL_FIELDS, PLAN_MODEL_FIELDS, PROGRAM_FILE, load_plan

    if not Path(plan_dir, PROGRAM_FILE).is_file():
        raise PlanError(f"{plan_dir} is not a plan directory (no {PROGRAM_FILE}); create one with `mtc compile` or mtc.save_plan")
    rec = read_model_record(plan_dir)
    if rec is not None:
        missing = [k for k in PLAN_MODEL_FIELDS if k not in rec]
        if missing:
            raise PlanError(f"{Path(plan_dir, MODEL_FILE)} lacks {', '.join(missing)}; recompile the plan")
        return {k: rec[k] for k in PLAN_MODEL_FIELDS} | {k: rec[k] for k in PLAN_KERNEL_FIELDS if k in rec}
    program = load_plan(plan_dir)
    b, t = program.batch["ids"].shape
    dtype = str(program.meta.get("param_dtype", "float32"))
    return {"model": CUSTOM, "model_overrides": {}, "micro_batch_size": b, "seq_len": t,
            "compute_dtype": dtype if dtype in ("float32", "bfloat16") else "float32"}


def check_same_plan(plan: Any, stored: Program, where: str) -> None:
    """ConfigError unless ``plan`` (a Program or a plan directory) is the model of the store's ``stored`` program."""
    from mtc.plan import load_plan

    given = plan if isinstance(plan, Program) else load_plan(plan)
    a, b = program_fingerprint(given), program_fingerprint(stored)
    if a != b:
        raise ConfigError(f"plan {plan if not isinstance(plan, Program) else given.model_name} is not the plan store "
                          f"{where} was made with (fingerprint {a[:12]} vs {b[:12]}); resume with that plan, or start a new store")
