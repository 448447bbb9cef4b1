"""Data-parallel training over torch.distributed (issue 13): launch, data split, sharded state.

The multi-process tests start real ranks on this host over gloo (torchrun, or the ranks launched
directly with torchrun's environment) and compare them with the single-process run of the same
config and global batch: the fp32 contract, to 1e-5 (the reduction order differs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mtc.store import TensorStore

from mtc import dist, shards
from mtc.cli import main
from mtc.errors import ConfigError, StoreError
from mtc.plan import load_plan
from mtc.runtime.collectives import shard_range
from mtc.runtime.tiers import StateTiers
from mtc.train import train
from tests.runtime.engine_util import skewed_tokens, small_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def _config(**kw: object):
    # grad_accum 6: 3 micro-batches per rank at world 2, 2 at world 3 (accumulation within a rank)
    base = {"steps": STEPS, "commit_every": 1, "grad_accum": 6, "placement": "ram", "gpu_update": "none", "kernels": "unfused"}
    base.update(kw)
    return small_config(**base)


# -- the world and its share of the host (fast) -------------------------------------------------


def test_world_from_env_defaults_to_one_rank_and_reads_torchrun():
    assert dist.world_from_env({}) == dist.World(0, 1, 0, 1)
    assert not dist.world_from_env({}).distributed
    w = dist.world_from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.is_root) == (5, 8, 1, 4, False)
    with pytest.raises(ConfigError, match="torchrun"):
        dist.world_from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="not an integer"):
        dist.world_from_env({"WORLD_SIZE": "two"})


@pytest.mark.parametrize("env", [{}, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}])
def test_one_rank_creates_no_process_group(monkeypatch, env):
    """Without torchrun, or torchrun with one process: today's path, no group, no affinity change."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    before = os.sched_getaffinity(0)
    assert dist.init_world("cpu", 5) == dist.World()
    assert not torch.distributed.is_initialized()
    assert os.sched_getaffinity(0) == before


def test_ranks_on_one_host_take_their_share_of_its_cores():
    cores = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    try:
        dist._pin_cpus(dist.World(1, 2, 1, 2))
        share = dist.cpu_share(cores, 1, 2)
        assert sorted(os.sched_getaffinity(0)) == share and torch.get_num_threads() == len(share)
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("cpus", "ranks"), [(16, 4), (16, 3), (7, 2), (2, 3), (1, 1)])
def test_cpu_share_splits_the_host_without_overlap(cpus, ranks):
    shares = [dist.cpu_share(list(range(cpus)), r, ranks) for r in range(ranks)]
    assert all(shares)
    if ranks <= cpus:  # disjoint, contiguous, covering every core, sizes within one
        assert sorted(c for s in shares for c in s) == list(range(cpus))
        assert all(s == list(range(s[0], s[-1] + 1)) for s in shares)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:
        assert all(len(s) == 1 for s in shares)


@pytest.mark.parametrize(("numel", "world"), [(10, 3), (9, 3), (1, 4), (0, 2), (7, 1)])
def test_shard_range_covers_the_layer_once(numel, world):
    ranges = [shard_range(numel, r, world) for r in range(world)]
    assert all(per == -(-numel // world) for _, _, per in ranges)
    covered = [i for lo, hi, _ in ranges for i in range(lo, hi)]
    assert covered == list(range(numel))


# -- refusals before anything is written (fast) -------------------------------------------------


def test_launch_checks_are_one_line_errors_before_anything_is_written(tmp_path, monkeypatch, capsys):
    w2 = dist.World(0, 2, 0, 2)
    with pytest.raises(ConfigError, match="multiple of the world size, got 3; use e.g. grad_accum = 2"):
        dist.check_launch(_config(grad_accum=3), w2, tmp_path)
    with pytest.raises(ConfigError, match="durability 'none'"):
        dist.check_launch(_config(durability="none"), w2, tmp_path)
    with pytest.raises(ConfigError, match="needs a store directory"):
        dist.check_launch(_config(), w2, None)
    dist.check_launch(_config(grad_accum=3), dist.World(), None)  # one rank: anything goes
    # through the CLI under torchrun's environment: exit 2, one line, no store, no rendezvous
    tokens = skewed_tokens(tmp_path / "tok.bin", n=4000)
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(_config(grad_accum=3).to_dict()))
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    code = main(["train", "--config", str(cfg_file), "--store", str(tmp_path / "s"), "--data", str(tokens.path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("mtc: error: config field grad_accum")
    assert not (tmp_path / "s").exists()


def test_placement_check_refuses_tiers_that_are_not_sharded(program):
    w2 = dist.World(1, 2, 1, 2)
    dist.check_placement(w2, ["ram"] * program.n_layers, set(), program)
    dist.check_placement(w2, ["ram"] * (program.n_layers - 1) + ["disk"], set(), program)  # disk: tests/mtc/test_dp_disk.py
    with pytest.raises(ConfigError, match="placement puts layers in gpu"):
        dist.check_placement(w2, ["ram"] * (program.n_layers - 1) + ["gpu"], set(), program)
    with pytest.raises(ConfigError, match="gpu_update names layers"):
        dist.check_placement(w2, ["ram"] * program.n_layers, {1}, program)
    dist.check_placement(dist.World(), ["disk"] * program.n_layers, set(), program)
    # auto placement on several ranks: every layer sharded in host RAM, updated by the CPU
    auto = _config(placement="auto", gpu_update="auto", ram_budget_gb=64)  # (a short budget puts layers on disk)
    got = dist.data_parallel_placement(w2, auto, ["gpu"] * program.n_layers, {1}, program)
    assert got == (["ram"] * program.n_layers, set())
    assert dist.data_parallel_placement(dist.World(), auto, ["gpu"], {0}, program) == (["gpu"], {0})
    with pytest.raises(ConfigError, match="--placement ram"):
        dist.data_parallel_placement(w2, _config(placement="gpu"), ["gpu"] * program.n_layers, set(), program)


def test_sharded_tiers_hold_this_ranks_range_and_the_whole_compute_copy(program):
    world = 3
    for rank in range(world):
        tiers = StateTiers(program, ["ram"] * program.n_layers, torch.device("cpu"), torch.float32, rank=rank, world_size=world)
        for s in tiers.layers:
            if not s.numel:
                continue
            lo, hi, per = shard_range(s.numel, rank, world)
            full = torch.randn(s.numel)
            m, v = torch.randn(s.numel), torch.rand(s.numel)
            tiers.set_layer(s.layer, full, m, v)
            assert s.shard == (lo, hi) and s.master.numel() == per and s.grad.numel() == s.numel
            assert torch.equal(s.master[: hi - lo], full[lo:hi]) and torch.equal(s.v[: hi - lo], v[lo:hi])
            assert not s.master[hi - lo :].any()  # padding stays zero
            assert torch.equal(s.compute[: s.numel], full) and s.compute is not s.master


# -- real ranks over gloo (slow) ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
                OMP_NUM_THREADS="1")


def _train_args(cfg_file: Path, store: Path, data: Path) -> list[str]:
    return ["-m", "mtc", "train", "--config", str(cfg_file), "--store", str(store), "--data", str(data)]


def _torchrun(n: int, cfg_file: Path, store: Path, data: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), *_train_args(cfg_file, store, data)]
    return subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)


def _launch(n: int, cfg_file: Path, store: Path, data: Path, *extra: str) -> list[subprocess.Popen]:
    """``n`` ranks started directly with torchrun's environment (no agent that would kill the survivors)."""
    port, procs = _free_port(), []
    for r in range(n):
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
        procs.append(subprocess.Popen([sys.executable, *_train_args(cfg_file, store, data), *extra], env=env, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _state(store: Path) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Every state array of the last commit, and the logged losses and gradient norms per step."""
    with TensorStore.open(store, read_only=True) as st:
        last = st.last_commit()
        assert last.step == STEPS
        program = load_plan(store / "plan")
        # a data-parallel run's record names its per-rank shard stores (mtc.shards)
        arrays = {f"{i}.{k}": shards.read_layer(store, last, i, k, program.layer_numel(i), root_store=st)
                  for i in range(program.n_layers) if program.layer_numel(i) for k in ("master", "m", "v")}
    recs = [json.loads(line) for line in (store / "logs" / "metrics.jsonl").read_text().splitlines()]
    return arrays, [r["loss"] for r in recs], [r["grad_norm"] for r in recs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process reference (in this process) and a 2-rank torchrun run of the same config."""
    d = tmp_path_factory.mktemp("dp")
    tokens = skewed_tokens(d / "tok.bin")
    cfg = _config()
    cfg_file = d / "run.json"
    cfg_file.write_text(json.dumps(cfg.to_dict()))
    res = train(cfg, d / "ref", tokens)
    res.store.close()
    two = _torchrun(2, cfg_file, d / "w2", tokens.path)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    return d, tokens, cfg_file


def _assert_same_export(store: Path, ref: Path, tmp_path: Path) -> None:
    """`mtc export` of ``store`` (any layout) equals the export of the single-process run ``ref`` to 1e-5."""
    from safetensors.torch import load_file

    from mtc.hf import export_hf

    export_hf(store, tmp_path / "hf2")
    export_hf(ref, tmp_path / "hf1")
    a, b = load_file(next((tmp_path / "hf2").glob("*.safetensors"))), load_file(next((tmp_path / "hf1").glob("*.safetensors")))
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)


def _assert_close(got: Path, ref: Path) -> None:
    (a, la, na), (b, lb, nb) = _state(got), _state(ref)
    assert max(na) > _config().optim.clip_norm  # clipping took part
    assert la == pytest.approx(lb, abs=1e-5, rel=1e-5) and na == pytest.approx(nb, abs=1e-5, rel=1e-5)
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_two_ranks_under_torchrun_match_the_single_process_run(runs):
    d, _, _ = runs
    _assert_close(d / "w2", d / "ref")
    assert main(["verify", str(d / "w2")]) == 0  # the global record and every shard store
    with TensorStore.open(d / "w2", read_only=True) as st:  # the run directory holds no state, the ranks' stores do
        assert not [n for n in st.array_names() if n.startswith("layers/")]
        assert st.last_commit().meta["shards"]["world_size"] == 2
    for r in range(2):
        with TensorStore.open(shards.rank_dir(d / "w2", r, 2), read_only=True) as rs:
            assert rs.last_commit().step == STEPS and rs.array_names()


@pytest.mark.slow
def test_a_missing_or_stale_shard_is_a_one_line_error(runs, tmp_path, capsys):
    d, _, _ = runs
    with TensorStore.open(d / "w2", read_only=True) as st:
        last = st.last_commit()
    with TensorStore.open(shards.rank_dir(d / "w2", 1, 2), read_only=True) as rs:
        shards.check_shard(d / "w2", last, 1, rs)  # the run's own shard agrees
        stale = dict(last.meta, shards={**last.meta["shards"], "ranks": [dict(e, digest="0" * 16) for e in last.meta["shards"]["ranks"]]})
        with pytest.raises(StoreError, match="rank 1's shard store .* is stale"):
            shards.check_shard(d / "w2", dataclasses.replace(last, meta=stale), 1, rs)
    broken = tmp_path / "broken"
    shutil.copytree(d / "w2", broken)
    shutil.rmtree(shards.rank_dir(broken, 1, 2))
    with pytest.raises(StoreError, match="rank 1's shard store .*rank-1-of-2 is missing") as e:
        shards.open_rank_store(broken, 1, 2, [1], "full", io_threads=1, fresh=False)
    assert "\n" not in str(e.value)
    assert main(["verify", str(broken)]) == 1
    assert "rank 1: damaged" in capsys.readouterr().out


@pytest.mark.slow
def test_one_process_refuses_a_sharded_store_and_leaves_it_whole(runs, tmp_path, capsys):
    """A plain `mtc train` on a 2-rank store: one line naming torchrun and reshard, nothing written.
    It used to create empty state arrays in the run directory and fail on them as 'damaged', after
    which `mtc verify` called the healthy run damaged and `mtc repair` could not fix it."""
    d, tokens, cfg_file = runs
    store = tmp_path / "w2"
    shutil.copytree(d / "w2", store)
    before = sorted(p.relative_to(store) for p in store.rglob("*") if p.is_file() and p.name != ".lock")
    with pytest.raises(StoreError, match=r"world size 2 .*torchrun --nproc-per-node 2.*mtc reshard .* --world-size 1"):
        train(_config(), store, tokens)
    capsys.readouterr()
    assert main(["train", "--config", str(cfg_file), "--store", str(store), "--data", str(tokens.path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data-parallel run" in err[0], err
    assert sorted(p.relative_to(store) for p in store.rglob("*") if p.is_file() and p.name != ".lock") == before
    assert main(["verify", str(store)]) == 0


@pytest.mark.slow
def test_reshard_2_3_1_keeps_the_state_bit_identical_and_export_matches(runs, tmp_path):


    d, _, _ = runs
    store = tmp_path / "re"
    shutil.copytree(d / "w2", store)
    before, _, _ = _state(store)
    assert main(["reshard", str(store), "--world-size", "3"]) == 0
    assert not shards.rank_dir(store, 0, 2).exists() and shards.rank_dir(store, 2, 3).is_dir()
    assert main(["verify", str(store)]) == 0
    (store / "commit.json").unlink()  # repair restores the global record; every shard store is checked too
    assert main(["repair", str(store)]) == 0 and main(["verify", str(store)]) == 0
    mid, _, _ = _state(store)
    shards.reshard(store, 1)
    after, _, _ = _state(store)
    assert all(torch.equal(before[k], mid[k]) and torch.equal(before[k], after[k]) for k in before)
    assert main(["verify", str(store)]) == 0
    # export of the sharded run's store equals export of the single-process run's store
    _assert_same_export(d / "w2", d / "ref", tmp_path)


@pytest.mark.slow
def test_three_ranks_match_the_single_process_run(runs):
    d, tokens, cfg_file = runs
    procs = _launch(3, cfg_file, d / "w3", tokens.path)
    for p in procs:
        assert p.wait(timeout=400) == 0, p.stderr.read()[-3000:]
    _assert_close(d / "w3", d / "ref")


@pytest.mark.slow
def test_one_rank_under_torchrun_is_the_plain_run(runs):
    d, tokens, cfg_file = runs
    one = _torchrun(1, cfg_file, d / "w1", tokens.path)
    assert one.returncode == 0, one.stderr[-3000:]
    (a, la, _), (b, lb, _) = _state(d / "w1"), _state(d / "ref")
    assert la == lb and all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
def test_mfu_of_a_step_on_two_hosts_is_over_both_hosts_peak(runs, tmp_path):
    """Two ranks, each alone on its host (as torchrun describes two nodes): a record's ``tflops``
    is the whole step's, so its MFU divides by both hosts' peak. It divided by one device's: a
    data-parallel run on N GPUs reported N times its MFU."""
    from mtc.metrics import _cpu_name

    d, tokens, cfg_file = runs
    home = tmp_path / "home"
    (home / ".cache" / "mtc").mkdir(parents=True)
    peak = 0.5  # a machine profile of this CPU: the MFU denominator is known
    (home / ".cache" / "mtc" / "machine.json").write_text(json.dumps({"device": _cpu_name(), "matmul_dtype": "float32",
                                                                        "matmul": [{"tflops": peak}]}))
    port, procs = _free_port(), []
    for r in range(2):
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(r), HOME=str(home))
        procs.append(subprocess.Popen([sys.executable, *_train_args(cfg_file, tmp_path / "s", tokens.path)], env=env,
                                      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        assert p.wait(timeout=400) == 0, p.stderr.read()[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "s" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == STEPS
    for r in recs:
        assert r["peak_tflops"] == peak and r["mfu"] == pytest.approx(r["tflops"] / (2 * peak))


@pytest.mark.slow
def test_kill_9_of_one_rank_stops_the_others_and_a_relaunch_resumes_bit_identically(runs):
    """Kill -9 of a rank mid-run: the survivor exits non-zero within 60 s with one error line; the
    same launch resumes bit-identically, and one process resumes the same store to 1e-5."""
    d, tokens, cfg_file = runs
    store = d / "killed"
    victim = random.Random(3).randrange(2)
    procs = _launch(2, cfg_file, store, tokens.path)
    commit = store / "commit.json"
    deadline = time.time() + 300
    while time.time() < deadline and not (commit.exists() and json.loads(commit.read_text() or "{}").get("step", 0) >= 1):
        assert all(p.poll() is None for p in procs), "a rank ended before the kill"
        time.sleep(0.01)
    procs[victim].kill()
    t0 = time.time()
    survivor = procs[1 - victim]
    code = survivor.wait(timeout=90)
    took = time.time() - t0
    err = survivor.stderr.read()
    assert code != 0 and took < 60, (code, took, err[-2000:])
    assert "mtc: error:" in err
    procs[victim].wait()
    assert json.loads(commit.read_text())["step"] < STEPS, "the kill came too late to interrupt the run"
    shutil.copytree(store, d / "killed-then-one-rank")
    again = _launch(2, cfg_file, store, tokens.path)
    for p in again:
        assert p.wait(timeout=400) == 0, p.stderr.read()[-3000:]
    assert json.loads(commit.read_text())["meta"]["world_size"] == 2
    a, _, _ = _state(store)
    b, _, _ = _state(d / "w2")
    assert all(torch.equal(a[k], b[k]) for k in b), "the relaunched run differs from the unbroken 2-rank run"
    # the same interrupted 2-rank store, resharded for one process, resumed: 1e-5 of the reference
    shards.reshard(d / "killed-then-one-rank", 1)
    res = train(_config(), d / "killed-then-one-rank", tokens)
    res.store.close()
    c, _, _ = _state(d / "killed-then-one-rank")
    ref, _, _ = _state(d / "ref")
    for k in ref:
        torch.testing.assert_close(c[k], ref[k], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["ram", "ram:0-1,disk:2-3"])
def test_a_weights_commit_resumed_on_two_ranks_restarts_adam_as_one_process_does(tmp_path, placement):
    """Resumed from a commit without moments (durability weights), the ranks restart AdamW over the
    weights as the single-process run does (zero moments, disk layers' too, and bias correction
    from the resume): the two agree to 1e-5, the first updates after the resume included."""
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg = _config(steps=4, durability="weights", placement=placement)
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(cfg.to_dict()))
    train(cfg, tmp_path / "ref", tokens, stop_after=2).store.close()
    train(cfg, tmp_path / "ref", tokens).store.close()
    for extra in (["--stop-after", "2"], []):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), *_train_args(cfg_file, tmp_path / "w2", tokens.path), *extra]
        out = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with TensorStore.open(tmp_path / "w2", read_only=True) as st, TensorStore.open(tmp_path / "ref", read_only=True) as ref:
        last, rlast = st.last_commit(), ref.last_commit()
        assert last.step == rlast.step == 4
        program = load_plan(tmp_path / "ref" / "plan")
        for i in range(program.n_layers):
            if program.layer_numel(i):
                got = shards.read_layer(tmp_path / "w2", last, i, "master", program.layer_numel(i), root_store=st)
                want = shards.read_layer(tmp_path / "ref", rlast, i, "master", program.layer_numel(i), root_store=ref)
                # (1e-4: a fresh AdamW's first update is about lr x the gradient's sign, so the ranks' other
                # reduction order moves a near-zero gradient's weight by up to ~2e-5 here; the step counted
                # from 0, or a disk layer's stale moments, moved weights by ~4e-3)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"layer {i}: {m}")


def _damage(store: TensorStore, name: str) -> None:
    """Flip 8 bytes in the middle of chunk 0 of array ``name`` (its CRC32C no longer matches)."""
    chunk = store.chunk_path(name, 0)
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 8] = bytes(b ^ 0xFF for b in raw[len(raw) // 2 : len(raw) // 2 + 8])
    chunk.write_bytes(bytes(raw))


@pytest.mark.slow
def test_verify_and_repair_check_the_generation_the_global_record_names(runs, tmp_path, capsys):
    """A rank whose peer died during a global commit has committed its shard of a step the run never
    committed, into the other generation: its shard store's last commit is ahead of the run's record.
    `mtc verify` checks the generation the run's record names (the one a resume loads); it checked
    the shard's own last commit and called the run healthy, while a relaunch and `mtc eval` failed
    on the damaged chunk and `mtc repair` of that shard said "nothing to repair". Repair rolls the
    whole run back, only to a commit whose every shard is whole; a shard store alone is not."""
    from mtc.store.directory import record_write_start
    from mtc.store.layout import state_array_name

    d, _, _ = runs
    ahead, behind = tmp_path / "ahead", tmp_path / "behind"
    for store in (ahead, behind):
        shutil.copytree(d / "w2", store)
    with TensorStore.open(ahead, read_only=True) as st:
        last = st.last_commit()
    g, damaged = last.generation, state_array_name(1, "master", last.generation)
    # rank 0 writes and commits its shard of the next step into the other generation; rank 1 never does
    record_write_start(ahead, last.step + 1, 1 - g)
    with TensorStore.open(shards.shard_dir(ahead, last, 0)) as rs:
        for i in range(4):
            for k in ("master", "m", "v"):
                rs.write(state_array_name(i, k, 1 - g), rs.read(state_array_name(i, k, g)))
        rs.commit(shards.rank_record(last.step + 1, 1 - g, last.data_cursor + 6, last.config, last.durability, 0, 2))
    for store in (ahead, behind):
        with TensorStore.open(shards.shard_dir(store, last, 0), read_only=True) as rs:
            _damage(rs, damaged)
        capsys.readouterr()
        assert main(["verify", str(store)]) == 1
        out = capsys.readouterr().out
        assert f"rank 0: damaged: array {damaged} chunk 0: " in out, out
        assert f"rank 0: store {shards.shard_dir(store, last, 0)}: step {last.step}, generation {g}" in out, out
        assert f"`mtc repair {store}` rolls back" in out and f"`mtc repair {shards.shard_dir(store, last, 0)}`" not in out, out
        # the shard's own repair would leave the run's record naming the damage: it names the run's
        assert main(["repair", str(shards.shard_dir(store, last, 0))]) == 2
        err = capsys.readouterr().err
        assert f"rank 0's shard store of the data-parallel run {store}" in err and f"run `mtc repair {store}`" in err, err
    # ahead: rank 0's step 4 overwrote the generation of step 2, on rank 0 only: no commit to roll back to
    assert main(["repair", str(ahead)]) == 2
    err = capsys.readouterr().err
    assert f"cannot repair store {ahead}" in err and f"step {last.step}'s state is damaged (rank 0's shard store" in err, err
    with TensorStore.open(ahead, read_only=True) as st:
        assert st.last_commit() == last  # left as it was
    # behind: every shard of step 2 is whole, and the run's record rolls back to it
    assert main(["repair", str(behind)]) == 0
    assert f"restored it from commits.jsonl line {last.step}: step {last.step - 1}" in capsys.readouterr().out
    assert main(["verify", str(behind)]) == 0
    with TensorStore.open(behind, read_only=True) as st:
        back = st.last_commit()
        assert (back.step, back.generation) == (last.step - 1, 1 - g)
        for i in range(4):
            shards.read_layer(behind, back, i, "master", load_plan(behind / "plan").layer_numel(i))  # every chunk reads


def _root_state(store: Path) -> list[str]:
    """The state arrays in the run directory itself (not in the ranks' shard stores)."""
    with TensorStore.open(store, read_only=True) as st:
        return [n for n in st.array_names() if n.startswith("layers/")]


@pytest.mark.slow
def test_reshard_from_one_process_removes_the_run_directorys_state(runs, tmp_path, capsys):
    """`mtc reshard RUN --world-size 2` of a single-process store deletes the full arrays in RUN
    once the sharded commit is durable: no record reads them, and `mtc verify` checked them (an
    8B model's ~190 GB). The plan, the history and reading the state back stay as they were."""
    d, _, _ = runs
    store = tmp_path / "one"
    shutil.copytree(d / "ref", store)
    before, _, _ = _state(store)
    assert _root_state(store)
    assert main(["reshard", str(store), "--world-size", "2"]) == 0
    assert _root_state(store) == [] and not (store / "layers").exists()
    with TensorStore.open(store, read_only=True) as st:
        assert shards.is_sharded(st.last_commit()) and len(st.commit_history()) == STEPS + 2
        assert not isinstance(st.attributes().get("mtc_layers"), dict)  # as a run started on 2 ranks
    capsys.readouterr()
    assert main(["verify", str(store)]) == 0
    assert "checked 0 arrays" in capsys.readouterr().out.splitlines()[0]
    mid, _, _ = _state(store)
    assert main(["reshard", str(store), "--world-size", "1"]) == 0 and main(["verify", str(store)]) == 0
    after, _, _ = _state(store)
    assert all(torch.equal(before[k], mid[k]) and torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_a_single_process_store_resumed_on_two_ranks_removes_its_state_after_two_sharded_commits(runs, tmp_path):
    """Two ranks resuming a single-process store read its full arrays (each its range) and commit
    shards; the full arrays stay while a record a resume or `mtc repair` may use (the last two)
    reads them, and are deleted behind the second sharded commit. They were kept for good."""
    d, tokens, _ = runs
    store = tmp_path / "one"
    shutil.copytree(d / "ref", store)
    cfg_file = tmp_path / "more.json"
    cfg_file.write_text(json.dumps(_config(steps=STEPS + 2).to_dict()))
    for p in _launch(2, cfg_file, store, tokens.path, "--allow-change", "steps", "--stop-after", str(STEPS + 1)):
        assert p.wait(timeout=400) == 0, p.stderr.read()[-3000:]
    assert _root_state(store)  # the record before the last is the single-process one: a roll-back target
    for p in _launch(2, cfg_file, store, tokens.path, "--allow-change", "steps"):
        assert p.wait(timeout=400) == 0, p.stderr.read()[-3000:]
    assert _root_state(store) == [] and not (store / "layers").exists()
    assert main(["verify", str(store)]) == 0
    with TensorStore.open(store, read_only=True) as st:
        hist = st.commit_history()
        assert [(r.step, shards.is_sharded(r)) for r in hist[-3:]] == [(STEPS, False), (STEPS + 1, True), (STEPS + 2, True)]
