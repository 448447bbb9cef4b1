"""The user surface of data-parallel runs (issue 13): rank directories outside the run directory,
resume, eval / generate / warm start / export of a sharded store, reshard with --rank-dir.

One 2-rank run over gloo (two launches: stop after step 2, then resume to 3, the second without
--rank-dir: the run's recorded template is used) against the single-process run of the same config.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mtc.store import TensorStore

from mtc import rank_dirs, shards
from mtc.cli import main
from mtc.errors import ConfigError, StoreError
from mtc.evaluate import evaluate_store
from mtc.train import train
from mtc.warmstart import init_from, load_state_dict
from tests.mtc.test_data_parallel import ROOT, STEPS, _assert_close, _assert_same_export, _config, _env, _free_port, _state, _train_args
from tests.runtime.engine_util import skewed_tokens, small_config

# -- templates (fast) ---------------------------------------------------------------------------


def test_rank_dir_templates_are_checked_and_filled_in(tmp_path):
    rank_dirs.check_template("/nvme/run/{node}/rank-{local_rank:02d}")
    for bad, why in [("/nvme/run", "must contain {rank} or {local_rank}"), ("/x/{job}-{rank}", "unknown placeholder"),
                     ("/x/{rank", "not a valid template")]:
        with pytest.raises(ValueError, match=why.replace("{", r"\{").replace("}", r"\}")):
            rank_dirs.check_template(bad)
    place = rank_dirs.Place(rank=5, world_size=8, local_rank=1, node=2, host="h")
    assert rank_dirs.resolve("/nv/{host}/{node}-{local_rank}-{rank}-of-{world_size}", tmp_path, place) == Path("/nv/h/2-1-5-of-8")
    assert rank_dirs.resolve(None, tmp_path, place) == (tmp_path / "ranks" / "rank-5-of-8").absolute()
    # the record names a directory inside the run relative to it (a copied run stays whole), others absolute
    assert rank_dirs.recorded_form(tmp_path, tmp_path / "ranks" / "rank-0-of-2") == "ranks/rank-0-of-2"
    assert rank_dirs.recorded_form(tmp_path / "run", tmp_path / "nv" / "r0") == str(tmp_path / "nv" / "r0")
    assert rank_dirs.located(tmp_path / "copy", "ranks/rank-0-of-2") == tmp_path / "copy" / "ranks" / "rank-0-of-2"
    assert rank_dirs.place_from_env(5, 8, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}).node == 1  # no GROUP_RANK: rank // 4
    assert rank_dirs.place_from_env(5, 8, {"LOCAL_RANK": "1", "GROUP_RANK": "3"}).node == 3


def test_ranks_of_one_host_may_not_share_a_directory():
    rank_dirs.duplicates([("a", "/nv/0"), ("b", "/nv/0"), ("a", "/nv/1")], "/nv/{local_rank}")  # other hosts: their own disks
    with pytest.raises(ConfigError, match=r"ranks 0 and 2 on host a would share the shard directory /nv/0"):
        rank_dirs.duplicates([("a", "/nv/0"), ("b", "/nv/0"), ("a", "/nv/0")], "/nv/{local_rank}")


def test_reshard_templates_may_not_name_the_next_launchs_nodes():
    rank_dirs.check_reshard_template("/nv/run/rank-{rank}-of-{world_size}")
    with pytest.raises(ConfigError, match=r"cannot know \{local_rank\}, \{node\}"):
        rank_dirs.check_reshard_template("/nv/{node}/{local_rank}")


def test_a_new_shard_store_does_not_replace_foreign_files(tmp_path):
    run, other = tmp_path / "run", tmp_path / "nv" / "r0"
    other.mkdir(parents=True)
    rank_dirs.check_owner(other, run, None)  # empty: fine
    (other / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="already holds files that are not a shard store of this run"):
        rank_dirs.check_owner(other, run, None)
    with pytest.raises(StoreError, match="already holds a shard store of run /elsewhere"):
        rank_dirs.check_owner(other, run, {rank_dirs.SHARD_DIR_ATTR: {"run": "/elsewhere"}})
    rank_dirs.check_owner(other, run, {rank_dirs.SHARD_DIR_ATTR: {"run": os.path.abspath(run)}})  # this run's: replaced
    rank_dirs.check_owner(run / "ranks" / "rank-0-of-2", run, None)  # under the run directory: always the run's


def test_a_bad_rank_dir_flag_is_one_line_before_anything_is_written(tmp_path, capsys):
    tokens = skewed_tokens(tmp_path / "tok.bin", n=4000)
    code = main(["train", "--preset", "tiny", "--store", str(tmp_path / "s"), "--data", str(tokens.path), "--rank-dir", "/nv/run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "config field rank_dir" in err[0] and "{rank}" in err[0]
    assert not (tmp_path / "s").exists()


# -- the torchrun-1 overhead measurement (bench/dp_runs.py, fast: no launch) --------------------


def test_torchrun_one_overhead_is_a_per_round_ratio_with_its_spread_and_the_machines_noise():
    from tests.mtc.test_dist_plan import _dp_runs

    dp = _dp_runs()
    names = dp.settings(1)
    assert dp.round_order(0, names) == names and dp.round_order(1, names) == names[::-1]
    run = lambda step, out=1.0: {"median_step_s": step, "outside_steps_s": out}
    rounds = {"plain": [run(1.00), run(1.10), run(0.90), {"error": "crashed"}, run(1.00)],
              "torchrun-1": [run(1.01, 3.0), run(1.10, 3.5), run(0.91, 2.5), run(1.0), run(0.99, 3.0)]}
    ov = dp.overhead(rounds)
    assert ov["ratio_per_round"] == pytest.approx([1 / 1.01, 1.0, 0.9 / 0.91, 1 / 0.99])  # the crashed round is left out
    assert ov["ratio"]["n"] == 4 and ov["ratio"]["min"] == pytest.approx(0.9 / 0.91) and "q1" in ov["ratio"]
    assert ov["noise_by_setting"]["plain"] == pytest.approx(1.1 / 0.9 - 1)
    assert ov["launch_overhead_s"]["median"] == pytest.approx(2.0)
    assert ov["verdict"].startswith("undecided: this machine's run-to-run noise (22.2%) exceeds the 2% bound")
    quiet = {"plain": [run(1.0), run(1.001), run(1.002)], "torchrun-1": [run(1.0), run(1.002), run(1.001)]}
    assert dp.overhead(quiet)["verdict"].startswith("within the bound")
    slow = {"plain": [run(1.0), run(1.001), run(1.002)], "torchrun-1": [run(1.05), run(1.052), run(1.051)]}
    assert dp.overhead(slow)["verdict"].startswith("outside the bound")
    assert dp.overhead({"plain": [run(1.0)], "torchrun-1": [run(1.0)]})["verdict"].startswith("undecided: 1 paired round")
    assert "error" in dp.overhead({"plain": [{"error": "x"}], "torchrun-1": [run(1.0)]})
    # the launcher's own CPU (its children's not included), read from /proc
    t0 = dp.own_cpu_s(os.getpid())
    sum(i * i for i in range(300_000))
    assert t0 is not None and dp.own_cpu_s(os.getpid()) > t0
    assert dp.own_cpu_s(2**22 + 12345) is None  # above Linux's default pid_max: no such process
    with_cpu = {"plain": quiet["plain"], "torchrun-1": [dict(r, launcher_cpu_cores=c) for r, c in zip(quiet["torchrun-1"], (0.01, 0.02, 0.03))]}
    assert dp.overhead(with_cpu)["launcher_cpu_cores"]["median"] == 0.02


# -- a 2-rank run with its shards outside the run directory (two launches) ----------------------


def _ranks(n: int, args: list[str], **env: str) -> list[str]:
    """``n`` ranks of ``python args...`` launched directly with torchrun's environment, to the end; their stderr."""
    port, procs = _free_port(), []
    for r in range(n):
        e = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n),
                 LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n), **env)
        procs.append(subprocess.Popen([sys.executable, *args], env=e, cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    errs = []
    for p in procs:
        errs.append(p.communicate(timeout=400)[1])
        assert p.returncode == 0, errs[-1][-3000:]
    return errs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process reference and a 2-rank run whose shards live in ``nvme/{host}/rank-{rank}``."""
    d = tmp_path_factory.mktemp("dpuser")
    tokens = skewed_tokens(d / "tok.bin")
    cfg = _config(grad_accum=2)
    cfg_file = d / "run.json"
    cfg_file.write_text(json.dumps(cfg.to_dict()))
    res = train(cfg, d / "ref", tokens)
    res.store.close()
    template = str(d / "nvme" / "{host}" / "rank-{rank}")
    _ranks(2, [*_train_args(cfg_file, d / "w2", tokens.path), "--rank-dir", template, "--stop-after", "2"])
    with TensorStore.open(d / "w2", read_only=True) as st:
        first = st.last_commit()
    _ranks(2, _train_args(cfg_file, d / "w2", tokens.path))  # resumes; the record's template finds the shards
    return d, tokens, template, first


@pytest.mark.slow
def test_shards_outside_the_run_directory_resume_and_match_the_single_process_run(runs):
    d, _, template, first = runs
    assert first.step == 2 and first.meta["shards"]["template"] == template
    with TensorStore.open(d / "w2", read_only=True) as st:
        last = st.last_commit()
    assert last.step == STEPS and last.meta["shards"]["template"] == template  # the resumed launch named none
    dirs = [shards.shard_dir(d / "w2", last, r) for r in range(2)]
    assert dirs == [Path(rank_dirs.resolve(template, d, rank_dirs.place_from_env(r, 2, {}))) for r in range(2)]
    assert all(p.is_absolute() and (p / "commit.json").is_file() for p in dirs)
    assert not (d / "w2" / shards.RANKS_DIR).exists()
    _assert_close(d / "w2", d / "ref")
    assert main(["verify", str(d / "w2")]) == 0
    assert main(["repair", str(d / "w2")]) == 0


@pytest.mark.slow
def test_eval_generate_and_state_dict_of_the_sharded_store_equal_the_single_process_run(runs):
    from mtc.generate import generate_from_store

    d, tokens, _, _ = runs
    for step in (None, 2):  # the last commit, and the one before (the other state generation)
        a = evaluate_store(d / "w2", tokens, step=step, batches=2)
        b = evaluate_store(d / "ref", tokens, step=step, batches=2)
        assert a.step == b.step == (step or STEPS)
        assert a.loss == pytest.approx(b.loss, abs=1e-5, rel=1e-5)
    got, ref = load_state_dict(d / "w2"), load_state_dict(d / "ref")
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-5)
    g = generate_from_store(d / "w2", "ab", max_new_tokens=4, temperature=0.0, context=16)
    h = generate_from_store(d / "ref", "ab", max_new_tokens=4, temperature=0.0, context=16)
    assert g.step == h.step == STEPS and g.tokens == h.tokens  # greedy


@pytest.mark.slow
def test_warm_start_from_a_sharded_store(runs):
    d, tokens, _, _ = runs
    losses = []
    for src in ("w2", "ref"):  # a new run from the sharded store's weights, and from the single-process store's
        init_from(d / src, d / f"warm-{src}", _config(grad_accum=2))
        got, want = load_state_dict(d / f"warm-{src}"), load_state_dict(d / src)
        assert all(torch.equal(got[k], want[k]) for k in want)
        res = train(_config(grad_accum=2), d / f"warm-{src}", tokens, stop_after=1)
        res.store.close()
        losses.append(res.losses[0])
    assert losses[0] == pytest.approx(losses[1], abs=1e-5, rel=1e-5)


@pytest.mark.slow
def test_shards_that_are_not_visible_are_one_line_errors(runs, tmp_path, capsys):
    d, tokens, _, _ = runs
    with TensorStore.open(d / "w2", read_only=True) as st:
        last = st.last_commit()
    hidden = shards.shard_dir(d / "w2", last, 1)
    moved = tmp_path / "moved"
    shutil.move(hidden, moved)
    try:
        with pytest.raises(StoreError, match=r"rank 1's shard store .*rank-1, named by .*is not visible here: mtc reshard") as e:
            shards.reshard(d / "w2", 1)
        assert "\n" not in str(e.value)
        for argv in (["eval", str(d / "w2"), "--data", str(tokens.path)], ["export", str(d / "w2"), "-o", str(tmp_path / "hf")],
                     ["reshard", str(d / "w2"), "--world-size", "3"]):
            assert main(argv) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and str(hidden) in err[0] and "all of them must be on this machine" in err[0], argv
        assert main(["verify", str(d / "w2")]) == 1
        assert "rank 1: damaged or not visible here" in capsys.readouterr().out
        text = rank_dirs.missing_text(1, moved, "/nv/rank-{rank}", hidden)  # what a resumed rank says
        assert str(moved) in text and "--rank-dir" in text and str(hidden) in text
    finally:
        shutil.move(moved, hidden)


@pytest.mark.slow
def test_reshard_with_a_rank_dir_then_to_one_process_keeps_the_state_and_exports(runs, tmp_path):


    d, _, template, _ = runs
    store = d / "w2"  # the last test of the module: it rewrites the run's layout
    before, _, _ = _state(store)
    host = socket.gethostname()
    with pytest.raises(ConfigError, match="holds a shard of the current layout"):  # the same directories, spelled out
        shards.reshard(store, 2, template=template.replace("{host}", host))
    new = str(tmp_path / "nv3" / "r{rank}-of-{world_size}")
    assert main(["reshard", str(store), "--world-size", "3", "--rank-dir", new]) == 0
    with TensorStore.open(store, read_only=True) as st:
        rec = st.last_commit()
    assert [shards.shard_dir(store, rec, r) for r in range(3)] == [tmp_path / "nv3" / f"r{r}-of-3" for r in range(3)]
    assert not Path(template.format(host=host, rank=0)).exists()  # the old shards are gone
    assert main(["verify", str(store)]) == 0
    mid, _, _ = _state(store)
    assert main(["reshard", str(store), "--world-size", "1"]) == 0
    after, _, _ = _state(store)
    assert all(torch.equal(before[k], mid[k]) and torch.equal(before[k], after[k]) for k in before)
    _assert_same_export(store, d / "ref", tmp_path)


# -- a compiled (fused) plan on two ranks (Triton's interpreter: slow) --------------------------


@pytest.mark.slow
def test_two_ranks_run_a_compiled_plan_like_one_process_and_compile_nothing_again(tmp_path):
    from mtc.compiler import compile_program
    from mtc.plan import save_plan
    from mtc.tracer import trace
    from mtc.train import build_model
    from mtc.user_model import write_model_record

    # the smallest Llama that has every template kind (embed, block, head)
    cfg = small_config(model_overrides={"n_layers": 1, "dim": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64},
                       micro_batch_size=1, seq_len=8)
    plan = tmp_path / "plan"
    program = trace(build_model(cfg, device="meta"), cfg.micro_batch_size, cfg.seq_len, name=cfg.model)
    save_plan(program, plan)
    write_model_record(plan, cfg.to_dict(), program)
    compile_program(program, plan / "kernels")  # what `mtc compile` does
    made = {p.relative_to(plan): p.stat().st_mtime_ns for p in (plan / "kernels").rglob("*") if p.is_file()}
    tokens = skewed_tokens(tmp_path / "tok.bin")
    flags = ["--data", str(tokens.path), "--steps", "2", "--grad-accum", "2", "--commit-every", "1", "--kernels", "fused",
             "--placement", "ram", "--gpu-update", "none"]
    assert main(["train", "--plan", str(plan), "--store", str(tmp_path / "ref"), *flags]) == 0
    tmp = tmp_path / "tmp"  # where the ranks' private kernel caches go
    tmp.mkdir()
    errs = _ranks(2, ["-m", "mtc", "train", "--plan", str(plan), "--store", str(tmp_path / "w2"), *flags], TMPDIR=str(tmp))
    assert not any("recompiling" in e for e in errs), errs
    shared = tmp_path / "w2" / "plan" / "kernels"  # rank 0 loaded the plan's kernels; nobody wrote new ones
    assert {Path("kernels") / p.relative_to(shared) for p in shared.rglob("*") if p.is_file()} == set(made)
    assert {p.relative_to(plan): p.stat().st_mtime_ns for p in (plan / "kernels").rglob("*") if p.is_file()} == made
    assert not list(tmp.glob("mtc-kernels-*")), "a rank's private kernel cache was left behind"
    logs = [[json.loads(x) for x in (tmp_path / s / "logs" / "metrics.jsonl").read_text().splitlines()] for s in ("w2", "ref")]
    assert [r["loss"] for r in logs[0]] == pytest.approx([r["loss"] for r in logs[1]], abs=1e-5, rel=1e-5)
    assert [r["targets"] for r in logs[0]] == [r["targets"] for r in logs[1]]  # rank 0 counts the global step's
    got, ref = load_state_dict(tmp_path / "w2"), load_state_dict(tmp_path / "ref")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_rank_waiting_for_rank_0s_store_stops_with_rank_0s_reason(tmp_path):
    """Rank 0 alone opens the store; when it refuses (here: a directory that is not a store), the
    other ranks used to report a lost peer and say "relaunch to resume", which would fail alike."""
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(_config(steps=2).to_dict()))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("not a store")
    port, procs = _free_port(), []
    for r in range(2):
        e = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                 LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, *_train_args(cfg_file, tmp_path / "junk", tokens.path)], env=e,
                                      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=300)[1].strip().splitlines() for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    reason = "cannot create a store at"
    assert errs[0][-1].startswith(f"mtc: error: {reason}"), errs[0]
    assert errs[1][-1].startswith(f"mtc: error: rank 0 could not start the run: {reason}"), errs[1]
    assert "Relaunch" not in errs[1][-1]
