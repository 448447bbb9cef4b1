"""Data-parallel runs through skipped steps: a non-finite loss or gradient norm on one rank, or on all.

A step whose loss or global gradient norm is not finite anywhere is skipped by every rank (no
weight, m or v changes, and Adam's bias correction does not count it: `StreamingAdamW.note_skipped`),
as the single process skips it. The model is GradPoisonedLM (tests/mtc/custom_models.py), run from
a plan directory; the token file holds its poison tokens only in chosen micro-batches, so the
skipped steps and the ranks that see them are known. Real ranks over gloo (world 2, 2 micro-batches
per rank) against the single-process run of the same plan, config and data, itself checked
against torch's AdamW loop that skips the same steps.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mtc.store import TensorStore

from mtc import save_plan, shards
from mtc.cli import main
from mtc.config import OptimConfig
from mtc.data import BatchSampler
from mtc.data.tokens import write_token_file
from mtc.plan import load_plan
from mtc.runtime.schedule import lr_at
from mtc.tracer import LossModel, trace
from mtc.warmstart import load_state_dict
from tests.mtc.custom_models import VOCAB, GradPoisonedLM, poisoned
from tests.mtc.test_data_parallel import ROOT, _env, _free_port

GA, B, T, STEPS, SEED = 4, 2, 16, 6, 5
NAN_AT = (7, 16, 19)  # micro-batches whose loss is NaN: step 1 on rank 1 only, step 4 on both ranks
INF_AT = (13,)  # a finite loss with an infinite gradient: step 3, on rank 0 only
SKIPPED = [False, True, False, True, True, False]
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, weight_decay=0.1, clip_norm=0.5)
FLAGS = ["--unfused", "--steps", str(STEPS), "--grad-accum", str(GA), "--commit-every", "1", "--gpu-update", "none",
         "--seed", str(SEED), "--lr", str(OPTIM.lr), "--min-lr", str(OPTIM.min_lr), "--warmup-steps", str(OPTIM.warmup_steps),
         "--weight-decay", str(OPTIM.weight_decay), "--clip-norm", str(OPTIM.clip_norm), "--device", "cpu"]


def _tokens(path: Path) -> BatchSampler:
    """A token file without poison but at one position of each chosen micro-batch (batch k's
    windows are drawn from (seed, k) alone: a sampler over the positions says where they fall)."""
    n = 40_000
    rng = np.random.default_rng(0)
    toks = rng.choice(GradPoisonedLM.GRAD_POISON, size=n, p=rng.dirichlet(np.full(GradPoisonedLM.GRAD_POISON, 0.1)))
    where = BatchSampler(np.arange(n), batch_size=B, seq_len=T, seed=SEED)
    for ks, token in ((NAN_AT, GradPoisonedLM.POISON), (INF_AT, GradPoisonedLM.GRAD_POISON)):
        for k in ks:
            toks[int(where.batch(k)[0][0, 3])] = token
    tf = write_token_file(path, toks.astype(np.uint16), vocab_size=VOCAB, tokenizer="byte")
    sampler = BatchSampler(tf, batch_size=B, seq_len=T, seed=SEED)
    for ks, token in ((NAN_AT, GradPoisonedLM.POISON), (INF_AT, GradPoisonedLM.GRAD_POISON)):
        assert [k for k in range(STEPS * GA) if (sampler.batch(k)[0] == token).any()] == list(ks)
    return sampler


def _start(n: int, args: list[str]) -> list[subprocess.Popen]:
    port, procs = _free_port(), []
    for r in range(n):
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
        procs.append(subprocess.Popen([sys.executable, "-m", "mtc", "train", *args], env=env, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _wait(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        assert p.wait(timeout=400) == 0, p.stderr.read()[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process run (in this process) and two 2-rank runs: RAM, host collectives, in one
    launch; and part RAM part disk, device collectives, stopped after the first skip and resumed."""
    d = tmp_path_factory.mktemp("dpskip")
    sampler = _tokens(d / "tok.bin")
    plan = save_plan(trace(GradPoisonedLM(), B, T), d / "plan", factory=poisoned)
    common = ["--plan", str(plan), "--data", str(d / "tok.bin"), *FLAGS]
    ram = _start(2, ["--store", str(d / "ram"), *common, "--placement", "ram"])
    mixed = ["--store", str(d / "mixed"), *common, "--placement", "ram:0-1,disk:2-3", "--dp-collectives", "device"]
    first = _start(2, [*mixed, "--stop-after", "2"])
    assert main(["train", "--store", str(d / "ref"), *common, "--placement", "ram"]) == 0
    _wait(first)
    with TensorStore.open(d / "mixed", read_only=True) as st:
        assert st.last_commit().step == 2
    _wait(_start(2, mixed) + ram)
    return d, sampler


def _run(store: Path) -> tuple[dict[str, torch.Tensor], list[dict], dict]:
    """Master, m and v of every layer at the last commit, the logged step records, the commit's meta."""
    with TensorStore.open(store, read_only=True) as st:
        last = st.last_commit()
        program = load_plan(store / "plan")
        arrays = {f"{i}.{k}": shards.read_layer(store, last, i, k, program.layer_numel(i), root_store=st)
                  for i in range(program.n_layers) if program.layer_numel(i) for k in ("master", "m", "v")}
    recs = [json.loads(line) for line in (store / "logs" / "metrics.jsonl").read_text().splitlines()]
    return arrays, recs, last.meta


@pytest.mark.slow
def test_every_rank_skips_the_steps_the_single_process_skips_and_the_runs_agree(runs):
    d, _ = runs
    ref, rrec, rmeta = _run(d / "ref")
    assert [r["skipped"] for r in rrec] == SKIPPED
    # a non-finite value is logged as null: step 4's loss was finite, its gradient norm was not
    assert [r["loss"] is None for r in rrec] == [False, True, False, False, True, False]
    assert [r["grad_norm"] is None for r in rrec] == [False, True, False, True, True, False]
    for name in ("ram", "mixed"):  # (mixed: resumed after the first skip)
        got, rec, meta = _run(d / name)
        assert [r["step"] for r in rec] == list(range(1, STEPS + 1)) and [r["skipped"] for r in rec] == SKIPPED
        for key in ("loss", "grad_norm"):
            assert [r[key] is None for r in rec] == [r[key] is None for r in rrec], key
            assert [r[key] for r in rec if r[key] is not None] == pytest.approx(
                [r[key] for r in rrec if r[key] is not None], abs=1e-5, rel=1e-5), key
        assert [r["targets"] for r in rec] == [r["targets"] for r in rrec] == [GA * B * T] * STEPS
        # Adam counted 3 updates in 6 steps on every rank, as the commit records for a resume
        assert meta["moments_from"] == rmeta["moments_from"] == SKIPPED.count(True)
        for k in ref:  # master, m and v of every layer
            torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k, n=name: f"{n} {k}: {m}")
        assert main(["verify", str(d / name)]) == 0


@pytest.mark.slow
def test_the_single_process_run_is_torchs_adamw_loop_that_skips_those_steps(runs):
    d, sampler = runs
    torch.manual_seed(SEED)  # the factory's weights, seeded as a run seeds them
    model = poisoned()
    lm = LossModel(model)
    params = dict(model.named_parameters())
    decay = {k for k, p in params.items() if p.ndim >= 2}
    opt = torch.optim.AdamW([{"params": [p for k, p in params.items() if k in decay], "weight_decay": OPTIM.weight_decay},
                             {"params": [p for k, p in params.items() if k not in decay], "weight_decay": 0.0}],
                            lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    skipped = []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, STEPS, OPTIM)
        loss = 0.0
        for j in range(GA):
            ids, tg = sampler.batch(step * GA + j)
            part = lm(ids, tg) / GA  # every target counts: the step's mean is the mean of the means
            part.backward()
            loss += part.item()
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), OPTIM.clip_norm)
        skipped.append(not (math.isfinite(loss) and math.isfinite(norm.item())))
        if not skipped[-1]:
            opt.step()
        opt.zero_grad(set_to_none=True)
    assert skipped == SKIPPED
    got = load_state_dict(d / "ref")
    for k, p in params.items():
        torch.testing.assert_close(got[k], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
