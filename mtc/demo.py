"""The embedded demo: prepare the shipped corpus, train `tiny` through the store, sample text."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from mtc.config import OptimConfig, TrainConfig
from mtc.data import ByteTokenizer, embedded_corpus_dir, prepare
from mtc.errors import ConfigError
from mtc.generate import generate
from mtc.runtime.state import load_into_module
from mtc.store.directory import file_in_the_way
from mtc.train import StepRecord, build_model, train

__all__ = ["DemoResult", "check_demo", "demo_config", "run_demo"]

PROMPT = "The old harbour"


@dataclasses.dataclass(frozen=True, slots=True)
class DemoResult:
    """Figures and the text sample of a demo run."""

    first_loss: float
    last_loss: float
    steps: int
    train_s: float
    sample: str
    store_dir: Path


def demo_config(steps: int = 400) -> TrainConfig:
    """The demo's run: `tiny` on bytes, 16 x 128 tokens a step, AdamW with warmup and cosine decay."""
    return TrainConfig(
        model="tiny",
        steps=steps,
        micro_batch_size=16,
        seq_len=128,
        grad_accum=1,
        seed=0,
        optim=OptimConfig(lr=4e-3, min_lr=4e-4, warmup_steps=20, weight_decay=0.1, clip_norm=1.0),
    )


def check_demo(workdir: str | Path, steps: int) -> None:
    """Raise ConfigError for a demo that cannot run: ``steps`` below 1, or a ``workdir`` that is
    (or lies under) a file. `run_demo` asks before it writes the corpus; so does `mtc demo`."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"--steps: expected a number of steps >= 1, got {steps!r}; the demo trains 400 by default")
    f = file_in_the_way(workdir)
    if f is not None:
        where = "it is a file" if f == Path(workdir) else f"{f}, a parent of it, is a file"
        raise ConfigError(f"--dir {workdir}: {where}, not a directory; give a directory for the demo's corpus and store")


def run_demo(workdir: str | Path, *, steps: int = 400, on_step: Callable[[StepRecord], None] | None = None) -> DemoResult:
    """Run the whole demo in ``workdir`` (a fresh store each time) and return its figures."""
    check_demo(workdir, steps)  # before anything is written
    cfg = demo_config(steps)
    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    data = root / "corpus.bin"
    tokens = prepare(embedded_corpus_dir(), data, tokenizer="byte")
    result = train(cfg, root / "store", tokens, on_step=on_step, overwrite=True)
    try:
        model = build_model(cfg)
        load_into_module(model, result.program, result.store, result.generation)
    finally:
        result.store.close()
    tok = ByteTokenizer()
    out = generate(model, list(tok.encode(PROMPT)), max_new_tokens=240, context=cfg.seq_len, temperature=0.7, seed=1)
    return DemoResult(
        first_loss=result.losses[0], last_loss=result.losses[-1], steps=result.end_step,
        train_s=result.wall_s, sample=PROMPT + tok.decode(out), store_dir=root / "store",
    )

