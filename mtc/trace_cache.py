"""Traced programs of the built-in presets, kept between processes (``~/.cache/mtc/programs``).

A preset's program is a pure function of its model config, the micro-batch shape, the compute
dtype, torch's version and mtc's code that builds and traces it. A new run, `mtc plan`,
`mtc compile`, `mtc trace --meta`, a Hugging Face import and a warm start each traced it again: 0.9-1.9 s for the two-block tiny model
on the 2-core VM, 23 s for 70B's 80 blocks, plus 2.1 s in a fresh process for importing torch's
dynamo, which building a model on the meta device pulls in (measured 2026-11-29). So a trace is
kept under a key of exactly those inputs and read back instead; what is read back is what
`save_plan`/`load_plan` round-trip for every resumed run.

The key hashes the source files of `mtc.models`, `mtc.graphs` and `mtc.tracer`. Code replaced
at run time (a model's method patched by a test) is not in those files: where a function of those
modules, or a method of their classes, comes from a file outside mtc, the standard library and
installed packages, the cache is bypassed. Models from a factory or from Python are traced every time (their code is the user's).
``MTC_TRACE_CACHE`` names another directory, or ``off``. Writes are atomic (one file per key, a
temporary file renamed), so concurrent processes (ranks, test workers) share the directory; a
file that cannot be read is traced again and replaced; the least recently used entries beyond `MAX_ENTRIES`
are removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from mtc.graphs.program import Program

__all__ = ["CACHE_ENV", "MAX_ENTRIES", "cache_dir", "trace_key", "trace_preset"]

CACHE_ENV = "MTC_TRACE_CACHE"
MAX_ENTRIES = 256  # ~20-40 KB (tiny) to ~270 KB (70B) each: tens of MB at most
FORMAT = 1
_PACKAGES = ("mtc.models", "mtc.graphs")  # with mtc.tracer: the code a preset's trace depends on


def cache_dir() -> Path | None:
    """Where traced programs are kept; None when ``MTC_TRACE_CACHE=off``."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env.lower() in ("off", "0", "no", "false"):
        return None
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtc" / "programs"


@functools.cache
def _source_roots() -> tuple[Path, ...]:
    import mtc.graphs
    import mtc.models
    import mtc.tracer

    return tuple(Path(d).resolve() for pkg in (mtc.models, mtc.graphs) for d in pkg.__path__) + (
        Path(mtc.tracer.__file__).resolve(),)


@functools.cache
def _source_hash() -> str:
    h = hashlib.sha256()
    for root in _source_roots():
        for f in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


@functools.cache
def _allowed_dirs() -> tuple[Path, ...]:
    """Where the code of an unpatched process comes from: mtc's packages, the standard library,
    installed packages (torch among them)."""
    import importlib.util
    import sysconfig

    dirs = [Path(d).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (d := sysconfig.get_paths().get(key))]
    for name in ("mtc", "mtc.graphs", "mtc.kernels", "mtc.store"):
        spec = importlib.util.find_spec(name)
        dirs += [Path(d).resolve() for d in (spec.submodule_search_locations or [])] if spec else []
    return tuple(dirs)


@functools.cache
def _foreign_file(filename: str) -> bool:
    if filename.startswith("<"):  # generated: a dataclass's __init__, __eq__, ...
        return False
    f = Path(filename).resolve()
    return not any(f.is_relative_to(d) for d in _allowed_dirs())


def _patched() -> bool:
    """Whether a function of the traced modules (or a method of their classes) is code from
    outside mtc, the standard library and installed packages: replaced at run time (a test's
    patched ``forward``), so the source files no longer say what is traced."""
    def foreign(fn: object) -> bool:
        code = getattr(fn, "__code__", None)
        return code is not None and _foreign_file(code.co_filename)

    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "mtc.tracer" or name in _PACKAGES or name.startswith(tuple(p + "." for p in _PACKAGES))):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and obj.__module__ == mod.__name__:
                if any(foreign(fn) for fn in _functions(obj)):
                    return True
            elif foreign(obj):
                return True
    return False


def _functions(cls: type) -> list[object]:
    out = []
    for v in vars(cls).values():
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        elif isinstance(v, property):
            v = v.fget
        out.append(v)
    return out


def trace_key(cfg: object, *, name: str | None = None) -> str:
    """The cache key of preset ``cfg.model``'s program at ``cfg``'s shape and compute dtype."""
    from mtc.models import family_of, model_config

    doc = {
        "format": FORMAT,
        "model": cfg.model,
        "family": family_of(cfg.model),
        "config": dataclasses.asdict(model_config(cfg.model, **cfg.model_overrides)),
        "dtype": cfg.resolved_compute_dtype,
        "batch": [cfg.micro_batch_size, cfg.seq_len],
        "name": name,
        "torch": torch.__version__,
        "source": _source_hash(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _fresh(cfg: object, name: str | None) -> Program:
    from mtc.tracer import trace
    from mtc.train import build_model

    return trace(build_model(cfg, device="meta"), cfg.micro_batch_size, cfg.seq_len, name=name)


def trace_preset(cfg: object, *, name: str | None = None) -> Program:
    """The program of ``cfg``'s model traced on the meta device at ``cfg``'s micro-batch shape and
    compute dtype (``name``: the program's model name, default the model class's): read from the
    cache for a built-in preset where it holds it, else traced (and kept, for a preset)."""
    from mtc import user_model
    from mtc.train import check_seq_len

    root = cache_dir()
    if root is None or user_model.is_factory_path(cfg.model) or cfg.model == user_model.CUSTOM or _patched():
        return _fresh(cfg, name)
    check_seq_len(cfg)  # what building the model would refuse first
    path = root / f"{trace_key(cfg, name=name)}.json"
    program = _read(path)
    if program is not None:
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: kept when the oldest go
        return program
    program = _fresh(cfg, name)
    if not program.constants:  # (values of buffers are not kept here)
        _write(path, program)
    return program


def _read(path: Path) -> Program | None:
    from mtc.graphs.serialize import SerializeError, program_from_dict

    try:
        return program_from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, SerializeError):  # damaged or foreign: traced again, replaced
        return None


def _write(path: Path, program: Program) -> None:
    """Keep ``program`` at ``path``; a cache that cannot be written (read-only home, full disk) is
    not an error: the run goes on with the program it traced."""
    from mtc.graphs.serialize import program_to_dict
    from mtc.plan import write_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(program_to_dict(program)))
    except OSError:
        return
    _prune(path.parent)


def _prune(root: Path) -> None:
    entries = []
    for f in root.glob("*.json"):
        with contextlib.suppress(OSError):
            entries.append((f.stat().st_mtime, f))
    for _, f in sorted(entries)[: max(0, len(entries) - MAX_ENTRIES)]:
        with contextlib.suppress(OSError):
            f.unlink()
