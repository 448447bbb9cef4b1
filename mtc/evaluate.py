"""Validation loss: the program's layer runners, forward only, layer-major over the eval batches.

Eval runs the same templates as training (the run's `LayerRunner`s, or the unfused ATen templates
for a store opened on its own), with no autograd, one layer's weights at a time from a
`mtc.weight_sources` source: each layer is fetched once for all eval batches, as a training step
fetches it once for its micro-batches. The batches are the held-out split of the token file
(`BatchSampler(split="val")`, the last 5 % of the tokens, which training never samples), batch k a
pure function of (seed, k): the same store, data and seed give the same loss, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from mtc.data import BatchSampler, TokenFile, check_fits, check_store_tokenizer, check_tokenizer_identity
from mtc.config import TrainConfig, check_device_name
from mtc.errors import ConfigError
from mtc.graphs.program import Program
from mtc.runtime.executor import IGNORE_INDEX
from mtc.runtime.runners import AutogradRunner, LayerRunner
from mtc.weight_sources import (CommittedStep, StoreWeights, WeightsOverwritten, check_untouched, default_budgets, open_run_store,
                                pick_step)

__all__ = ["EvalResult", "WeightSource", "batch_losses", "combine_losses", "eval_batches", "evaluate_store", "forward_loss",
           "unfused_runners"]

SPLITS = ("val", "train", "all")


class WeightSource(Protocol):
    """Parameters by key on the compute device (see `mtc.weight_sources`)."""

    def get(self, keys: list[str]) -> dict[str, torch.Tensor]: ...

    def prefetch(self, keys: list[str]) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class EvalResult:
    """What an evaluation measured."""

    loss: float  # mean per-token loss over every target of the eval batches (`forward_loss`)
    step: int
    batches: int
    tokens: int  # positions read (micro-batches x seq_len), padding included
    seconds: float
    split: str
    targets: int = 0  # of them, the ones the loss counts (not IGNORE_INDEX: padding, masked prompts)

    @property
    def perplexity(self) -> float:
        """exp(loss) (inf when it overflows)."""
        return math.exp(self.loss) if self.loss < 700 else math.inf


def unfused_runners(program: Program) -> dict[str, LayerRunner]:
    """The ATen templates' runners (what an unfused training run uses)."""
    from mtc.runtime.executor import aux_param_dependence

    aux = aux_param_dependence(program.template_of(0))
    out: dict[str, LayerRunner] = {}
    for call in program.layers:
        out.setdefault(call.template, AutogradRunner(program.templates[call.template], call, aux))
    return out


def eval_batches(tokens: TokenFile | np.ndarray, program: Program, *, n: int, seed: int,
                 split: str = "val") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of the plan's shape from ``split`` ("val": the held-out 5 %, "train", "all")."""
    if split not in SPLITS:
        raise ConfigError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    if n < 1:
        raise ConfigError(f"the number of eval batches must be >= 1, got {n}")
    b, t = program.batch["ids"].shape
    check_fits(tokens, t)
    if split == "all":
        sampler = BatchSampler(tokens, batch_size=b, seq_len=t, seed=seed, split="train", val_fraction=0.0)
    else:
        sampler = BatchSampler(tokens, batch_size=b, seq_len=t, seed=seed, split=split)
    return [sampler.batch(k) for k in range(n)]


def forward_loss(program: Program, runners: dict[str, LayerRunner], weights: WeightSource,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str) -> float:
    """Loss of ``batches``: the sum of per-token losses over every unmasked target divided by their
    count (as training defines a step's loss; batches with more targets weigh more). Every layer
    once, forward only, over all batches before the next layer."""
    return combine_losses(*batch_losses(program, runners, weights, batches, device))


def combine_losses(means: torch.Tensor, counts: torch.Tensor) -> float:
    """`forward_loss` from `batch_losses`' per-batch ``means`` and target ``counts`` (float64, CPU)."""
    keep = counts > 0  # a batch without targets has a NaN mean and no weight
    return float((means[keep] * counts[keep]).sum() / counts[keep].sum())


@torch.no_grad()
def batch_losses(program: Program, runners: dict[str, LayerRunner], weights: WeightSource,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each batch's mean loss over its unmasked targets and their count, float64 on the CPU (the
    one sync), as `forward_loss` computes them (`combine_losses` gives its figure)."""
    device = torch.device(device)
    consts = {k: v.to(device) for k, v in program.constant_values.items()}
    data = [{"ids": i.to(device), "targets": t.to(device)} for i, t in batches]
    carry: list[torch.Tensor | None] = [None] * len(batches)
    aux: list[list[torch.Tensor]] = [[] for _ in batches]
    losses: list[torch.Tensor] = []
    # the head returns a mean over its batch's unmasked targets: weight it back by their count
    counts = [(t != IGNORE_INDEX).sum().double() for _, t in batches]
    last = program.n_layers - 1
    for call in program.layers:
        keys = list(dict.fromkeys(call.param_keys()))
        w = weights.get(keys)
        if call.index < last:
            weights.prefetch(list(dict.fromkeys(program.layers[call.index + 1].param_keys())))
        tmpl = program.templates[call.template]
        fwd = runners[call.template].forward(device)
        for mb in range(len(batches)):
            args = []
            for inp in tmpl.inputs:
                src = call.bindings[inp.name]
                args.append(w[src.key] if src.kind == "param" else carry[mb] if src.kind == "carry"
                            else aux[mb][src.index] if src.kind == "aux" else data[mb][src.key] if src.kind == "batch"
                            else consts[src.key])
            out = fwd(*args)
            if call.index == 0:
                carry[mb], aux[mb] = out[0], list(out[1:])
            elif call.index == last:
                losses.append(out[0].detach().float().reshape(()))
                carry[mb] = None
            else:
                carry[mb] = out[0]
        del w
    return torch.stack(losses).double().cpu(), torch.stack(counts).cpu()


def evaluate_store(store_dir: str | Path, data: str | Path | TokenFile, *, step: int | None = None, batches: int | None = None,
                   split: str = "val", seed: int | None = None, device: str | None = None,
                   device_budget_bytes: int | None = None) -> EvalResult:
    """Loss of a committed step of the run in ``store_dir`` on ``data`` (read-only: works beside training).

    ``seed`` and ``batches`` default to the run's (``seed``, ``eval_batches``), so the val split gives
    what ``--eval-every`` logged;
    ``device`` to the run's when it is available here, else the CPU. The compute dtype is the plan's
    (the dtype its templates were traced in).
    """
    t0 = time.perf_counter()
    if device is not None:
        check_device_name(device)  # (one line, not torch's traceback, for a device this machine lacks)
    tokens = data if isinstance(data, TokenFile) else TokenFile.open(data)
    # beside a running trainer the step read may be overwritten meanwhile: the check after the
    # reads says so, and the newest commit (no step named) is evaluated again
    for attempt in range(READ_ATTEMPTS):
        loss, at, bs = _evaluate_once(store_dir, tokens, step, batches, split, seed, device, device_budget_bytes)
        try:
            check_untouched(store_dir, at.step, at.generation, what=f"evaluating step {at.step} of run {store_dir}")
            break
        except WeightsOverwritten:
            if step is not None or attempt == READ_ATTEMPTS - 1:
                raise
    n_tok = sum(i.numel() for i, _ in bs)
    n_tgt = sum(int((t != IGNORE_INDEX).sum()) for _, t in bs)
    return EvalResult(loss=loss, step=at.step, batches=len(bs), tokens=n_tok, seconds=time.perf_counter() - t0, split=split,
                      targets=n_tgt)


READ_ATTEMPTS = 3
_DEFAULT_EVAL_BATCHES = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "eval_batches")


def _evaluate_once(store_dir: str | Path, tokens: TokenFile, step: int | None, batches: int | None, split: str, seed: int | None,
                   device: str | None, device_budget_bytes: int | None) -> tuple[float, CommittedStep, list]:
    """One evaluation of `evaluate_store`: (loss, the step read, the batches)."""
    from mtc.plan import load_plan

    with open_run_store(store_dir) as st:
        at = pick_step(st, step)
        cfg = at.record.config
        program = load_plan(Path(store_dir) / "plan")
        vocab = max((program.params[k].spec.shape[0] for k in program.layers[-1].param_keys()
                     if len(program.params[k].spec.shape) == 2), default=0)
        tokens.check_vocab(vocab)
        # data from another tokenizer would give a loss that means nothing (training refuses it too)
        check_tokenizer_identity(at.record.meta.get("data"), tokens.identity(), where=f"run {store_dir}")
        check_store_tokenizer(store_dir, tokens)
        dev = torch.device(device if device is not None else _default_device(cfg.get("device", "cpu")))
        # the plan's ATen templates were traced in one dtype and take weights in it only (a store
        # trained or imported on the CPU in fp32, evaluated on a GPU, is evaluated in fp32)
        dtype = getattr(torch, str(program.meta.get("param_dtype", "float32")))
        # the run's own count by default: another count averages other batches than --eval-every did
        n = cfg.get("eval_batches", _DEFAULT_EVAL_BATCHES) if batches is None else batches
        bs = eval_batches(tokens, program, n=n, seed=cfg.get("seed", 0) if seed is None else seed, split=split)
        dev_budget, host_budget = default_budgets(dev)  # past the GPU's memory, layers stream
        src = StoreWeights(program, st, at.generation, device=dev, dtype=dtype,
                           device_budget_bytes=dev_budget if device_budget_bytes is None else device_budget_bytes,
                           host_budget_bytes=host_budget, record=at.record)
        try:
            loss = forward_loss(program, unfused_runners(program), src, bs, dev)
        finally:
            src.close()
    return loss, at, bs


def _default_device(run_device: str) -> str:
    return run_device if run_device.startswith("cuda") and torch.cuda.is_available() else "cpu"


def _compute_dtype(cfg: dict, device: torch.device) -> str:
    dt = cfg.get("compute_dtype", "auto")
    if dt == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    if dt == "bfloat16" and device.type == "cpu":
        return "float32"  # bf16 matmuls on the CPU are slow and add nothing to a loss figure
    return dt

