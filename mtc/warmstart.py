"""Runs that start from given weights, and weights read back from a run by name.

A *seeded* store holds weights that did not come from training it: an imported Hugging Face
checkpoint (`mtc.hf.import_hf`) or another run's (`--init-from RUN`). It is laid out exactly as a
fresh run's store after its step-0 commit: the plan, fp32 master weights in generation 0, Adam's m
and v written as zeros (every chunk: the store never leaves a chunk unwritten, so `mtc verify`
finds a healthy store), and a step-0 commit whose ``meta["init"]`` says where the weights came
from. The root attribute ``mtc_init`` keeps that provenance after training commits.

Training a seeded store (`open_seeded`, called by `mtc.train.open_run`) is a new run that starts
from those weights: the model must be the one stored, but every other field (steps, schedule,
batch shape, data) is the user's, and the plan is re-traced for the batch shape if it differs.
Once the first training step commits, the store is an ordinary run and resumes as one.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mtc.config import TrainConfig
from mtc.errors import ConfigError, PlanError, StoreError
from mtc.graphs.program import Program
from mtc.models import model_config, model_names
from mtc.plan import load_plan, save_plan
from mtc.shards import StateReader, is_sharded
from mtc.store import LAYOUT_ATTR, STATE_DTYPE, CommitRecord, TensorStore, state_array_name
from mtc.store.directory import read_commit_file, read_write_starts
from mtc.weight_sources import check_untouched, open_run_store

__all__ = ["INIT_ATTR", "available_steps", "create_seeded_store", "init_from", "is_seeded", "load_state_dict", "open_seeded",
           "run_model", "source_model"]

INIT_ATTR = "mtc_init"
_ZERO_CHUNKS = 4  # zeros are written this many store chunks at a time (bounded memory, parallel writes)


def is_seeded(last: CommitRecord) -> bool:
    """Whether ``last`` is a seeded store's step-0 commit (training it starts a new run)."""
    return last.step == 0 and isinstance(last.meta.get("init"), dict)


def seed_config(family: str, fields: dict[str, Any], **shape: int) -> TrainConfig:
    """The config recorded with a seeded store: the model, and a small batch shape for its plan."""
    max_len = model_config(family, **fields).max_seq_len
    cfg = TrainConfig(model=family, model_overrides=dict(fields), micro_batch_size=shape.get("micro_batch_size", 1),
                      seq_len=shape.get("seq_len", min(128, max_len)))
    cfg.validate()
    return cfg


def _rng_state(seed: int) -> dict[str, str]:
    g = torch.Generator().manual_seed(seed)
    return {"torch": base64.b64encode(g.get_state().numpy().tobytes()).decode()}


def _write_zeros(st: TensorStore, name: str, n: int) -> None:
    """Zeros into every chunk of ``name``, a few whole chunks per write (never a whole-layer buffer)."""
    rows = st.array_info(name).chunk_rows
    span = rows * _ZERO_CHUNKS
    zeros = torch.zeros(min(n, span), dtype=STATE_DTYPE)
    for lo in range(0, n, span):
        st.write_rows(name, lo, zeros[: min(span, n - lo)])


def create_seeded_store(path: str | Path, cfg: TrainConfig, program: Program, fill: Callable[[int, torch.Tensor], None],
                        source: dict[str, Any], *, overwrite: bool = False, io_threads: int = 4) -> None:
    """Create a store at ``path`` seeded with weights and commit it as step 0.

    ``fill(layer, flat)`` writes layer ``layer``'s fp32 parameters into ``flat`` (its flat-state
    order); it is called once per layer, so only one layer is in memory at a time. ``source`` is
    the provenance recorded in the commit and the store's ``mtc_init`` attribute.
    """
    path = Path(path)
    st = TensorStore.create(path, io_threads=io_threads, overwrite=overwrite)
    try:
        save_plan(program, path / "plan")
        numels = [program.layer_numel(i) for i in range(program.n_layers)]
        # the layout a fresh CPU run records (every layer in RAM); a run's own placement replaces it
        st.set_attribute(LAYOUT_ATTR, {"numels": numels, "compute_dtype": None, "placement": ["ram"] * len(numels)})
        st.set_attribute(INIT_ATTR, source)
        for layer, n in enumerate(numels):
            if not n:
                continue
            for kind in ("master", "m", "v"):
                for g in (0, 1):
                    st.create_array(state_array_name(layer, kind, g), (n,), STATE_DTYPE)
            flat = torch.empty(n, dtype=STATE_DTYPE)
            fill(layer, flat)
            st.write(state_array_name(layer, "master", 0), flat)
            del flat
            for kind in ("m", "v"):  # fresh Adam state
                _write_zeros(st, state_array_name(layer, kind, 0), n)
        st.commit(CommitRecord(step=0, generation=0, data_cursor=0, rng_state=_rng_state(cfg.seed), config=cfg.to_dict(),
                               time_unix=time.time(), durability="full", meta={"init": source}))
    finally:
        st.close()


def open_seeded(cfg: TrainConfig, path: Path, last: CommitRecord, *, plan: str | Path | Program | None = None) -> Program:
    """The program a new run on seeded store ``path`` trains: ``cfg``'s batch shape, the stored layout.

    Refuses a model other than the stored one. The caller saves it into the store once every
    other check has passed.
    """
    from mtc.trace_cache import trace_preset

    saved_model, saved_over = last.config.get("model"), last.config.get("model_overrides") or {}
    src = last.meta["init"].get("source", "?")
    if model_config(saved_model, **saved_over) != model_config(cfg.model, **cfg.model_overrides):
        raise ConfigError(
            f"store {path} holds weights from {src} for model {saved_model!r} with {_brief(saved_over)}, not model "
            f"{cfg.model!r}; train it without --preset/--config (the model comes from the store), or use another store"
        )
    old = load_plan(path / "plan")
    seeded = TrainConfig.from_dict(last.config)
    if plan is None and all(getattr(seeded, k) == getattr(cfg, k) for k in ("micro_batch_size", "seq_len", "resolved_compute_dtype")):
        return old  # traced for this very shape
    # a plan: a directory (mtc train --plan) or a traced Program (mtc.train(plan=...) from Python)
    program = plan if isinstance(plan, Program) else load_plan(plan) if plan is not None else trace_preset(cfg)
    mine = {k: (p.layer, p.offset, p.spec.shape) for k, p in program.params.items()}
    theirs = {k: (p.layer, p.offset, p.spec.shape) for k, p in old.params.items()}
    if mine != theirs:
        diff = sorted(set(mine) ^ set(theirs)) or sorted(k for k in mine if mine[k] != theirs[k])
        raise PlanError(f"the plan for this run lays out the parameters differently from the weights in {path} "
                        f"(first difference: {diff[0]}); train the stored model as it is")
    return program


def _brief(over: dict[str, Any]) -> str:
    keys = ("vocab_size", "dim", "n_layers", "n_heads")
    return ", ".join(f"{k}={over[k]}" for k in keys if k in over) or "its preset's shape"


# -- where a run's model comes from ------------------------------------------------------------


def run_model(store_dir: str | Path) -> dict[str, Any] | None:
    """``{"model": ..., "model_overrides": ...}`` of the run committed in ``store_dir`` (None: no commit)."""
    f = Path(store_dir) / "commit.json"
    if not f.is_file():
        return None
    try:
        config = json.loads(f.read_text())["config"]
        return {"model": config["model"], "model_overrides": dict(config.get("model_overrides") or {})}
    except (ValueError, KeyError, TypeError) as e:
        raise StoreError(f"commit record {f} is malformed ({e}); see `mtc verify` and `mtc repair`") from None


def run_config(store_dir: str | Path) -> dict[str, Any] | None:
    """The whole config of the run committed in ``store_dir``, which a resume that names no model
    starts from (as ``mtc.train(store=...)`` does); None without a run's commit there (none, a
    damaged record: `open_run` says so, or a seeded store's step-0 record, which only carries the
    model and a small plan shape: training it starts a new run on the defaults)."""
    try:
        rec = read_commit_file(Path(store_dir))
    except (OSError, ValueError, TypeError):
        return None
    return None if rec is None or is_seeded(rec) else dict(rec.config)


def run_device(store_dir: str | Path | None) -> str | None:
    """The device of the run committed in ``store_dir``; None when there is none to resume there
    (no store, no commit, a damaged record: `open_run` says so, or a seeded store, whose step-0
    record only carries the model: training it starts a new run)."""
    if store_dir is None:
        return None
    try:
        rec = read_commit_file(Path(store_dir))
        return None if rec is None or is_seeded(rec) else str(rec.config["device"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def source_model(source: str | Path) -> dict[str, Any]:
    """The model fields of an ``--init-from`` source: a run's store or a Hugging Face checkpoint directory."""
    p = Path(source)
    fields = run_model(p)
    if fields is not None and fields["model"] not in model_names():
        # a user's module: only its own code builds it (the seeded run is traced from a built-in family)
        raise ConfigError(f"--init-from {p}: that run trained a user's model ({fields['model']!r}), and --init-from starts "
                          "built-in model families only; load its weights into your module "
                          f"(`model.load_state_dict(mtc.load_state_dict({str(p)!r}))`) and pass it as mtc.train(model=...)")
    if fields is not None:
        return fields
    if (p / "config.json").is_file():
        from mtc.hf.importer import read_hf_config

        _arch, family, over = read_hf_config(p)
        return {"model": family, "model_overrides": over}
    raise ConfigError(f"--init-from {p}: not a run's store (no commit.json) nor a Hugging Face checkpoint (no config.json)")


def init_from(source: str | Path, store_dir: str | Path, cfg: TrainConfig, *, overwrite: bool = False) -> None:
    """Seed store ``store_dir`` with the weights of ``source`` (a run's store, or a Hugging Face
    checkpoint directory) for a new run of ``cfg`` with fresh optimizer state.

    A store already seeded from the same source (the same command run again, e.g. after an
    interruption) is left as it is, so the run resumes; any other committed store is refused
    unless ``overwrite``.
    """
    src, dst = Path(source).resolve(), Path(store_dir)
    if (dst / "commit.json").exists() and not overwrite:
        with TensorStore.open(dst, read_only=True) as st:
            seeded = st.attributes().get(INIT_ATTR) or {}
        if seeded.get("source") == str(src):
            return
        raise ConfigError(f"store {dst} already holds a run; --init-from starts a new run: use a new store directory "
                          "or pass --overwrite")
    if src.resolve() == dst.resolve():
        raise ConfigError(f"--init-from {src} is the store being created; name another store")
    want = source_model(src)
    if model_config(want["model"], **want["model_overrides"]) != model_config(cfg.model, **cfg.model_overrides):
        raise ConfigError(f"--init-from {src} holds model {want['model']!r} with {_brief(want['model_overrides'])}, not "
                          f"{cfg.model!r}; drop --preset/--config's model to train the source's model")
    if not (src / "commit.json").is_file():
        from mtc.hf.importer import import_hf

        import_hf(src, dst, overwrite=overwrite, io_threads=cfg.io_threads)
        return
    with TensorStore.open(src, read_only=True) as st:
        steps = available_steps(st)
        step = max(steps)
        program = load_plan(src / "plan")
        shape = {k: st.last_commit(rng=False).config[k] for k in ("micro_batch_size", "seq_len")}
        seed = seed_config(want["model"], want["model_overrides"], **shape)
        # a data-parallel source run's weights are assembled from its shard stores
        with StateReader(src, _record_of(st, step, steps[step]), root_store=st, what="--init-from") as reader:

            def fill(layer: int, flat: torch.Tensor) -> None:
                reader.read_into(layer, "master", flat)

            create_seeded_store(dst, seed, program, fill, {"kind": "run", "source": str(src), "step": step},
                                overwrite=overwrite, io_threads=cfg.io_threads)
    # what the source run knows besides its weights, as `mtc import` wrote it there: the tokenizer
    # (a later run refuses data from another one) and the Hugging Face config (export's architecture,
    # EOS ids, generation config)
    for sub in ("tokenizer", "hf"):
        if (src / sub).is_dir():
            shutil.copytree(src / sub, dst / sub, dirs_exist_ok=True)


# -- reading weights back ----------------------------------------------------------------------


def available_steps(st: TensorStore) -> dict[int, int]:
    """``{step: generation}`` of the committed weights ``st`` still holds, newest last.

    The last commit's generation always; the commit before it too when its generation has not
    been written since (the store keeps two generations; a step after the last commit starts
    overwriting the other one: the run's write log says so, or in a store without one, chunk
    files newer than the last commit).
    """
    last = st.last_commit(rng=False)
    if last is None:
        raise StoreError(f"store {st.path} has no commit: no weights to read")
    if is_sharded(last) or (st.path is not None and read_write_starts(st.path) is not None):
        # a data-parallel run (its shard stores hold the state), or a run that logs its writes: the
        # log says whether the previous generation was written since (file times do not survive a copy)
        from mtc.weight_sources import committed_steps

        out = {s.step: s.generation for s in reversed(committed_steps(st)) if s.record.durability != "none"}
        if not out and not is_sharded(last):
            raise StoreError(f"store {st.path} was run with durability 'none': its weights were never written")
        return out
    out: dict[int, int] = {}
    history = [r for r in st.commit_history() if r.step < last.step and r.generation != last.generation]
    if history and history[-1].durability != "none":
        prev = history[-1]
        if _untouched_since(st, prev.generation, last.time_unix):
            out[prev.step] = prev.generation
    if last.durability != "none":
        out[last.step] = last.generation
    if not out:
        raise StoreError(f"store {st.path} was run with durability 'none': its weights were never written")
    return out


def _untouched_since(st: TensorStore, gen: int, t: float) -> bool:
    layout = st.attributes().get(LAYOUT_ATTR) or {}
    for layer, n in enumerate(layout.get("numels") or []):
        if not n:
            continue
        name = state_array_name(layer, "master", gen)
        if not st.has_array(name):
            return False
        for c in range(st.array_info(name).n_chunks):
            p = st.chunk_path(name, c)
            try:
                if p is None or p.stat().st_mtime > t:
                    return False
            except FileNotFoundError:
                return False
    return True


def resolve_step(st: TensorStore, step: int | None) -> tuple[int, int]:
    """(step, generation) to read: the last commit's for None; StoreError naming the available steps otherwise."""
    steps = available_steps(st)
    if step is None:
        step = max(steps)
    if step not in steps:
        raise StoreError(f"step {step} is not available in store {st.path}; available: {', '.join(map(str, sorted(steps)))} "
                         "(a store keeps the weights of its last two commits)")
    return step, steps[step]


def load_state_dict(run: str | Path, step: int | None = None) -> dict[str, torch.Tensor]:
    """A run's fp32 master weights by parameter name (mtc's names, e.g. ``layers.0.attn.wq.weight``),
    with what the traced module's ``state_dict`` holds besides (the other names of tied
    parameters, persistent buffers), so ``model.load_state_dict`` of it is strict.

    ``step``: one of the available committed steps (default: the last). Reads the store without
    its lock, so it works beside a running trainer. Holds the whole model in host memory: for
    models larger than RAM, use `mtc.export_hf` (streamed) instead.
    """
    with open_run_store(run) as st:
        step, gen = resolve_step(st, step)
        program = load_plan(Path(run) / "plan")
        out: dict[str, torch.Tensor] = {}
        with StateReader(Path(run), _record_of(st, step, gen), root_store=st, what="load_state_dict") as reader:
            for layer in range(program.n_layers):
                if program.layer_numel(layer):
                    flat = reader.read(layer, "master", program.layer_numel(layer))
                    out.update({p.key: flat[p.offset : p.offset + p.numel].view(p.spec.shape) for p in program.layer_params(layer)})
    check_untouched(run, step, gen, what=f"load_state_dict of step {step} of run {run}")
    for name in program.meta.get("buffers", []):
        if name in program.constant_values:
            out[name] = program.constant_values[name].clone()
    for alias, key in program.meta.get("tied", {}).items():  # after the buffers: an alias may name one
        out[alias] = out[key]
    return out


def _record_of(st: TensorStore, step: int, generation: int) -> CommitRecord:
    """The newest commit record of ``step`` in ``generation`` (where a data-parallel run's shards are named)."""
    return next((r for r in reversed(st.commit_history()) if r.step == step and r.generation == generation), st.last_commit(rng=False))
