"""The disk tier under data parallelism (issue 13): each rank's shard of a disk layer lives in its shard store.

Real ranks over gloo (world 2, the tiny two-block model, 3 steps, clipping, 3 micro-batches per rank)
against the single-process run of the same global batch: the fp32 contract to 1e-5. The ranks run
through tests/mtc/dp_disk_rank.py, which makes the disk chunk small (several chunks per shard) and
records every state read, so the tests can see where the state comes from.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mtc.store import LAYOUT_ATTR, TensorStore

from mtc import dist, shards
from mtc.cli import main
from mtc.data import TokenFile
from mtc.dist_plan import check_fit_ranks
from mtc.errors import ConfigError
from mtc.plan import load_plan
from mtc.runtime.collectives import shard_range
from mtc.runtime.dp_placement import dp_auto_placement, rank_host_bytes
from mtc.train import train
from tests.mtc.test_data_parallel import ROOT, STEPS, _assert_same_export, _config, _env, _free_port, _state, _train_args
from tests.runtime.engine_util import skewed_tokens

CHUNK = 4096  # elements per disk chunk in the ranks (a block's shard is several of them)
MIXED = "ram:0-1,disk:2-3"  # embed and the first block in RAM, the second block and the head on disk


def _launch(n: int, cfg_file: Path, store: Path, data: Path, log: Path, *extra: str) -> list[subprocess.Popen]:
    """``n`` ranks of `mtc train` through the spying wrapper, with torchrun's environment."""
    port, procs = _free_port(), []
    for r in range(n):
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
        cmd = [sys.executable, str(ROOT / "tests/mtc/dp_disk_rank.py"), str(log), str(CHUNK), *_train_args(cfg_file, store, data)[2:], *extra]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _wait(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        assert p.wait(timeout=400) == 0, p.stderr.read()[-3000:]


def _reads(log: Path, rank: int) -> list[tuple[str, str, str]]:
    return [tuple(r) for r in json.loads(Path(f"{log}.rank-{rank}.json").read_text())]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process reference and two 2-rank runs, all-disk and mixed, started together."""
    d = tmp_path_factory.mktemp("dpdisk")
    tokens = skewed_tokens(d / "tok.bin")
    procs = []
    for name, placement in (("disk", "disk"), ("mixed", MIXED)):
        cfg_file = d / f"{name}.json"
        cfg_file.write_text(json.dumps(_config(placement=placement).to_dict()))
        procs += _launch(2, cfg_file, d / name, tokens.path, d / f"{name}-reads")
    res = train(_config(), d / "ref", tokens)  # ram placement: the single-process disk tier is bit-identical to it
    res.store.close()
    _wait(procs)
    return d, tokens


@pytest.mark.slow
def test_disk_and_mixed_placements_match_the_single_process_run(runs):
    d, _ = runs
    ref, lref, nref = _state(d / "ref")
    assert max(nref) > _config().optim.clip_norm  # clipping took part
    for name in ("disk", "mixed"):
        got, loss, norms = _state(d / name)
        assert loss == pytest.approx(lref, abs=1e-5, rel=1e-5) and norms == pytest.approx(nref, abs=1e-5, rel=1e-5)
        for k in ref:  # master, m and v of every layer
            torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k, n=name: f"{n} {k}: {m}")
        assert main(["verify", str(d / name)]) == 0
    # a disk layer's whole state is in each rank's shard store, with the single-process names, shard-sized
    program = load_plan(d / "mixed" / "plan")
    with TensorStore.open(shards.rank_dir(d / "mixed", 1, 2), read_only=True) as rs:
        assert rs.attributes()[LAYOUT_ATTR]["placement"] == ["ram", "ram", "disk", "disk"]
        for i in (2, 3):
            lo, hi, _ = shard_range(program.layer_numel(i), 1, 2)
            assert all(rs.array_info(f"layers/{i:04d}/{k}/g{g}").shape == (hi - lo,) for k in ("master", "m", "v") for g in (0, 1))


@pytest.mark.slow
def test_ram_layers_are_not_read_after_start_up_and_disk_layers_only_from_the_ranks_own_store(runs):
    d, _ = runs
    for rank in range(2):
        reads = _reads(d / "mixed-reads", rank)
        own = str(shards.rank_dir(d / "mixed", rank, 2))
        later = [(path, name) for path, name, phase in reads if phase == "step"]
        assert not [n for _, n in later if n.startswith(("layers/0000/", "layers/0001/"))], "a ram layer was read from a store"
        assert {p for p, _ in later} == {own}, "a disk layer was read from another store than this rank's"
        # every step reads each disk layer's master, m and v from the generation the last commit names
        for layer in (2, 3):
            for kind in ("master", "m", "v"):
                gens = [n[-1] for _, n in later if n.startswith(f"layers/{layer:04d}/{kind}/")]
                assert gens[:: len(gens) // STEPS] == ["0", "1", "0"], (layer, kind, gens)
        # the all-disk run reads nothing but its own shards during the steps either
        assert {p for p, _, phase in _reads(d / "disk-reads", rank) if phase == "step"} == {str(shards.rank_dir(d / "disk", rank, 2))}


@pytest.mark.slow
def test_a_new_run_writes_its_shards_from_page_aligned_memory(runs):
    """The store writes page-aligned memory with O_DIRECT, anything else through each I/O thread's
    bounce buffer (kept for the run, counted by no plan): a new data-parallel run wrote every rank's
    initial shards from torch-allocated copies and zeros."""
    d, _ = runs
    for name in ("disk", "mixed"):
        for rank in range(2):
            got = json.loads(Path(f"{d / name}-reads.rank-{rank}.unaligned.json").read_text())
            assert not [p for p, phase in got if phase == "start" and "/layers/" in p], (name, rank, got[:4])


@pytest.mark.slow
def test_kill_9_of_one_rank_then_relaunch_is_bit_identical(runs):
    d, tokens = runs
    store, log = d / "killed", d / "killed-reads"
    procs = _launch(2, d / "disk.json", store, tokens.path, log)
    commit = store / "commit.json"
    deadline = time.time() + 300
    while time.time() < deadline and not (commit.exists() and json.loads(commit.read_text() or "{}").get("step", 0) >= 1):
        assert all(p.poll() is None for p in procs), "a rank ended before the kill"
        time.sleep(0.01)
    procs[1].kill()  # mid-run: rank 1's disk shards may be half written into the other generation
    t0 = time.time()
    code = procs[0].wait(timeout=90)
    err = procs[0].stderr.read()
    # it stops at once: its disk ring's read-ahead, waiting for a set the failed update still held,
    # kept it 30 s in the ring's close (measured: 31.3 s, now 1.3 s, idle)
    assert code != 0 and time.time() - t0 < 20, (code, time.time() - t0, err[-2000:])
    assert "mtc: error:" in err
    procs[1].wait()
    assert json.loads(commit.read_text())["step"] < STEPS, "the kill came too late to interrupt the run"
    _wait(_launch(2, d / "disk.json", store, tokens.path, log))
    a, la, _ = _state(store)
    b, lb, _ = _state(d / "disk")
    assert la[-1] == lb[-1] and all(torch.equal(a[k], b[k]) for k in b), "the relaunched run differs from the unbroken one"


@pytest.mark.slow
def test_reshard_of_a_disk_tier_store_keeps_the_state_bit_identical(runs, tmp_path):
    d, tokens = runs
    store = tmp_path / "re"
    shutil.copytree(d / "mixed", store)
    before, _, _ = _state(store)
    assert main(["reshard", str(store), "--world-size", "3"]) == 0 and main(["verify", str(store)]) == 0
    mid, _, _ = _state(store)
    assert main(["reshard", str(store), "--world-size", "1"]) == 0 and main(["verify", str(store)]) == 0
    after, _, _ = _state(store)
    assert all(torch.equal(before[k], mid[k]) and torch.equal(before[k], after[k]) for k in before)  # m and v too
    with TensorStore.open(store, read_only=True) as st:  # one process sees the disk layers' full state and placement
        assert st.attributes()[LAYOUT_ATTR]["placement"] == ["ram", "ram", "disk", "disk"]
    # export of the disk-tier store equals the single-process run's export
    _assert_same_export(store, d / "ref", tmp_path)
    # the single-process layout opened by 2 ranks again (each copies its disk shards out of the full
    # arrays), one more step: as the reference run continued
    more = tmp_path / "more.json"
    more.write_text(json.dumps(_config(steps=STEPS + 1, placement=MIXED).to_dict()))
    _wait(_launch(2, more, store, tokens.path, tmp_path / "reads", "--allow-change", "steps"))
    ref = tmp_path / "ref"
    shutil.copytree(d / "ref", ref)
    train(_config(steps=STEPS + 1), ref, TokenFile.open(tokens.path), allow_change=("steps",)).store.close()
    with TensorStore.open(store, read_only=True) as st, TensorStore.open(ref, read_only=True) as rs:
        last, rlast = st.last_commit(), rs.last_commit()
        assert last.step == rlast.step == STEPS + 1 and shards.shard_world(last) == 2
        for i in range(4):
            for k in ("master", "m", "v"):
                got = shards.read_layer(store, last, i, k, rs.array_info(f"layers/{i:04d}/{k}/g{rlast.generation}").shape[0])
                torch.testing.assert_close(got, rs.read(f"layers/{i:04d}/{k}/g{rlast.generation}"), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_single_process_weights_commit_resumed_on_two_ranks_restarts_the_disk_layers_adam(tmp_path):
    """A single-process store of durability weights with disk layers, opened by 2 ranks: Adam
    restarts as the single process restarts it (zero moments, disk layers' too). Rank 1 used to stop
    at once (its load zeroed the disk moments in the run directory, which it opens read-only); and
    with the moments copied from the run directory's arrays (an older step's, no commit's) the
    ranks' weights ended ~5e-3 off the single process's."""
    tokens = skewed_tokens(tmp_path / "tok.bin")
    cfg = _config(steps=4, durability="weights", placement=MIXED)
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(cfg.to_dict()))
    train(cfg, tmp_path / "ref", tokens, stop_after=2).store.close()
    shutil.copytree(tmp_path / "ref", tmp_path / "w2")
    train(cfg, tmp_path / "ref", tokens).store.close()
    _wait(_launch(2, cfg_file, tmp_path / "w2", tokens.path, tmp_path / "reads"))
    program = load_plan(tmp_path / "ref" / "plan")
    with TensorStore.open(tmp_path / "w2", read_only=True) as st, TensorStore.open(tmp_path / "ref", read_only=True) as ref:
        last, rlast = st.last_commit(), ref.last_commit()
        assert last.step == rlast.step == 4 and shards.shard_world(last) == 2
        for i in range(program.n_layers):
            got = shards.read_layer(tmp_path / "w2", last, i, "master", program.layer_numel(i), root_store=st)
            want = ref.read(f"layers/{i:04d}/master/g{rlast.generation}")
            # (1e-4 as in test_data_parallel's weights resume: a fresh AdamW's first update is about
            # lr x the gradient's sign, so another reduction order moves a near-zero gradient's weight)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"layer {i}: {m}")


# -- placement and fit checks (fast) -------------------------------------------------------------


def test_data_parallel_placement_allows_disk_and_refuses_what_is_not_sharded(program):
    w2 = dist.World(1, 2, 1, 2)
    n = program.n_layers
    for placement in (["disk"] * n, ["ram"] * (n - 1) + ["disk"]):
        dist.check_placement(w2, placement, set(), program)
        assert dist.data_parallel_placement(w2, _config(placement="disk"), placement, set(), program)[0] == placement
    with pytest.raises(ConfigError, match="placement puts layers in gpu"):
        dist.check_placement(w2, ["gpu"] + ["disk"] * (n - 1), set(), program)
    with pytest.raises(ConfigError, match="disk_compute: 'store'"):
        dist.data_parallel_placement(w2, _config(placement="disk", disk_compute="store"), ["disk"] * n, set(), program)
    # auto with a generous per-rank budget: every layer sharded in RAM
    assert dist.data_parallel_placement(w2, _config(placement="auto", ram_budget_gb=64), ["gpu"] * n, set(), program)[0] == ["ram"] * n
    # a budget short of all-ram: the first layers that fit stay in RAM, the rest go to disk
    numels = [program.layer_numel(i) for i in range(n)]
    all_ram = sum(rank_host_bytes("ram", x, 2, 4) for x in numels)
    got = dist.data_parallel_placement(w2, _config(placement="auto", ram_budget_gb=(all_ram - 1) / 2**30), ["ram"] * n, set(), program)[0]
    assert "disk" in got and got == dp_auto_placement(numels, 2, 4, all_ram - 1)


def test_auto_placement_per_rank_fills_ram_in_forward_order_then_disk():
    gib = 2**30
    # 4 layers of 1 GiB-ish parameters (2**28) on 4 ranks, fp32 compute: a ram layer costs 12/4 + 8 = 11 B/param,
    # a disk layer 8 B/param, so RAM for two ram layers beside two disk ones is 2 x 11 + 2 x 8 = 38 x 2**28 B
    numels = [2**28] * 4
    assert dp_auto_placement(numels, 4, 4, 44 * 2**28) == ["ram"] * 4
    ring = 3 * 12 * 2**22  # three sets of one 4M-element chunk
    assert dp_auto_placement(numels, 4, 4, 38 * 2**28 + ring) == ["ram", "ram", "disk", "disk"]
    assert dp_auto_placement(numels, 4, 4, 38 * 2**28 + ring - 1) == ["ram", "disk", "disk", "disk"]
    assert dp_auto_placement(numels, 4, 4, 1 * gib) == ["disk"] * 4  # not even all-disk fits: the fit check says so


def test_launch_disk_check_counts_every_rank_of_the_host(program):
    """The shard stores of the ranks on one host share its disk: a disk layer's 24 B per shard parameter, per rank."""
    from mtc.costmodel import shape_from_program

    cfg = _config(placement="disk")
    shape = shape_from_program(program, cfg.model, 4)
    need_one = 24 * sum(-(-x // 2) for x in shape.numels)

    def disk_ok(local: int, free: int) -> bool:
        checks = check_fit_ranks(cfg, shape, ["disk"] * program.n_layers, 2, local, disk_free=free, host_available=2**40,
                                 gpu_total=None, where="free at X")
        return next(c for c in checks if c.what.startswith("disk")).ok

    assert disk_ok(1, need_one) and not disk_ok(1, need_one - 1)
    assert disk_ok(2, 2 * need_one) and not disk_ok(2, 2 * need_one - 1)


def test_a_disk_shard_holds_no_state_in_ram(program):
    """Host RAM of a rank's disk layer: the whole gradient and compute copy, never master, m or v
    (those cost the disk ring's sets only); as `rank_host_bytes` plans it, up to the padding."""
    from mtc.runtime.tiers import StateTiers

    placement = ["ram", "ram", "disk", "disk"]
    tiers = StateTiers(program, placement, torch.device("cpu"), torch.float32, rank=1, world_size=2)
    for s in tiers.layers[2:]:
        lo, hi, per = shard_range(s.numel, 1, 2)
        assert s.tier == "disk" and s.master is None and s.m is None and s.v is None and s.shard == (lo, hi)
        assert s.compute.numel() == 2 * per and s.grad.numel() == s.numel
    planned = sum(rank_host_bytes(t, program.layer_numel(i), 2, 4) for i, t in enumerate(placement))
    assert 0 <= planned - tiers.host_bytes() <= 4 * len(placement)  # the gradient's padding element per layer


def test_the_engine_plan_shards_the_disk_tier():
    """`mtc plan --world-size N` with disk placements: the ranks' disk and host RAM as the engine keeps them."""
    from mtc.calibrate import builtin
    from mtc.config import TrainConfig
    from mtc.costmodel import model_shape
    from mtc.dist_plan import make_dist_plan

    cfg = TrainConfig(model="tiny", micro_batch_size=2, seq_len=16, grad_accum=8, durability="weights")
    shape = model_shape(cfg, "bfloat16")
    prof = builtin("8x-h100")
    ram = make_dist_plan(dataclasses.replace(cfg, placement="ram"), prof, 8, shape=shape)
    disk = make_dist_plan(dataclasses.replace(cfg, placement="disk"), prof, 8, shape=shape)
    assert set(disk.placement) == {"disk"} and disk.gpu_update == set()
    shard = sum(-(-n // 8) for n in shape.numels)
    assert disk.memory.disk["weights"] == 24 * shard > ram.memory.disk["weights"]  # a disk layer keeps m and v
    assert disk.memory.gpu_state == 0 and disk.memory.host < ram.memory.host  # no state shard in RAM, gradient on the host
