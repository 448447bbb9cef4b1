"""Plan directories: a traced Program written to disk and read back.

Layout: ``program.json`` (templates, layer calls, parameter layout; see `mtc.graphs.serialize`),
``constants.safetensors`` (values of non-trainable buffers, if the model has any), and from
`mtc compile`: ``model.json`` (the preset and shapes the program was traced for, so `mtc train
--plan` can build the same run), ``kernels/`` (generated kernels by cache key) and
``compile_report.json``.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtc.errors import PlanError
from mtc.graphs.program import Program
from mtc.graphs.serialize import SerializeError, program_from_dict, program_to_dict

__all__ = ["PLAN_KERNEL_FIELDS", "PLAN_MODEL_FIELDS", "compile_command", "kernels_target", "load_plan", "save_plan"]

PROGRAM_FILE = "program.json"
CONSTANTS_FILE = "constants.safetensors"
MODEL_FILE = "model.json"
REPORT_FILE = "compile_report.json"
# the TrainConfig fields a traced program depends on
PLAN_MODEL_FIELDS = ("model", "model_overrides", "micro_batch_size", "seq_len", "compute_dtype")
# the TrainConfig fields its compiled kernels depend on (optional: plans written before them lack them)
PLAN_KERNEL_FIELDS = ("matmul_fusion",)


def save_plan(program: Program, path: str | Path) -> Path:
    """Write ``program`` into the plan directory ``path`` (created if needed) and return it. Files
    of another program there go: its constants (this one has none) and its compile report (the
    next compile writes this program's)."""
    root = Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # the path, or a folder above it, is a file
        raise PlanError(f"cannot write plan {root}: it or a folder above it is a file, not a directory; "
                        "pick a directory path for the plan") from None
    except OSError as e:
        raise PlanError(f"cannot write plan {root}: {e.strerror or e}; pick another directory for the plan") from None
    try:
        doc = program_to_dict(program)
    except SerializeError as e:
        raise PlanError(f"cannot write plan {root}: {e}") from None
    text = json.dumps(doc, indent=1)
    replaced = _read_text(root / PROGRAM_FILE)
    write_atomic(root / PROGRAM_FILE, text)
    if replaced is not None and replaced != text:
        (root / REPORT_FILE).unlink(missing_ok=True)  # it described the program replaced
    if program.constant_values:
        if any(v.is_meta for v in program.constant_values.values()):
            raise PlanError("the model's constants are on the meta device; trace a model with real buffers to save them")
        save_file(_unshared(program.constant_values), str(root / CONSTANTS_FILE))
    else:
        (root / CONSTANTS_FILE).unlink(missing_ok=True)
    return root


def _unshared(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` on the CPU, each in memory of its own: safetensors refuses tensors that share
    memory, and one buffer registered in every block (a rotary table made once for the model) is
    a constant under each block's name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, v in values.items():
        t = v.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file of this writer's own (two writers into
    one plan directory must not remove each other's): a reader sees the old file or the new."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def load_plan(path: str | Path) -> Program:
    """Read a plan directory written by `save_plan`."""
    root = Path(path)
    f = root / PROGRAM_FILE
    if not f.is_file():
        raise PlanError(f"{root} is not a plan directory (no {PROGRAM_FILE}); create one with `mtc trace`")
    try:
        program = program_from_dict(json.loads(f.read_text()))
    except (SerializeError, json.JSONDecodeError, KeyError) as e:
        raise PlanError(f"plan {f} is malformed or from another mtc version: {e}; re-trace the model") from None
    if program.constants:
        cf = root / CONSTANTS_FILE
        if not cf.is_file():
            raise PlanError(f"plan {root} names constants but {CONSTANTS_FILE} is missing; re-trace the model")
        program.constant_values = load_file(str(cf))
    return program


def kernels_target(path: str | Path) -> str | None:
    """What the generated kernels of plan directory ``path`` were compiled for: ``"cpu-interpreter"``
    (Triton's interpreter), a CUDA capability such as ``"sm90"``, or None when it holds none (a
    plan written by `save_plan` alone, e.g. ``mtc.save_plan``). Read from the compile report's cache
    key (`mtc.compiler.cache_key`)."""
    root = Path(path)
    try:
        key = json.loads((root / REPORT_FILE).read_text()).get("cache_key")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(key, str) or not (root / "kernels").is_dir():
        return None
    return "cpu-interpreter" if key.endswith("-cpu-interpreter") else key.rpartition("-")[2]


# where `mtc compile` names a TrainConfig field otherwise than `mtc train` does
_COMPILE_FLAGS = {"compute_dtype": "--dtype"}


def compile_command(plan: str | Path, fields: dict, **override: object) -> str:
    """The command that compiles the plan directory ``plan`` again with the settings ``fields``
    (its model record: model, shape, dtype, matmul fusion), ``override`` changing some of them:
    `mtc compile` for a preset or a factory, ``mtc.compile`` for a model given from Python."""
    want = {k: fields.get(k) for k in ("micro_batch_size", "seq_len", "compute_dtype", "matmul_fusion")} | override
    if want.get("compute_dtype") == "auto":
        want["compute_dtype"] = "bfloat16"  # (`mtc compile --dtype` names the dtype: auto would be the CPU's float32)
    model = str(fields["model"])
    if model == "custom":  # (mtc.user_model.CUSTOM: no import path to name)
        return (f"mtc.compile(model, {str(plan)!r}, batch_size={want['micro_batch_size']}, seq_len={want['seq_len']}, "
                f"dtype={want['compute_dtype']!r}) from Python")
    flags = " ".join(f"{_COMPILE_FLAGS.get(k, '--' + k.replace('_', '-'))} {v}" for k, v in want.items() if v is not None)
    source = f"--model {model}" if ":" in model else model
    return f"mtc compile {source} {flags} -o {plan}"
