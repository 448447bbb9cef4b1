"""CLI behaviour, config files and the LR schedule."""

from __future__ import annotations

import itertools
import json
import math
import shutil

import pytest

from mtc.cli import _plan_on_cpu_note, main
from mtc.config import OptimConfig, TrainConfig, load_config
from mtc.errors import ConfigError
from mtc.runtime.schedule import lr_at


def test_schedule_warmup_then_cosine():
    # transformers' convention (tests/mtc/test_schedule.py compares with transformers itself)
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    assert [lr_at(s, 20, cfg) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert lr_at(20, 20, cfg) == pytest.approx(0.1)  # min_lr is reached one past the last step
    assert lr_at(19, 20, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 15 / 16)))
    vals = [lr_at(s, 20, cfg) for s in range(4, 21)]
    assert all(a > b for a, b in itertools.pairwise(vals)), "cosine decay must fall"


def test_config_files(tmp_path):
    cfg = TrainConfig(steps=7, optim=OptimConfig(lr=1e-3, min_lr=1e-4))
    (tmp_path / "a.json").write_text(json.dumps(cfg.to_dict()))
    assert load_config(tmp_path / "a.json") == cfg
    (tmp_path / "b.toml").write_text('model = "tiny"\nsteps = 3\n[optim]\nlr = 0.01\nmin_lr = 0.001\n')
    t = load_config(tmp_path / "b.toml")
    assert t.steps == 3 and t.optim.lr == 0.01
    (tmp_path / "c.json").write_text(json.dumps({"stpes": 3}))
    with pytest.raises(ConfigError, match="stpes"):
        load_config(tmp_path / "c.json")
    with pytest.raises(ConfigError, match="grad_accum"):
        TrainConfig(grad_accum=0).validate()


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtc: error:") and err.count("\n") == 1
    assert main(["train", "--preset", "nosuch", "--store", str(tmp_path / "s"), "--data", "x.bin"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset" in err and "your own model: its factory's import path, package.module:function (e.g. nosuch:build)" in err
    for cmd in ("compile", "trace"):  # nothing printed before the refusal
        assert main([cmd, "nosuch", "-o", str(tmp_path / "p")]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1 and "unknown preset" in out.err, out


def test_cli_demo_refuses_bad_arguments_before_writing_anything(tmp_path, capsys):
    # --dir FILE raised FileExistsError; --steps 0 was refused only after the corpus was written
    from mtc.demo import run_demo

    (tmp_path / "afile").write_text("x")
    for args, says in (
        (["--steps", "0", "--dir", str(tmp_path / "d")], "--steps: expected a number of steps >= 1, got 0"),
        (["--dir", str(tmp_path / "afile")], f"--dir {tmp_path / 'afile'}: it is a file, not a directory; give a directory"),
        (["--dir", str(tmp_path / "afile" / "d")], f"--dir {tmp_path / 'afile' / 'd'}: {tmp_path / 'afile'}, a parent of it, "
         "is a file, not a directory"),
    ):
        assert main(["demo", *args]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.startswith(f"mtc: error: {says}") and out.err.count("\n") == 1, out
    with pytest.raises(ConfigError, match="--steps: expected a number of steps >= 1, got -1"):
        run_demo(tmp_path / "d", steps=-1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_text() == "x"


def test_cli_trace_meta_preset(tmp_path, capsys):
    # 8B: 32 GB of fp32 weights, more than this machine's RAM, traced on meta (70B's 80 blocks took 20 s here)
    assert main(["trace", "8b", "-o", str(tmp_path / "plan"), "--meta", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "32 blocks" in out and (tmp_path / "plan" / "program.json").is_file()


def test_cli_train_refuses_bad_data_and_changed_config(tmp_path, capsys):
    import numpy as np

    from mtc.data import write_token_file

    assert main(["train", "--preset", "tiny", "--store", str(tmp_path / "s"), "--data", str(tmp_path / "no.bin")]) == 2
    assert "not found" in capsys.readouterr().err
    assert not (tmp_path / "s").exists(), "a bad data path must not leave a store behind"
    tok = write_token_file(tmp_path / "t.bin", np.arange(3000, dtype=np.uint16) % 256, vocab_size=256, tokenizer="byte")
    common = ["train", "--preset", "tiny", "--store", str(tmp_path / "s"), "--data", str(tok.path),
              "--micro-batch-size", "2", "--seq-len", "16"]
    assert main([*common, "--steps", "2"]) == 0
    head = capsys.readouterr().out.splitlines()[0]  # the run's log says its device and durability
    assert head.endswith("device cpu, durability full (exact resume from the last commit, commits paced to the disk (commit_every 0))"), head
    assert main([*common, "--steps", "3"]) == 2
    assert "differs in: steps" in capsys.readouterr().err
    assert main([*common, "--steps", "2"]) == 0  # same config: already done, nothing to do
    assert "already at step 2" in capsys.readouterr().out
    # a --stop-after the store is past: nothing to do, no state loaded, no log rewritten
    logs = sorted((tmp_path / "s" / "logs").iterdir())
    assert main([*common, "--steps", "4", "--allow-change", "steps", "--stop-after", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"store {tmp_path / 's'} is already at step 2, at or past --stop-after 1; nothing to do"
    assert sorted((tmp_path / "s" / "logs").iterdir()) == logs
    # 'auto' on the CPU is float32: naming it is the same run
    assert main([*common, "--steps", "2", "--compute-dtype", "float32"]) == 0
    assert "already at step 2" in capsys.readouterr().out
    # extending the run re-plans the schedule: the jump is said, with both curves' values
    from mtc.config import OptimConfig
    from mtc.runtime.schedule import lr_at

    other = [*common[:4], str(tmp_path / "s2"), *common[5:], "--warmup-steps", "1"]
    assert main([*other, "--steps", "3"]) == 0
    capsys.readouterr()
    assert main([*other, "--steps", "20", "--allow-change", "steps", "--stop-after", "4"]) == 0
    o = OptimConfig(warmup_steps=1)
    assert lr_at(3, 3, o) != lr_at(3, 20, o)
    assert f"note: the schedule follows the changed steps from step 3: the learning rate goes from {lr_at(3, 3, o):.4g} " \
           f"(the old curve's) to {lr_at(3, 20, o):.4g}" in capsys.readouterr().err
    # a new seed draws other validation batches: said when the run logs val_loss
    assert main([*other, "--steps", "20", "--allow-change", "steps,seed", "--seed", "9", "--eval-every", "1",
                 "--eval-batches", "1", "--stop-after", "5"]) == 0
    assert "note: the validation batches are drawn with the seed too: val_loss from step 4 on" in capsys.readouterr().err


def test_cli_compile_reports_and_caches(tmp_path, capsys):
    assert main(["compile", "tiny", "-o", str(tmp_path / "plan"), "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    # --dtype auto resolves as `mtc train` would here: no CUDA, float32
    assert "compute dtype float32 (--dtype auto: no CUDA here)" in out
    assert json.loads((tmp_path / "plan" / "model.json").read_text())["compute_dtype"] == "float32"
    rep = json.loads((tmp_path / "plan" / "compile_report.json").read_text())
    block = next(v for k, v in rep.items() if k.startswith("block"))
    assert block["calls"] == 4
    assert block["forward"]["kernels"] < block["forward"]["aten_ops"]
    assert block["backward"]["kernels"] < block["backward"]["aten_ops"]
    assert "fwd kernels" in out and "block-" in out
    # what a block keeping its activations runs, and the column kernels' second stages, are reported too
    assert block["split"]["save"]["kernels"] > 0 and block["split"]["backward_saved"]["kernels"] > 0
    assert block["second_stage_launches"]["backward"] >= 1
    assert (f"keeping its activations: forward-and-save {block['split']['save']['kernels']} kernels, backward from the "
            f"saved values {block['split']['backward_saved']['kernels']} kernels") in out
    # one line of totals, also in the report: compile and tuning seconds, templates compiled / loaded
    assert rep["plan"]["compiled"] == 3 and rep["plan"]["loaded"] == 0 and rep["plan"]["compile_s"] >= block["compile_s"] > 0
    assert block["loaded"] is False and block["tuning_s"] >= 0 and set(block["tuning"]) == {"attention", "generated", "matmul_fusion"}
    assert f"compiled plan: 3 templates (3 compiled, 0 loaded) in {rep['plan']['compile_s']:.2f} s, tuning " in out
    kdir = next(p for p in (tmp_path / "plan" / "kernels").iterdir() if p.name != "compiled")
    files = {p.name: p.stat().st_mtime_ns for p in kdir.glob("*.py")}
    assert files
    assert main(["compile", "tiny", "-o", str(tmp_path / "plan"), "--seq-len", "16"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in kdir.glob("*.py")} == files, "cached kernels must not be rewritten"
    assert "compiled plan: 3 templates (0 compiled, 3 loaded) in " in capsys.readouterr().out


def test_cli_train_runs_a_compiled_plan(tmp_path, capsys, monkeypatch):
    """compile, then train that plan: its program and compiled templates are loaded, nothing is
    compiled or generated again."""
    import numpy as np

    from mtc import compiler
    from mtc.data import write_token_file

    plan = tmp_path / "plan"
    assert main(["compile", "tiny", "-o", str(plan), "--seq-len", "16", "--micro-batch-size", "2", "--matmul-fusion", "off"]) == 0
    rec = json.loads((plan / "model.json").read_text())
    assert rec["seq_len"] == 16 and rec["matmul_fusion"] == "off"
    tok = write_token_file(tmp_path / "t.bin", np.arange(3000, dtype=np.uint16) % 256, vocab_size=256, tokenizer="byte")
    common = ["train", "--plan", str(plan), "--store", str(tmp_path / "s"), "--data", str(tok.path), "--steps", "2"]
    assert main([*common, "--seq-len", "32"]) == 2
    assert "compiled for seq_len=16" in capsys.readouterr().err
    # on the CPU with --kernels auto the plan's kernels go unused: said, not silently, and truly of
    # this plan (compiled here, on the CPU: it said they were for CUDA)
    assert main(["train", "--plan", str(plan), "--store", str(tmp_path / "s0"), "--data", str(tok.path), "--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "generated kernels were compiled on the CPU, for Triton's interpreter: on the CPU this run uses the unfused " \
           "(ATen) templates" in err and "CUDA" not in err, err
    other = tmp_path / "other"
    shutil.copytree(plan, other)
    report = json.loads((other / "compile_report.json").read_text())
    (other / "compile_report.json").write_text(json.dumps({**report, "cache_key": "torch2.9.0_cu128-triton3.6.0-sm90"}))
    assert "generated kernels were compiled for CUDA (sm90): on the CPU this run uses the unfused" in _plan_on_cpu_note(str(other))
    shutil.rmtree(other / "kernels")
    (other / "compile_report.json").unlink()
    assert f"plan {other} holds no generated kernels: on the CPU" in _plan_on_cpu_note(str(other))
    # kernel options are part of the plan: train takes the plan's (no recompile below), another is refused
    assert main([*common, "--matmul-fusion", "on"]) == 2
    assert "compiled for matmul_fusion=off" in capsys.readouterr().err
    kdir = next(p for p in (plan / "kernels").iterdir() if p.name != "compiled")
    made = {p.name for p in kdir.glob("*.py")}
    compiled: list[str] = []
    monkeypatch.setattr(compiler, "compile_template", lambda t, *a, **k: compiled.append(t.id))
    assert main([*common, "--kernels", "fused"]) == 0
    out = capsys.readouterr()
    assert "loss" in out.out and "recompiling" not in out.err
    assert "compiled plan: 3 templates (0 compiled, 3 loaded) in " in out.out
    assert "tuning 0.00 s" in out.out and "attention timed during the run 0.00 s" in out.out
    assert compiled == [], "train --plan compiled templates that `mtc compile` wrote"
    copied = tmp_path / "s" / "plan" / "kernels" / kdir.name
    assert {p.name for p in copied.glob("*.py")} == made, "training a compiled plan must reuse its kernels"
    assert json.loads((tmp_path / "s" / "plan" / "program.json").read_text()) == json.loads((plan / "program.json").read_text())
    assert main(["train", "--plan", str(tmp_path / "nowhere"), "--store", str(tmp_path / "s2"), "--data", str(tok.path)]) == 2
    assert "not a plan directory" in capsys.readouterr().err


def test_a_traced_plan_can_be_planned_and_trained(tmp_path, capsys):
    """`mtc trace` records the preset, shapes and dtype beside the program, as `mtc compile` does,
    so `mtc plan DIR` and `mtc train --plan DIR` take it (a preset: they build its weights)."""
    import numpy as np

    from mtc.data import write_token_file

    plan = tmp_path / "plan"
    assert main(["trace", "tiny", "-o", str(plan), "--seq-len", "16", "--micro-batch-size", "2"]) == 0
    rec = json.loads((plan / "model.json").read_text())
    assert (rec["model"], rec["seq_len"], rec["micro_batch_size"], rec["compute_dtype"]) == ("tiny", 16, 2, "float32")
    assert main(["plan", str(plan), "--machine", "h100-box", "--no-extrapolate"]) == 0
    assert main(["trace", "tiny", "-o", str(tmp_path / "bf16"), "--seq-len", "16", "--micro-batch-size", "2", "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "bf16" / "model.json").read_text())["compute_dtype"] == "bfloat16"
    tok = write_token_file(tmp_path / "t.bin", np.arange(3000, dtype=np.uint16) % 256, vocab_size=256, tokenizer="byte")
    capsys.readouterr()
    assert main(["train", "--plan", str(plan), "--store", str(tmp_path / "s"), "--data", str(tok.path), "--steps", "1"]) == 0, \
        capsys.readouterr().err


def test_plan_without_a_machine_measures_this_one_once_and_says_so(tmp_path, capsys, monkeypatch):
    import mtc.calibrate

    path = tmp_path / "machine.json"
    monkeypatch.setattr(mtc.calibrate, "DEFAULT_PROFILE_PATH", path)
    measured = []
    monkeypatch.setattr(mtc.calibrate, "calibrate", lambda **k: measured.append(1) or mtc.calibrate.builtin("h100-box"))
    assert main(["plan", "tiny", "--no-extrapolate"]) == 0
    err = capsys.readouterr().err
    assert "no machine profile saved yet: measuring this machine" in err and f"profile saved to {path}" in err
    assert main(["plan", "tiny", "--no-extrapolate"]) == 0  # the saved profile, not a second measurement
    assert measured == [1] and "measuring" not in capsys.readouterr().err
    assert main(["plan", "nosuch"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_version_names_mtc_and_what_it_runs_on(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("mtc ") and "torch " in out and "triton " in out and "zarr " in out, out


def test_the_durability_line_says_how_often_a_run_commits():
    from mtc.cli import _durability_text
    from mtc.config import TrainConfig

    assert _durability_text(TrainConfig(commit_every=5)) == "durability full (exact resume from the last commit, a commit every 5 steps)"
    assert _durability_text(TrainConfig(durability="none")) == "durability none (nothing committed: no resume)"
    # disk layers write their state every step, so such a run commits every step whatever commit_every says
    assert _durability_text(TrainConfig(placement="ram:0-1,disk:2-3", durability="weights", commit_every=5)).endswith(
        "a resume restarts Adam's moments, a commit every step (layers' state on disk))")
    # `auto` says what the planner decides: a RAM budget too small for every layer puts some on disk
    from mtc.tracer import trace
    from mtc.train import build_model

    small = TrainConfig(model="tiny", model_overrides={"n_layers": 14}, micro_batch_size=2, seq_len=16, commit_every=5)
    program = trace(build_model(small, device="meta"), 2, 16)
    assert _durability_text(small, program).endswith("a commit every 5 steps)")
    small.ram_budget_gb = 0.03
    assert _durability_text(small, program).endswith("a commit every step (layers' state on disk))")


def test_a_resume_that_names_no_model_takes_the_whole_committed_config(tmp_path, capsys):
    """`mtc train --store RUN --data X` resumes with the run's own settings, as mtc.train(store=...)
    does (it took the model from the store and the defaults for the rest, so a run made with
    another shape or lr was refused as changed), and a flag still changes what --allow-change lets."""
    import numpy as np

    from mtc.data import write_token_file
    from mtc.store import TensorStore

    tok = write_token_file(tmp_path / "t.bin", np.arange(4000, dtype=np.uint16) % 256, vocab_size=256, tokenizer="byte")
    run = ["--store", str(tmp_path / "s"), "--data", str(tok.path), "--device", "cpu"]
    assert main(["train", "--preset", "tiny", *run, "--micro-batch-size", "2", "--seq-len", "32", "--lr", "1e-3",
                 "--steps", "3", "--stop-after", "1", "--durability", "weights"]) == 0
    capsys.readouterr()
    assert main(["train", *run]) == 0, capsys.readouterr().err
    with TensorStore.open(tmp_path / "s", read_only=True) as st:
        last = st.last_commit()
        assert last.step == 3 and (last.config["micro_batch_size"], last.config["seq_len"]) == (2, 32)
        assert (last.config["optim"]["lr"], last.durability) == (1e-3, "weights")
    capsys.readouterr()
    assert main(["train", *run, "--steps", "4"]) == 2  # a changed field is still a change
    assert "steps 3 -> 4" in capsys.readouterr().err
    assert main(["train", *run, "--steps", "4", "--allow-change", "steps"]) == 0
