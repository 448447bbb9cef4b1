"""The Python API on a user's own model: training it without a preset, weight-decay groups and
the schedule against plain PyTorch / transformers, iterable data, and runs that change on resume."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import mtc
from mtc.config import OptimConfig
from mtc.data import BatchSampler
from mtc.errors import ConfigError, DataError
from mtc.plot import plot_run
from mtc.runtime.schedule import lr_at
from mtc.runtime.state import read_params
from mtc.tracer import LossModel
from tests.mtc.custom_models import Block, PoisonedLM, TinyLM, build
from tests.runtime.engine_util import skewed_tokens

SHAPE = {"micro_batch_size": 2, "seq_len": 16}
OPTIM = {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "weight_decay": 0.5, "clip_norm": 0.5}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "t.bin")


@pytest.fixture(scope="module")
def program():
    """TinyLM traced once (tracing is most of a tiny run's time); runs take it as plan=."""
    return mtc.trace(TinyLM(), SHAPE["micro_batch_size"], SHAPE["seq_len"])


def torch_reference(model, batches, lrs, decay, o=OPTIM, grad_accum=1):
    """torch.optim.AdamW with two param groups (``decay`` names, the rest) + clip_grad_norm_."""
    model = copy.deepcopy(model)
    lm = LossModel(model)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for k, p in params.items() if k in decay], "weight_decay": o["weight_decay"]},
         {"params": [p for k, p in params.items() if k not in decay], "weight_decay": 0.0}],
        lr=o["lr"], betas=(0.9, 0.95), eps=1e-8,
    )
    it = iter(batches)
    for lr in lrs:
        for g in opt.param_groups:
            g["lr"] = lr
        for _ in range(grad_accum):
            ids, tg = next(it)
            (lm(ids, tg) / grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), o["clip_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in params.items()}


def weights(res):
    try:
        return {k: v.clone() for k, v in read_params(res.program, res.store, res.generation).items()}
    finally:
        res.store.close()


def assert_close(got, ref):
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def batches(tokens, n, seed=0):
    s = BatchSampler(tokens, batch_size=SHAPE["micro_batch_size"], seq_len=SHAPE["seq_len"], seed=seed)
    return [s.batch(i) for i in range(n)]


NAMES = [k for k, _ in TinyLM().named_parameters()]


@pytest.mark.parametrize("no_decay, min_ndim, expect", [
    # (the default rule, ndim >= 2, is the parity tests' in tests/runtime/test_parity.py)
    # patterns take the embeddings out as well
    ("tok.*,pos", 2, {k for k in NAMES if k.endswith("weight") and "norm" not in k and k != "tok.weight"}),
    # the transformers Trainer's rule: everything but biases and norms
    ("*.bias,*norm*", 0, {k for k in NAMES if not k.endswith("bias") and "norm" not in k}),
])
def test_custom_model_trains_like_torch_adamw_with_its_decay_groups(tokens, program, no_decay, min_ndim, expect):
    torch.manual_seed(1)
    model = TinyLM()
    steps = 3
    optim = {**OPTIM, "no_decay": no_decay, "decay_min_ndim": min_ndim}
    res = mtc.train(model=model, plan=program, data=tokens, steps=steps, seed=7, optim=optim)
    assert {k for k, p in res.program.params.items() if p.decay} == expect
    assert res.records[0].lr == 0.0  # transformers' warmup: step 0 at lr 0
    ref = torch_reference(model, batches(tokens, steps, seed=7), [lr_at(s, steps, OptimConfig(**optim)) for s in range(steps)], expect)
    assert_close(weights(res), ref)


@pytest.mark.parametrize("mode", [{}, {"gpu_update": "1"}, {"placement": "gpu"}])
def test_frozen_parameters_stay_as_they_are_and_the_rest_trains_like_torch(tokens, program, mode):
    """requires_grad=False on the module given (the plan was traced unfrozen): those parameters keep
    their values exactly and count in neither the clipping norm nor weight decay, as in torch."""
    torch.manual_seed(2)
    model = TinyLM()
    frozen = {"tok.weight", "blocks.0.qkv.weight", "blocks.1.norm2.weight"}
    for k, p in model.named_parameters():
        p.requires_grad_(k not in frozen)
    steps = 3
    res = mtc.train(model=model, plan=program, data=tokens, steps=steps, seed=7, optim=OPTIM, **mode)
    assert {k for k, p in res.program.params.items() if p.frozen} == frozen
    decay = {k for k, p in res.program.params.items() if p.decay}
    assert decay == {k for k in NAMES if (k.endswith("weight") and "norm" not in k or k == "pos") and k not in frozen}
    ref = torch_reference(model, batches(tokens, steps, seed=7), [lr_at(s, steps, OptimConfig(**OPTIM)) for s in range(steps)],
                          decay)
    got = weights(res)
    assert_close(got, ref)
    for k in frozen:
        assert torch.equal(got[k], dict(model.named_parameters())[k].detach()), k


def test_a_no_decay_pattern_that_matches_nothing_is_refused(tokens, program):
    with pytest.raises(ConfigError, match=r"optim.no_decay: pattern '\*\.baias' matches no parameter"):
        mtc.train(model=TinyLM(), plan=program, data=tokens, steps=1, optim={"no_decay": "*.baias"})


def test_schedule_is_transformers_cosine_with_warmup():
    tf = pytest.importorskip("transformers")
    for lr, min_lr, warmup, steps in [(1.0, 0.0, 4, 20), (3e-3, 3e-4, 5, 37), (1e-3, 1e-4, 0, 10), (2.0, 0.5, 10, 10)]:
        cfg = OptimConfig(lr=lr, min_lr=min_lr, warmup_steps=warmup)
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
        if min_lr == 0:
            sch = tf.get_cosine_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=steps)
        else:
            sch = tf.get_cosine_with_min_lr_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=steps,
                                                                 min_lr=min_lr)
        theirs = []
        for _ in range(steps + 1):  # one past the last step: where the decay ends
            theirs.append(opt.param_groups[0]["lr"])
            opt.step()
            sch.step()
        ours = [lr_at(s, steps, cfg) for s in range(steps + 1)]
        assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15), (lr, min_lr, warmup, steps)
        if warmup < steps:
            assert math.isclose(ours[-1], min_lr, abs_tol=1e-12)


def test_iterable_data_resumes_by_skipping_consumed_batches(tokens, program, tmp_path):
    data = batches(tokens, 8)
    full = weights(mtc.train(model=build, plan=program, data=data, steps=4, grad_accum=2, optim=OPTIM))
    drawn = []

    def gen():  # a fresh generator each call, as the resume rule asks
        for i, b in enumerate(data):
            drawn.append(i)
            yield b

    store = tmp_path / "s"
    res = mtc.train(model=build, plan=program, data=gen(), store=store, steps=4, grad_accum=2, stop_after=2, optim=OPTIM)
    res.store.close()
    drawn.clear()
    res = mtc.train(data=gen(), store=store)  # resume: config and model from the store
    assert res.start_step == 2 and drawn[:4] == [0, 1, 2, 3] and 4 in drawn
    assert_close(weights(res), full)
    # a list is indexed from the commit's cursor: one too short for the steps asked is refused before any step runs
    steps_run: list[int] = []
    res.close()
    with pytest.raises(DataError, match=r"the data sequence has 10 batches; 2 steps of 2 batches from batch 8 \(where the "
                                        r"last commit stopped\) need 12: give more batches or train fewer steps"):
        mtc.train(data=batches(tokens, 10), store=store, steps=6, allow_change=["steps"],
                  on_step=lambda r: steps_run.append(r.step))
    assert steps_run == []


def test_iterable_data_errors_are_one_line(tokens, program):
    with pytest.raises(DataError, match="ended after 2 batches"):
        mtc.train(model=build, plan=program, data=iter(batches(tokens, 2)), steps=2, grad_accum=2)
    with pytest.raises(DataError, match="the data sequence has 2 batches; 2 steps of 2 batches need 4"):
        mtc.train(model=build, plan=program, data=batches(tokens, 2), steps=2, grad_accum=2)
    bad = [(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))]
    with pytest.raises(DataError, match=r"shape \(2, 8\), the model was traced for \(2, 16\)"):
        mtc.train(model=build, plan=program, data=bad, steps=1)
    wide = [(torch.full((2, 16), 300), torch.zeros(2, 16, dtype=torch.long))]
    with pytest.raises(DataError, match="outside 0-255"):
        mtc.train(model=build, plan=program, data=wide, steps=1)


def test_python_batches_of_any_integer_dtype_train_as_int64_and_in_run_eval_is_refused_first(tokens, program, tmp_path):
    data = batches(tokens, 4)
    want = weights(mtc.train(model=build, plan=program, data=data, steps=2, grad_accum=2, optim=OPTIM))
    # ids as a token file's own memmap holds them (uint16, read-only) and as uint32: the same run
    for dt in (np.uint16, np.uint32):
        cast = [(i.numpy().astype(dt), t.numpy()) for i, t in data]
        for a, _ in cast:
            a.flags.writeable = False
        assert_close(weights(mtc.train(model=build, plan=program, data=cast, steps=2, grad_accum=2, optim=OPTIM)), want)
    # in-run evals read a token file's val split: batches from Python have none, said before the store is made
    with pytest.raises(ConfigError, match=r"eval_every=1 validates on a token file's val split, and batches from Python "
                                          r"have none: pass eval_every=0"):
        mtc.train(model=build, plan=program, data=data, steps=2, grad_accum=2, eval_every=1, store=tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_stopped_and_resumed_equals_uninterrupted(tokens, program, tmp_path):
    base = {"model": build, "plan": program, "data": tokens, "steps": 8, "optim": OPTIM}
    full = weights(mtc.train(**base))
    mtc.train(**base, store=tmp_path / "s", stop_after=4).store.close()
    res = mtc.train(data=tokens, store=tmp_path / "s")
    assert res.start_step == 4
    assert_close(weights(res), full)


def test_train_on_a_rank_of_a_torchrun_launch_is_refused_before_a_store_exists(tokens, tmp_path, monkeypatch):
    # every rank opened or created the store as if alone: rank 1 stopped on rank 0's lock ("locked
    # by pid ...; stop the other run"), or, alone here, created the store before failing to join
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match=r"rank 1 of 2 under torchrun: launch the CLI on every rank .*-m mtc train --plan"):
        mtc.train(model=TinyLM(), data=tokens, store=tmp_path / "s", steps=1, grad_accum=2, **SHAPE)
    assert not (tmp_path / "s").exists()


def test_a_skipped_step_is_not_counted_by_adams_bias_correction_and_resumes_so(tmp_path):
    # steps 0 and 2 see a NaN loss and are skipped: torch's AdamW, whose step() a skipped step never
    # reaches (as under GradScaler), counts 3 updates where the run took 5 steps; the schedule
    # still counts every step. It was one update per step: the first real update came out ~0.7x.
    rng = np.random.default_rng(0)
    data = []
    for k in range(5):
        ids = torch.from_numpy(rng.integers(0, PoisonedLM.POISON, (SHAPE["micro_batch_size"], SHAPE["seq_len"] + 1)))
        if k in (0, 2):
            ids[0, 3] = PoisonedLM.POISON
        data.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    torch.manual_seed(2)
    model = PoisonedLM()
    base = {"model": model, "data": data, "steps": 5, "optim": OPTIM, "commit_every": 1, **SHAPE}
    res = mtc.train(**base, store=tmp_path / "full")
    assert [r.skipped for r in res.records] == [True, False, True, False, False]
    full = weights(res)
    # the log is strict JSON (it wrote Python's NaN token, which jq and JSON.parse reject): a skipped
    # step's non-finite loss is null (PoisonedLM's gradients stay finite: torch.where)
    def strict(tok: str) -> None:
        raise ValueError(f"not JSON: {tok}")

    log = [json.loads(ln, parse_constant=strict) for ln in (tmp_path / "full" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["skipped"], r["loss"] is None) for r in log] == [(True, True), (False, False), (True, True), (False, False), (False, False)]
    plot_run(tmp_path / "full", tmp_path / "run.png")  # draws the gaps

    ref = copy.deepcopy(model)
    lm = LossModel(ref)
    params = dict(ref.named_parameters())
    decay = {k for k, p in params.items() if p.ndim >= 2}
    opt = torch.optim.AdamW([{"params": [p for k, p in params.items() if k in decay], "weight_decay": OPTIM["weight_decay"]},
                             {"params": [p for k, p in params.items() if k not in decay], "weight_decay": 0.0}],
                            lr=OPTIM["lr"], betas=(0.9, 0.95), eps=1e-8)
    for step, (ids, tg) in enumerate(data):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, 5, OptimConfig(**OPTIM))
        loss = lm(ids, tg)
        loss.backward()
        if math.isfinite(loss.item()):
            torch.nn.utils.clip_grad_norm_(list(params.values()), OPTIM["clip_norm"])
            opt.step()
        opt.zero_grad(set_to_none=True)
    assert_close(full, {k: v.detach() for k, v in params.items()})

    # stopped after the first skip and after the second, resumed in new calls: the same weights
    mtc.train(**base, store=tmp_path / "s", stop_after=1).store.close()
    mtc.train(data=data, store=tmp_path / "s", stop_after=3).store.close()
    res = mtc.train(data=data, store=tmp_path / "s")
    assert res.start_step == 3
    got = weights(res)
    assert all(torch.equal(got[k], full[k]) for k in full)


def test_extending_steps_replans_the_schedule_and_is_recorded(tokens, program, tmp_path, capsys):
    torch.manual_seed(3)
    model = TinyLM()
    store = tmp_path / "s"
    mtc.train(model=model, plan=program, data=tokens, store=store, steps=4, optim=OPTIM).store.close()
    with pytest.raises(ConfigError, match=r"differs in: steps 4 -> 8.*--allow-change steps"):
        mtc.train(data=tokens, store=store, steps=8)
    res = mtc.train(data=tokens, store=store, steps=8, allow_change=["steps"])
    assert [r.lr for r in res.records] == [lr_at(s, 8, OptimConfig(**OPTIM)) for s in range(4, 8)]
    # exact: the first 4 steps on the 4-step schedule, the next 4 on the 8-step one
    lrs = [lr_at(s, 4, OptimConfig(**OPTIM)) for s in range(4)] + [lr_at(s, 8, OptimConfig(**OPTIM)) for s in range(4, 8)]
    decay = {k for k, p in res.program.params.items() if p.decay}
    assert_close(weights(res), torch_reference(model, batches(tokens, 8), lrs, decay))
    from mtc.cli import main

    capsys.readouterr()
    assert main(["inspect", str(store)]) == 0
    assert "changed from step 4: steps 4 -> 8" in capsys.readouterr().out


def test_changes_that_would_corrupt_the_state_are_refused_with_the_reason(tokens, program, tmp_path):
    store = tmp_path / "s"
    mtc.train(model=build, plan=program, data=tokens, store=store, steps=1).store.close()
    with pytest.raises(ConfigError, match="seq_len 16 -> 8.*traced at this sequence length"):
        mtc.train(data=tokens, store=store, seq_len=8)
    with pytest.raises(ConfigError, match="optim.no_decay: the weight-decay groups decide the flat layout"):
        mtc.train(data=tokens, store=store, allow_change=["optim.no_decay"], optim={"no_decay": "*.bias"})
    with pytest.raises(ConfigError, match="do not match the model of store.*or pass overwrite=True to start a new run in this store"):
        mtc.train(model=TinyLM(d=8), data=tokens, store=store)


def test_a_plan_needs_weights_and_fixes_the_shape(tokens, program):
    with pytest.raises(ConfigError, match="initial weights"):
        mtc.train(plan=program, data=tokens, steps=1)
    with pytest.raises(ConfigError, match="traced for seq_len=16, not 32"):
        mtc.train(model=TinyLM(), plan=program, data=tokens, steps=1, seq_len=32)
    with pytest.raises(ConfigError, match="do not match the traced program|do not match plan"):
        mtc.train(model=TinyLM(d=8), plan=program, data=tokens, steps=1)


def test_bad_arguments_are_mtc_errors_not_tracebacks(tokens, program, tmp_path):
    with pytest.raises(ConfigError, match=r"optim.lr: expected a finite number > 0 and <= 3.40282e\+38, got 'x'"):  # (was a TypeError)
        mtc.train(model=TinyLM(), plan=program, data=tokens, steps=1, optim={"lr": "x"})
    (tmp_path / "f").write_text("")
    for where in (tmp_path / "f", tmp_path / "f" / "plan"):  # (was FileExistsError / NotADirectoryError)
        with pytest.raises(mtc.errors.MTCError, match="is a file, not a directory; pick a directory path"):
            mtc.save_plan(program, where)


def test_a_model_alone_is_traced_at_the_configured_shape(tokens):
    torch.manual_seed(4)
    model = TinyLM()
    res = mtc.train(model=model, data=tokens, steps=2, micro_batch_size=1, seq_len=8, optim=OPTIM)
    assert res.program.batch["ids"].shape == (1, 8)
    s = BatchSampler(tokens, batch_size=1, seq_len=8, seed=0)
    decay = {k for k, p in res.program.params.items() if p.decay}
    lrs = [lr_at(i, 2, OptimConfig(**OPTIM)) for i in range(2)]
    assert_close(weights(res), torch_reference(model, [s.batch(i) for i in range(2)], lrs, decay))


def test_mtc_train_is_the_api_function_after_importing_the_submodule():
    import importlib

    importlib.import_module("mtc.train")
    assert mtc.train.__module__ == "mtc.api" and callable(mtc.compile)
    assert np.all(np.array([callable(getattr(mtc, n)) for n in ("trace", "save_plan", "load_plan")]))


def test_an_in_memory_run_loads_the_plan_it_was_given(tokens, tmp_path, monkeypatch, capsys):
    """A compiled plan directory trained without a store: its compiled templates are loaded, not
    compiled again, and the plan directory is left as it was. One missing from it is compiled for
    the run, which says how to refresh the plan."""
    from mtc import compiler

    plan = mtc.compile(TinyLM(n_layers=1), tmp_path / "plan", batch_size=1, seq_len=8).path
    before = {p: p.stat().st_mtime_ns for p in plan.rglob("*") if p.is_file()}
    compiled: list[str] = []
    real = compiler.compile_template
    monkeypatch.setattr(compiler, "compile_template", lambda t, *a, **k: compiled.append(t.id) or real(t, *a, **k))
    torch.manual_seed(0)
    res = mtc.train(model=TinyLM(n_layers=1), plan=plan, data=tokens, steps=1, kernels="fused", optim=OPTIM)
    res.store.close()
    assert compiled == [], "an in-memory run compiled templates its plan directory holds"
    assert res.compiled and all(ct.loaded for ct in res.compiled.values())
    assert res.compile_s is not None and res.compile_s > 0 and math.isfinite(res.losses[0])
    assert {p: p.stat().st_mtime_ns for p in plan.rglob("*") if p.is_file()} == before
    assert "refreshes the plan" not in capsys.readouterr().err
    head = next(t for t in res.compiled if t.startswith("head"))
    (plan / "kernels" / "compiled" / f"{head}.json").unlink()
    torch.manual_seed(0)
    mtc.train(model=TinyLM(n_layers=1), plan=plan, data=tokens, steps=1, kernels="fused", optim=OPTIM).store.close()
    assert compiled == [head]
    err = capsys.readouterr().err
    assert f"plan {plan}: 1 of {len(res.compiled)} templates compiled for this run (stale or missing" in err, err
    assert f"`mtc.compile(model, '{plan}', batch_size=1, seq_len=8" in err, err


def test_a_result_closes_its_store_and_an_open_one_is_named_in_the_lock_error(tokens, program, tmp_path):
    """The README's two calls on one store: the second is refused while the first result holds the
    store open (the error says how to close it), and runs once it is closed (``with`` or ``close``).
    A result prints as one short line, not the whole program."""
    from mtc.errors import StoreLockedError

    store = tmp_path / "s"
    first = mtc.train(model=build, plan=program, data=tokens, store=store, steps=2, optim=OPTIM)
    line = repr(first)
    assert line.startswith("TrainResult(steps 0->2, last loss ") and str(store) in line and len(line) < 200, line
    with pytest.raises(StoreLockedError, match=r"an earlier mtc.train call: call its .close\(\)"):
        mtc.train(data=tokens, store=store, steps=4, allow_change=["steps"])
    first.close()
    with mtc.train(data=tokens, store=store, steps=4, allow_change=["steps"]) as res:
        assert (res.start_step, res.end_step) == (2, 4)
    mtc.train(data=tokens, store=store, steps=5, allow_change=["steps"]).close()  # the `with` closed it


def test_a_compiled_plan_prints_as_one_line(program, tmp_path):
    compiled = mtc.compile(build, tmp_path / "plan", batch_size=2, seq_len=16)
    line = repr(compiled)
    assert line.startswith("Compiled(") and "layers, batch 2x16" in line and len(line) < 200, line


def test_a_runs_weights_load_strictly_into_the_users_module_with_tied_names_and_buffers(tokens, tmp_path):
    class Tied(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.head.weight = self.tok.weight  # tied: named_parameters gives it once, state_dict twice
            self.register_buffer("scale", torch.tensor(0.5))  # persistent
            self.register_buffer("scratch", torch.ones(1), persistent=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * self.scale * self.scratch

    torch.manual_seed(3)
    model = Tied()
    mtc.train(model=model, data=tokens, store=tmp_path / "run", steps=2, seed=7, optim=OPTIM, **SHAPE).close()
    sd = mtc.load_state_dict(tmp_path / "run")
    assert sd.keys() == Tied().state_dict().keys() and sd["head.weight"] is sd["tok.weight"]
    again = Tied()
    again.load_state_dict(sd)  # strict
    assert again.head.weight is again.tok.weight and float(again.scale) == 0.5
    assert not torch.equal(again.tok.weight, model.tok.weight)  # trained


def test_parameter_names_with_capitals_survive_the_plan_on_disk(tokens, tmp_path):
    # fx names a placeholder for `A_log` `param_a_log`: the saved template's nodes refer to that
    # name, its inputs to the parameter's; the plan did not load back, so the run could not resume
    class CapitalBlock(Block):
        def __init__(self) -> None:
            super().__init__(16)
            self.A_log = nn.Parameter(torch.zeros(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * self.A_log.exp()

    class Capital(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.Scale = nn.Parameter(torch.ones(16))
            self.blocks = nn.ModuleList(CapitalBlock() for _ in self.blocks)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.tok(ids) * self.Scale + self.pos[: ids.shape[1]]
            for b in self.blocks:
                x = b(x)
            return self.head(self.norm(x))

    torch.manual_seed(3)
    prog = mtc.load_plan(mtc.save_plan(mtc.trace(Capital(), SHAPE["micro_batch_size"], SHAPE["seq_len"]), tmp_path / "plan"))
    assert {"Scale", "blocks.0.A_log"} <= set(prog.params)
    mtc.train(model=Capital(), data=tokens, store=tmp_path / "run", steps=2, optim=OPTIM, **SHAPE).close()
    with mtc.train(data=tokens, store=tmp_path / "run", steps=3, allow_change=["steps"]) as res:  # resumes
        assert res.start_step == 2
    again = Capital()
    again.load_state_dict(mtc.load_state_dict(tmp_path / "run"))


def test_a_layer_whose_only_weights_are_anothers_trains_resident_or_not(tokens):
    # an OLMo-1 style head: a LayerNorm without weights, then the embedding matrix (tied); as a
    # resident layer it took views of its own (empty) compute copy: "shape [64, 16] is invalid"
    class NoParamHead(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            del self.head, self.norm

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.tok(ids) + self.pos[: ids.shape[1]]
            for b in self.blocks:
                x = b(x)
            return torch.nn.functional.layer_norm(x, (16,)) @ self.tok.weight.t()

    torch.manual_seed(3)
    model = NoParamHead()
    want = weights(mtc.train(model=copy.deepcopy(model), data=tokens, steps=2, optim=OPTIM, placement="ram", **SHAPE))
    assert_close(weights(mtc.train(model=model, data=tokens, steps=2, optim=OPTIM, placement="gpu", **SHAPE)), want)


def test_a_lost_resume_file_stops_only_a_resume_not_the_readers_of_the_weights(tokens, program, tmp_path, capsys):
    from mtc.cli import main
    from mtc.errors import StoreCorruptionError

    store = tmp_path / "run"
    mtc.train(model=build, plan=program, data=tokens, store=store, steps=2, optim=OPTIM).close()
    with mtc.open_store(store, read_only=True) as st:
        gen = st.last_commit().generation
    (store / f"resume-g{gen}.json").unlink()
    sd = mtc.load_state_dict(store)  # (they said "the RNG states cannot be read ... `mtc repair` rolls back")
    assert main(["eval", str(store), "--data", str(tokens.path), "--batches", "1"]) == 0, capsys.readouterr().err
    fresh = build()
    fresh.load_state_dict(sd)
    with pytest.raises(StoreCorruptionError, match="RNG states of step 2's commit cannot be read"):
        mtc.train(data=tokens, store=store, steps=3, allow_change=["steps"])


def test_a_plan_directory_gives_the_run_its_kernel_options(tokens, program, tmp_path):
    """As `mtc train --plan`: the options the plan was compiled with (matmul_fusion) become the
    run's, so its templates load instead of recompiling as stale."""
    import json

    d = mtc.save_plan(program, tmp_path / "plan", factory=build)
    rec = json.loads((d / "model.json").read_text())
    (d / "model.json").write_text(json.dumps({**rec, "matmul_fusion": "on"}))
    with mtc.train(plan=d, data=tokens, store=tmp_path / "s", steps=1) as res:
        assert res.store.last_commit().config["matmul_fusion"] == "on"


def test_init_from_starts_a_new_run_from_another_runs_weights_as_the_cli_does(tokens, program, tmp_path):
    from mtc.store import TensorStore

    src, new = tmp_path / "src", tmp_path / "new"
    run = dict(SHAPE, kernels="unfused", device="cpu")
    mtc.train(model="tiny", model_overrides={"n_layers": 2}, data=tokens, store=src, steps=2, **run).store.close()
    # what `mtc import` leaves beside a run's weights, which --init-from carries along
    (src / "hf").mkdir()
    (src / "hf" / "generation_config.json").write_text('{"eos_token_id": 3}')
    (src / "tokenizer").mkdir()
    (src / "tokenizer" / "special_tokens_map.json").write_text("{}")
    with pytest.raises(ConfigError, match="drop model="):
        mtc.train(model=TinyLM(), init_from=src, data=tokens, store=new, steps=1, **run)
    assert not new.exists()
    # no model given: the source's (tiny, two blocks), its last weights, fresh Adam moments
    res = mtc.train(init_from=src, data=tokens, store=new, steps=1, **run)
    res.store.close()
    with TensorStore.open(new, read_only=True) as st:
        first, last = st.commit_history()[0], st.last_commit()
    assert first.step == 0 and first.meta["init"]["kind"] == "run" and first.meta["init"]["step"] == 2
    assert last.step == 1 and last.config["model"] == "tiny" and last.config["model_overrides"] == {"n_layers": 2}
    a, b = mtc.load_state_dict(src), mtc.load_state_dict(new, step=0)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    for sub in ("hf/generation_config.json", "tokenizer/special_tokens_map.json"):
        assert (new / sub).read_bytes() == (src / sub).read_bytes(), sub
    # a traced program as the plan (it loaded a Program as if it were a directory: a TypeError)
    from mtc.config import TrainConfig
    from mtc.train import build_model

    cfg = TrainConfig(model="tiny", model_overrides={"n_layers": 2}, **SHAPE)
    traced = mtc.trace(build_model(cfg, device="meta"), SHAPE["micro_batch_size"], SHAPE["seq_len"])
    mtc.train(init_from=src, plan=traced, data=tokens, store=tmp_path / "p", steps=1, **run).store.close()
    b = mtc.load_state_dict(tmp_path / "p", step=0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a run of a user's module cannot be rebuilt from its record: one line saying what to do instead
    mine = tmp_path / "mine"
    mtc.train(model=TinyLM(), plan=program, data=tokens, store=mine, steps=1, **run).store.close()
    with pytest.raises(ConfigError, match="user's model.*mtc.load_state_dict"):
        mtc.train(init_from=mine, data=tokens, store=tmp_path / "w", steps=1, **run)
    assert not (tmp_path / "w").exists()


class TableBlock(Block):
    """custom_models.Block scaled by a table the model makes once and hands to every block (as a
    rotary table often is), registered as each block's buffer."""

    def __init__(self, d: int, table: torch.Tensor, persistent: bool) -> None:
        super().__init__(d)
        self.register_buffer("table", table, persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.table


class SharedTable(TinyLM):
    """TinyLM whose blocks share one buffer tensor; ``repeat``: one block module listed twice (ALBERT)."""

    def __init__(self, persistent: bool = False, repeat: bool = False) -> None:
        super().__init__()
        table = torch.linspace(0.5, 1.5, 16)
        blocks = [TableBlock(16, table, persistent) for _ in range(2)]
        self.blocks = nn.ModuleList([blocks[0]] * 2 if repeat else blocks)


@pytest.mark.parametrize("persistent", [False, True])
def test_blocks_sharing_one_buffer_tensor_train_into_a_store(tokens, tmp_path, persistent):
    # The plan's constants went to safetensors as they were, and it refuses tensors that share
    # memory: training such a model into a store (or saving its plan) failed with safetensors'
    # 'Some tensors share memory' before the first step.
    torch.manual_seed(3)
    model = SharedTable(persistent)
    mtc.train(model=model, data=tokens, store=tmp_path / "run", steps=2, seed=7, optim=OPTIM, **SHAPE).close()
    consts = mtc.load_plan(tmp_path / "run" / "plan").constant_values
    assert {k for k in consts if k.endswith("table")} == {"blocks.0.table", "blocks.1.table"}
    assert all(torch.equal(consts[f"blocks.{i}.table"], model.blocks[i].table) for i in range(2))
    assert not torch.equal(mtc.load_state_dict(tmp_path / "run")["tok.weight"], model.tok.weight)  # trained


@pytest.mark.parametrize("repeat", [False, True], ids=["one-tensor-in-each-block", "one-block-listed-twice"])
def test_a_buffer_under_several_names_loads_strictly_and_a_repeated_block_trains_like_torch(tokens, tmp_path, repeat):
    # state_dict names a persistent buffer once per module that holds it; load_state_dict gave it
    # under the first name only (named_buffers drops repeats), so the strict load of such a run's
    # weights failed with 'Missing key(s): blocks.1.table'. A block listed twice shares its
    # parameters across both layers: their gradients add up, as in torch.
    torch.manual_seed(3)
    model = SharedTable(persistent=True, repeat=repeat)
    steps = 3
    res = mtc.train(model=model, data=tokens, store=tmp_path / "run", steps=steps, seed=7, optim=OPTIM, **SHAPE)
    res.close()
    sd = mtc.load_state_dict(tmp_path / "run")
    assert sd.keys() == model.state_dict().keys()
    again = SharedTable(persistent=True, repeat=repeat)
    again.load_state_dict(sd)  # strict
    decay = {k for k, p in model.named_parameters() if p.ndim >= 2}
    ref = torch_reference(model, batches(tokens, steps, seed=7), [lr_at(s, steps, OptimConfig(**OPTIM)) for s in range(steps)], decay)
    assert_close(dict(again.named_parameters()), ref)


def test_a_learned_scalar_in_the_head_trains_like_torch(tokens):
    # The planner's model shape took every head parameter's dim 0 for the vocabulary width, and a
    # 0-dim parameter (a learned logit scale or temperature) has none: mtc.train failed with an
    # IndexError from costmodel.shape_from_program before the first step.
    class ScaledLogits(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.logit_scale = nn.Parameter(torch.tensor(0.7))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * self.logit_scale

    torch.manual_seed(3)
    model = ScaledLogits()
    steps = 3
    res = mtc.train(model=model, data=tokens, steps=steps, seed=7, optim=OPTIM, **SHAPE)
    decay = {k for k, p in model.named_parameters() if p.ndim >= 2}
    ref = torch_reference(model, batches(tokens, steps, seed=7), [lr_at(s, steps, OptimConfig(**OPTIM)) for s in range(steps)], decay)
    got = weights(res)
    assert not torch.equal(got["logit_scale"], model.logit_scale.detach())  # it trained
    assert_close(got, ref)
