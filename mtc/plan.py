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

from safetensors.torch import load_file, save_file

from mtc.errors import PlanError
from mtc.graphs.program import Program
from mtc.graphs.serialize import SerializeError, program_from_dict, program_to_dict

__all__ = ["PLAN_KERNEL_FIELDS", "PLAN_MODEL_FIELDS", "load_plan", "load_plan_model", "save_plan", "save_plan_model"]

PROGRAM_FILE = "program.json"
CONSTANTS_FILE = "constants.safetensors"
MODEL_FILE = "model.json"
# the TrainConfig fields a traced program depends on
PLAN_MODEL_FIELDS = ("model", "model_overrides", "micro_batch_size", "seq_len", "compute_dtype")
# the TrainConfig fields its compiled kernels depend on (optional: plans written before them lack them)
PLAN_KERNEL_FIELDS = ("matmul_fusion",)


def save_plan(program: Program, path: str | Path) -> Path:
    """Write ``program`` into the plan directory ``path`` (created if needed) and return it."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    try:
        doc = program_to_dict(program)
    except SerializeError as e:
        raise PlanError(f"cannot write plan {root}: {e}") from None
    tmp = root / f".{PROGRAM_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"  # (own name: writers may race)
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, root / PROGRAM_FILE)
    if program.constant_values:
        vals = {k: v.detach().cpu().contiguous() for k, v in program.constant_values.items()}
        if any(v.is_meta for v in program.constant_values.values()):
            raise PlanError("the model's constants are on the meta device; trace a model with real buffers to save them")
        save_file(vals, str(root / CONSTANTS_FILE))
    return root


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


def save_plan_model(path: str | Path, fields: dict) -> None:
    """Record in the plan directory which preset and shapes its program was traced for."""
    missing = [k for k in PLAN_MODEL_FIELDS if k not in fields]
    if missing:
        raise PlanError(f"plan model record lacks {', '.join(missing)}")
    doc = {k: fields[k] for k in PLAN_MODEL_FIELDS} | {k: fields[k] for k in PLAN_KERNEL_FIELDS if k in fields}
    Path(path, MODEL_FILE).write_text(json.dumps(doc, indent=1))


def load_plan_model(path: str | Path) -> dict:
    """The preset and shapes a plan was compiled for (see `save_plan_model`)."""
    f = Path(path, MODEL_FILE)
    if not Path(path, PROGRAM_FILE).is_file():
        raise PlanError(f"{path} is not a plan directory (no {PROGRAM_FILE}); create one with `mtc compile`")
    if not f.is_file():
        raise PlanError(f"plan {path} has no {MODEL_FILE} (written by `mtc compile`); recompile it with `mtc compile MODEL -o {path}`")
    try:
        doc = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise PlanError(f"{f} is not valid JSON ({e}); recompile the plan") from None
    missing = [k for k in PLAN_MODEL_FIELDS if k not in doc]
    if missing:
        raise PlanError(f"{f} lacks {', '.join(missing)}; recompile the plan")
    return doc
