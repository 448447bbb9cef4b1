"""The training loop: trace (or load the plan), open the store, stream steps, commit each one.

A store directory is the whole run: ``plan/`` (the traced Program), the state arrays, the commit
record and ``logs/`` (resolved config, metrics). Opening an existing store resumes from its last
commit: same plan, same state generation, same data cursor and RNG state, so a run stopped after
step k and resumed continues exactly as if it had not stopped.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from mtc.config import TrainConfig
from mtc.data import BatchSampler, TokenFile
from mtc.errors import ConfigError, DataError, StoreError
from mtc.graphs.program import Program
from mtc.models import build, model_config
from mtc.plan import load_plan, save_plan
from mtc.runtime.executor import StreamingExecutor
from mtc.runtime.optimizer import HostAdamW
from mtc.runtime.schedule import lr_at
from mtc.runtime.state import init_state
from mtc.store import CommitRecord, TensorStore
from mtc.tracer import trace

__all__ = ["StepRecord", "TrainResult", "build_model", "open_run", "train"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepRecord:
    """Metrics of one optimizer step (``step`` counts completed steps, from 1)."""

    step: int
    total_steps: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    tokens: int


@dataclasses.dataclass(slots=True)
class TrainResult:
    """What a call to `train` did."""

    start_step: int
    end_step: int
    losses: list[float]
    wall_s: float
    store: TensorStore
    program: Program
    generation: int
    compiled: dict | None = None


def build_model(cfg: TrainConfig, *, device: str | torch.device = "cpu") -> nn.Module:
    """The preset model of ``cfg``, initialised from ``cfg.seed`` (use device='meta' for shapes only)."""
    mcfg = model_config(cfg.model, **cfg.model_overrides)
    if cfg.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}")
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = build(cfg.model, **cfg.model_overrides)
    return model.to(getattr(torch, cfg.resolved_compute_dtype))


def _rng_state() -> dict[str, str]:
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def _set_rng_state(state: dict[str, str]) -> None:
    if "torch" in state:
        raw = base64.b64decode(state["torch"])
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def _comparable(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("io_threads", "kernels")}


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "model_overrides":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def open_run(
    cfg: TrainConfig, store_dir: str | Path | None, *, model: nn.Module | None = None, overwrite: bool = False,
    plan: str | Path | None = None,
) -> tuple[TensorStore, Program, CommitRecord]:
    """Open (resume) or create the run in ``store_dir``; None means an in-memory store (tests).

    A new run traces ``model`` (default: the preset of ``cfg``), or takes the program of the plan
    directory ``plan`` (from `mtc compile`, whose generated kernels are copied along), saves the
    plan into the store directory, writes the initial state and commits step 0. A resumed run
    uses the plan saved in its store.
    """
    cfg.validate()
    path = Path(store_dir) if store_dir is not None else None
    if path is not None and (path / "commit.json").exists() and not overwrite:
        store = TensorStore.open(path, io_threads=cfg.io_threads)
        try:
            last = store.last_commit()
            if last is None:
                raise StoreError(f"store {path} has no commit; remove it or pass overwrite to start over")
            saved, now = _flat(_comparable(last.config)), _flat(_comparable(cfg.to_dict()))
            if saved != now:
                diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
                raise ConfigError(
                    f"store {path} was created with a different config (differs in: {', '.join(diff)}); "
                    "resume with the same config, or use a new store directory"
                )
            program = load_plan(path / "plan")
        except BaseException:
            store.close()
            raise
        return store, program, last
    store = TensorStore.create(path, io_threads=cfg.io_threads, overwrite=overwrite)
    try:
        model = model if model is not None else build_model(cfg)
        program = load_plan(plan) if plan is not None else trace(model, cfg.micro_batch_size, cfg.seq_len)
        if path is not None:
            save_plan(program, path / "plan")
            if plan is not None and Path(plan, "kernels").is_dir():  # generated once, by `mtc compile`
                shutil.copytree(Path(plan, "kernels"), path / "plan" / "kernels", dirs_exist_ok=True)
        init_state(program, store, dict(model.named_parameters()), compute_dtype=getattr(torch, cfg.resolved_compute_dtype))
        first = CommitRecord(
            step=0, generation=0, data_cursor=0, rng_state=_rng_state(), config=cfg.to_dict(), time_unix=time.time()
        )
        store.commit(first)
    except BaseException:
        store.close()
        raise
    return store, program, first


def train(
    cfg: TrainConfig,
    store_dir: str | Path | None,
    data: str | Path | TokenFile,
    *,
    model: nn.Module | None = None,
    stop_after: int | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    overwrite: bool = False,
    store: tuple[TensorStore, Program, CommitRecord] | None = None,
) -> TrainResult:
    """Train to ``cfg.steps`` (or stop once ``stop_after`` steps are committed), resuming if possible.

    ``on_step`` is called after every committed step (the CLI draws its progress bar there).
    The returned store is open; close it (or use it to read the weights) when done.
    """
    t0 = time.perf_counter()
    tokens = data if isinstance(data, TokenFile) else TokenFile.open(data)
    st, program, last = store if store is not None else open_run(cfg, store_dir, model=model, overwrite=overwrite)
    try:
        if tokens.header.vocab_size > _model_vocab(program):
            raise DataError(
                f"token file vocabulary ({tokens.header.vocab_size}) is larger than the model's ({_model_vocab(program)}); "
                "prepare the data with the model's tokenizer"
            )
        if st.path is not None:
            logs = st.path / "logs"
            logs.mkdir(exist_ok=True)
            (logs / f"config-step{last.step}.json").write_text(json.dumps(cfg.to_dict(), indent=1))
            metrics = open(logs / "metrics.jsonl", "a")
        else:
            metrics = None
        _set_rng_state(last.rng_state)
        sampler = BatchSampler(tokens, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        device = torch.device(cfg.device)
        compiled = _compile(cfg, program, st)
        executor = StreamingExecutor(program, st, device=device, compiled=compiled)
        opt = HostAdamW(program, st, cfg.optim, compute_dtype=getattr(torch, cfg.resolved_compute_dtype),
                        kernel_device=device if cfg.gpu_update == "all" else None)
        step, gen, cursor = last.step, last.generation, last.data_cursor
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        losses: list[float] = []
        try:
            while step < end:
                ts = time.perf_counter()
                lr = lr_at(step, cfg.steps, cfg.optim)
                opt.begin_step(step, lr, read_gen=gen, write_gen=1 - gen)
                mbs = [sampler.batch(cursor + j) for j in range(cfg.grad_accum)]
                mb_losses = executor.run(mbs, opt, gen)
                stats = opt.finish_step()
                step, gen, cursor = step + 1, 1 - gen, cursor + cfg.grad_accum
                st.commit(
                    CommitRecord(
                        step=step, generation=gen, data_cursor=cursor, rng_state=_rng_state(),
                        config=cfg.to_dict(), time_unix=time.time(),
                    )
                )
                loss = sum(mb_losses) / len(mb_losses)
                losses.append(loss)
                rec = StepRecord(
                    step=step, total_steps=cfg.steps, loss=loss, lr=lr, grad_norm=stats.grad_norm,
                    seconds=time.perf_counter() - ts, tokens=cfg.grad_accum * cfg.micro_batch_size * cfg.seq_len,
                )
                if metrics is not None:
                    metrics.write(json.dumps(dataclasses.asdict(rec)) + "\n")
                    metrics.flush()
                if on_step is not None:
                    on_step(rec)
        finally:
            executor.close()
            opt.close()
            if metrics is not None:
                metrics.close()
    except BaseException:
        st.close()
        raise
    return TrainResult(
        start_step=last.step, end_step=step, losses=losses, wall_s=time.perf_counter() - t0,
        store=st, program=program, generation=gen, compiled=compiled,
    )


def _compile(cfg: TrainConfig, program: Program, st: TensorStore) -> dict | None:
    """The compiled templates for a fused run (kernels cached in the store's plan dir), else None."""
    if not cfg.fused:
        return None
    if cfg.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            "fused kernels on the CPU run in Triton's interpreter, which must be enabled before start: "
            "set TRITON_INTERPRET=1 (slow: for tests), or use kernels='unfused' on the CPU"
        )
    from mtc.compiler import compile_program

    cache = st.path / "plan" / "kernels" if st.path is not None else Path(tempfile.mkdtemp(prefix="mtc-kernels-"))
    return compile_program(program, cache)


def _model_vocab(program: Program) -> int:
    """Vocabulary size, read off the loss stage's logits width (the head's last weight dim 0)."""
    head = program.layers[-1]
    widths = [program.params[k].spec.shape[0] for k in head.param_keys() if len(program.params[k].spec.shape) == 2]
    return max(widths) if widths else 0
