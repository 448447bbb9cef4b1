"""A user's model on the command line: `mtc compile --model`, `mtc train --plan` of a plan saved
from Python, `mtc train --model`, resuming with changes, and one-line errors for bad import paths."""

from __future__ import annotations

import json

import pytest
import torch
from mtc.store import TensorStore

import mtc
from mtc.cli import main
from mtc.runtime.state import read_params
from tests.mtc.custom_models import TinyLM, build
from tests.runtime.engine_util import skewed_tokens

FACTORY = "tests.mtc.custom_models:build"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "t.bin")


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("path, says", [
    ("nosuch.mod:f", "cannot import module 'nosuch.mod'"),
    ("tests.mtc.custom_models:nothere", "has no attribute 'nothere'; it defines: Block, GradPoisonedLM, PoisonedLM, TinyLM, broken, build, "
                                          "poisoned"),
    ("tests.mtc.custom_models:broken", "raised RuntimeError: weights file missing"),
    ("tests.mtc.custom_models:NOT_CALLABLE", "NOT_CALLABLE is not callable"),
    ("tests/mtc:x", "neither a preset nor an import path"),
])
def test_bad_import_paths_are_one_line(tmp_path, capsys, path, says):
    code, _, err = _run(capsys, "compile", "--model", path, "-o", tmp_path / "p")
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p").exists()


@pytest.mark.slow
def test_compile_by_import_path_then_train_and_extend_the_plan(tmp_path, tokens, capsys):
    plan, store = tmp_path / "plan", tmp_path / "s"
    code, out, err = _run(capsys, "compile", "--model", FACTORY, "-o", plan, "--seq-len", 16, "--micro-batch-size", 2)
    assert code == 0 and "block-" in out and "fwd kernels" in out, err
    rec = json.loads((plan / "model.json").read_text())
    assert rec["factory"] == FACTORY and rec["model"] == FACTORY and rec["seq_len"] == 16
    common = ["train", "--plan", plan, "--store", store, "--data", tokens.path, "--unfused"]
    assert _run(capsys, *common, "--steps", 2)[0] == 0
    # the factory made the initial weights, seeded like a preset: the same as the Python API's run
    with TensorStore.open(store, read_only=True) as st:
        assert st.last_commit().config["model"] == FACTORY
    code, _, err = _run(capsys, *common, "--steps", 3)
    assert code == 2 and "differs in: steps 2 -> 3" in err and "--allow-change steps" in err
    assert _run(capsys, *common, "--steps", 3, "--allow-change", "steps")[0] == 0
    code, out, _ = _run(capsys, "inspect", store)
    assert code == 0 and "changed from step 2: steps 2 -> 3" in out and f"model {FACTORY}" in out


def test_a_plan_saved_from_python_trains_from_the_cli(tmp_path, tokens, capsys):
    torch.manual_seed(2)
    model = TinyLM()
    program = mtc.trace(model, 2, 16)
    bare, store = tmp_path / "bare", tmp_path / "s"
    mtc.save_plan(program, bare)
    common = ["--store", store, "--data", tokens.path, "--unfused"]
    # no factory recorded: nothing can make the initial weights, said in one line before any store exists
    code, _, err = _run(capsys, "train", "--plan", bare, *common, "--steps", 2)
    assert code == 2 and "factory" in err and len(err.strip().splitlines()) == 1 and not store.exists(), err
    # start it from Python with the model's own weights, resume it from the CLI with the same plan
    res = mtc.train(model=model, plan=bare, data=tokens, store=store, steps=2)
    res.store.close()
    assert _run(capsys, "train", "--plan", bare, *common, "--steps", 4, "--allow-change", "steps")[0] == 0
    # another model's plan is refused on resume
    other = mtc.save_plan(mtc.trace(TinyLM(n_layers=3), 2, 16), tmp_path / "other")
    code, _, err = _run(capsys, "train", "--plan", other, *common, "--steps", 4)
    assert code == 2 and "is not the plan store" in err, err
    # with a factory recorded, the same plan starts new runs from the CLI
    withf = mtc.save_plan(program, tmp_path / "withf", factory=build)
    assert _run(capsys, "train", "--plan", withf, "--store", tmp_path / "s2", "--data", tokens.path, "--unfused",
                "--steps", 1)[0] == 0
    with pytest.raises(mtc.MTCError, match="no import path"):
        mtc.save_plan(program, tmp_path / "x", factory=lambda: TinyLM())


def test_train_model_by_import_path_matches_the_python_api(tmp_path, tokens, capsys):
    args = ["--data", tokens.path, "--steps", 2, "--micro-batch-size", 2, "--seq-len", 16, "--unfused"]
    assert _run(capsys, "train", "--model", FACTORY, "--store", tmp_path / "cli", *args)[0] == 0
    res = mtc.train(model=build, data=tokens, store=tmp_path / "py", steps=2, micro_batch_size=2, seq_len=16)
    res.store.close()
    got = []
    for s in ("cli", "py"):
        with TensorStore.open(tmp_path / s, read_only=True) as st:
            got.append(read_params(res.program, st, st.last_commit().generation))
    for k in got[1]:
        assert torch.equal(got[0][k], got[1][k]), k


def test_a_factory_whose_code_changed_is_refused_before_training_its_old_plan(tmp_path, tokens, capsys, monkeypatch):
    """Same parameter names and shapes, other computation: the plan's old graph would train."""
    import sys
    import textwrap

    mod = tmp_path / "mine_models.py"
    src = textwrap.dedent("""
        import torch.nn.functional as F
        from tests.mtc import custom_models

        class Block(custom_models.Block):
            def forward(self, x):
                q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
                att = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=True)
                x = x + self.proj(att.squeeze(1))
                return x + self.down(F.ACT(self.up(self.norm2(x))))

        def build():
            m = custom_models.TinyLM()
            m.blocks = type(m.blocks)(Block(16) for _ in range(2))
            return m
    """)
    mod.write_text(src.replace("ACT", "gelu"))
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = mtc.save_plan(mtc.trace(sys.modules.setdefault("mine_models", __import__("mine_models")).build(), 2, 16),
                         tmp_path / "plan", factory="mine_models:build")
    common = ["train", "--plan", plan, "--data", tokens.path, "--unfused", "--steps", 1]
    assert _run(capsys, *common, "--store", tmp_path / "a")[0] == 0
    mod.write_text(src.replace("ACT", "relu"))
    sys.modules.pop("mine_models")
    code, _, err = _run(capsys, *common, "--store", tmp_path / "b")
    assert code == 2 and "factory mine_models:build now builds another model than" in err and "mtc compile --model" in err, err
    assert not (tmp_path / "b").exists()


def test_train_plan_flags_that_differ_from_the_plan_are_refused_with_the_whole_recompile_command(tmp_path, tokens, capsys):
    plan = mtc.save_plan(mtc.trace(TinyLM(), 2, 16), tmp_path / "plan", factory=build)
    common = ["train", "--plan", plan, "--store", tmp_path / "s", "--data", tokens.path, "--unfused", "--steps", 1,
              "--device", "cpu"]
    code, _, err = _run(capsys, *common, "--seq-len", 8)
    assert code == 2 and f"recompile with `mtc compile --model {FACTORY} --micro-batch-size 2 --seq-len 8 --dtype " \
        f"float32 -o {plan}`" in err, err
    assert _run(capsys, *common, "--compute-dtype", "auto")[0] == 0  # auto is float32 on the CPU: the plan's dtype


def test_a_plan_whose_program_and_model_record_disagree_is_refused_before_a_store_exists(tmp_path, tokens, capsys):
    import shutil

    a = mtc.save_plan(mtc.trace(TinyLM(), 2, 16), tmp_path / "a", factory=build)
    b = mtc.save_plan(mtc.trace(TinyLM(n_layers=3), 2, 16), tmp_path / "b", factory=build)
    shutil.copy(b / "program.json", a / "program.json")  # as read while a compile rewrites the directory
    code, _, err = _run(capsys, "train", "--plan", a, "--store", tmp_path / "s", "--data", tokens.path, "--unfused",
                        "--steps", 1)
    assert code == 2 and "its program.json is not the program its model.json was written for" in err, err
    assert not (tmp_path / "s").exists()


def test_plan_of_a_plan_saved_from_python_with_or_without_a_factory(tmp_path, capsys):
    """`mtc plan DIR` reads the plan as `mtc train --plan` does (its model.json records a factory,
    or none), and refuses the shape flags train would refuse, in one line."""
    program = mtc.trace(TinyLM(), 2, 16)
    for name, factory in (("with", build), ("without", None)):
        plan = mtc.save_plan(program, tmp_path / name, factory=factory)
        code, out, err = _run(capsys, "plan", plan, "--machine", "256gb-4tb-nvme", "--no-extrapolate")
        assert code == 0 and "2 x 16 tokens" in out and "compute float32" in out, err
    code, _, err = _run(capsys, "plan", tmp_path / "with", "--machine", "256gb-4tb-nvme", "--seq-len", 32)
    assert code == 2 and "was compiled for seq_len=16, not 32; drop --seq-len" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _run(capsys, "plan", tmp_path / "with", "--machine", "256gb-4tb-nvme", "--compute-dtype", "auto")
    assert code == 2 and "compute_dtype=float32, not auto" in err, err  # auto is bf16 on that GPU machine
    assert _run(capsys, "plan", tmp_path / "with", "--machine", "256gb-4tb-nvme", "--seq-len", 16, "--grad-accum", 4,
                "--no-extrapolate")[0] == 0


def test_generate_on_a_users_model_says_to_load_the_weights_into_it(tmp_path, tokens, capsys):
    torch.manual_seed(2)
    model, store = TinyLM(), tmp_path / "s"
    res = mtc.train(model=model, data=tokens, store=store, steps=1, micro_batch_size=2, seq_len=16, kernels="unfused")
    res.store.close()
    code, _, err = _run(capsys, "generate", store, "--prompt", "ab", "--max-new-tokens", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot rebuild" in err and "mtc.load_state_dict" in err, err
    # what it says to do works: the run's weights in the user's module, sampled with it
    from mtc.generate import generate

    fresh = TinyLM()
    fresh.load_state_dict(mtc.load_state_dict(store))
    assert len(generate(fresh, [97, 98], max_new_tokens=2, context=16, temperature=0)) == 2
