"""`mtc inspect`, `mtc verify` and `mtc repair` on healthy, held and damaged stores."""

from __future__ import annotations

import shutil

import pytest
from mtc.store import TensorStore, state_array_name

from mtc.cli import main
from tests.store.runs import make_run


@pytest.fixture
def store_dir(tmp_path):
    make_run(tmp_path / "s").close()
    return tmp_path / "s"


def _run(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main(list(argv))
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    return code, text.splitlines()


def test_healthy_store(store_dir, capsys):
    code, lines = _run(capsys, "inspect", str(store_dir), "--arrays")
    assert code == 0 and len(lines) == 12 + 2
    assert lines[-1].startswith("last commit: step 1 of 9, generation 1, durability full")
    code, lines = _run(capsys, "verify", str(store_dir))
    assert code == 0 and lines[-1] == "healthy" and "checked 6 arrays, 15 chunks" in lines[0]
    code, lines = _run(capsys, "inspect", str(store_dir), "--verify")
    assert code == 0 and lines[-1] == "healthy"


def test_inspect_and_verify_beside_a_run_that_holds_the_store(store_dir, capsys):
    with TensorStore.open(store_dir):  # the training run
        assert _run(capsys, "inspect", str(store_dir))[0] == 0
        assert _run(capsys, "verify", str(store_dir))[0] == 0
        code, lines = _run(capsys, "repair", str(store_dir))  # repair writes: it needs the lock
        assert code == 2 and lines[0].startswith("mtc: error:") and "locked" in lines[0]


def test_inspect_prints_one_line_per_problem(store_dir, capsys):
    (store_dir / "layers/0000/v/g1/zarr.json").write_text("{garbled")
    shutil.rmtree(store_dir / "layers/0002/m/g1")
    (store_dir / "commit.json").write_text('{"step": 1,')
    code, lines = _run(capsys, "inspect", str(store_dir))
    assert code == 1
    damaged = [line for line in lines if line.startswith("damaged: ")]
    assert len(damaged) == 3
    assert any("commit.json" in line and "does not parse" in line for line in damaged)
    assert any("array layers/0000/v/g1:" in line and "does not parse" in line for line in damaged)
    assert any("array layers/0002/m/g1: is missing" in line for line in damaged)
    assert not any(line.startswith("last commit") for line in lines)


def test_inspect_names_the_fix_for_the_damage_it_found(store_dir, capsys):
    # a missing array of the committed generation: repair rolls back, it does not "restore commit.json"
    shutil.rmtree(store_dir / "layers/0002/m/g1")
    code, lines = _run(capsys, "inspect", str(store_dir))
    assert code == 1 and "rolls back to the newest earlier commit" in lines[-1] and "restores commit.json" not in lines[-1], lines
    # a lost commit.json alone: repair restores it
    make_run(store_dir.parent / "t").close()
    (store_dir.parent / "t" / "commit.json").unlink()
    code, lines = _run(capsys, "inspect", str(store_dir.parent / "t"))
    assert code == 1 and "restores commit.json from commits.jsonl" in lines[-1] and "rolls back" not in lines[-1], lines


def test_damaged_chunk_shows_with_verify_only(store_dir, capsys):
    with TensorStore.open(store_dir, read_only=True) as st:
        chunk = st.chunk_path(state_array_name(0, "master", 1), 2)
    chunk.write_bytes(chunk.read_bytes()[:-3])
    assert _run(capsys, "inspect", str(store_dir))[0] == 0  # metadata and commit only: fast
    for argv in (["inspect", str(store_dir), "--verify"], ["verify", str(store_dir)]):
        code, lines = _run(capsys, *argv)
        assert code == 1
        assert any(line.startswith("damaged: array layers/0000/master/g1 chunk 2: ") for line in lines), lines
        assert "restore the store from a copy" in lines[-1]


def test_repair_a_deleted_commit_json(store_dir, capsys):
    (store_dir / "commit.json").unlink()
    code, lines = _run(capsys, "verify", str(store_dir))
    assert code == 1 and any("commit.json" in line and "is missing" in line for line in lines)
    code, lines = _run(capsys, "repair", str(store_dir))
    assert code == 0 and lines == ["commit.json was missing: restored it from commits.jsonl line 2: step 1, generation 1, durability full"]
    assert _run(capsys, "verify", str(store_dir))[0] == 0
    code, lines = _run(capsys, "repair", str(store_dir))
    assert code == 0 and lines == ["commit.json is intact (step 1); nothing to repair"]


def test_repair_refuses_when_no_record_verifies(store_dir, capsys):
    (store_dir / "commit.json").unlink()
    (store_dir / "commits.jsonl").write_text("")
    code, lines = _run(capsys, "repair", str(store_dir))
    assert code == 2 and len(lines) == 1 and "cannot repair store" in lines[0] and "restore the store from a copy" in lines[0]


def test_uncommitted_store_says_to_rerun_train(tmp_path, capsys):
    TensorStore.create(tmp_path / "u").close()
    for cmd in ("inspect", "verify"):
        code, lines = _run(capsys, cmd, str(tmp_path / "u"))
        assert code == 2 and len(lines) == 1 and "has no commit yet" in lines[0] and "mtc train" in lines[0]


def test_a_finished_durability_none_run_is_not_called_a_stopped_set_up(tmp_path, capsys):
    from mtc.train import train
    from tests.runtime.engine_util import skewed_tokens, small_config

    res = train(small_config(steps=2, grad_accum=1, durability="none"), tmp_path / "n", skewed_tokens(tmp_path / "t.bin"))
    res.store.close()
    for cmd in ("inspect", "verify"):
        code, lines = _run(capsys, cmd, str(tmp_path / "n"))
        assert code == 2 and len(lines) == 1 and "durability 'none', which commits nothing" in lines[0], lines
        assert "stopped during set-up" not in lines[0]


def test_train_into_a_store_path_under_a_file_names_that_file(tmp_path, capsys):
    # once "I/O error (Not a directory); check the disk (dmesg)"
    from tests.runtime.engine_util import skewed_tokens

    data = skewed_tokens(tmp_path / "t.bin").path
    (tmp_path / "afile").write_text("x")
    code, lines = _run(capsys, "train", "--preset", "tiny", "--device", "cpu", "--store", str(tmp_path / "afile" / "sub"),
                       "--data", str(data), "--steps", "1", "--seq-len", "16", "--micro-batch-size", "2")
    err = [ln for ln in lines if ln.startswith("mtc: error: ")]
    assert code == 2 and len(err) == 1, lines
    assert f"{tmp_path / 'afile'}, a parent of {tmp_path / 'afile' / 'sub'}, is a file, not a directory; " \
           f"move {tmp_path / 'afile'} away" in err[0] and "dmesg" not in err[0], err
    assert (tmp_path / "afile").read_text() == "x"


def test_verify_checks_the_runs_plan_and_says_how_to_write_it_again(tmp_path, capsys):
    # eval, generate, export and a resume read STORE/plan: with its program.json gone verify said
    # "healthy" and repair "nothing to repair"
    import json

    from tests.runtime.engine_util import skewed_tokens, small_config

    data = skewed_tokens(tmp_path / "d.bin").path
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(small_config(steps=1, grad_accum=1, model_overrides={}, device="cpu").to_dict()))
    store = tmp_path / "s"
    assert main(["train", "--config", str(cfg), "--store", str(store), "--data", str(data)]) == 0
    capsys.readouterr()
    (store / "plan" / "program.json").unlink()
    code, lines = _run(capsys, "verify", str(store))
    text = "\n".join(lines)
    assert code == 1 and "the state is whole" in text and "healthy" not in text and "damaged: plan: " in text, text
    cmd = next(ln for ln in text.splitlines() if ln.startswith("the weights are intact")).split("`")[1].split()
    assert cmd[:3] == ["mtc", "trace", "tiny"] and "--micro-batch-size" in cmd and "--seq-len" in cmd, cmd
    assert main(cmd[1:]) == 0  # the command it gives writes a plan the run resumes from
    assert _run(capsys, "verify", str(store))[0] == 0
    assert main(["train", "--store", str(store), "--data", str(data), "--steps", "2", "--allow-change", "steps"]) == 0
