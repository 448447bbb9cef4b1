"""`mtc plan --world-size N` and the per-rank fit check (issue 13: the planner's part)."""

from __future__ import annotations

import dataclasses

import pytest

from mtc.calibrate import builtin
from mtc.cli import main
from mtc.config import TrainConfig
from mtc.costmodel import adamw_rate, model_shape, step_time
from mtc.dist_plan import (
    DistPlan,
    Layout,
    Link,
    RankDist,
    check_fit_ranks,
    make_dist_plan,
    rank_memory,
    rank_profile,
    ring_bytes,
    scaling,
    shard_numels,
)
from mtc.errors import ConfigError
from mtc.planner import DISK_FREE_ENV, check_fit, make_plan
from mtc.runtime import placement as pl

# the tiny preset (~0.5M params), 8 micro-batches per step: splits over 1, 2, 4 and 8 ranks
CFG = TrainConfig(model="tiny", micro_batch_size=2, seq_len=16, grad_accum=8, durability="full")


@pytest.fixture(scope="module")
def shape():
    return model_shape(CFG, "bfloat16")


def _two_gpu_host():
    """The H100 box with two GPUs behind one PCIe uplink (the planner's host-sharing inputs)."""
    return dataclasses.replace(builtin("h100-box"), name="2x-h100", gpus_per_host=2, pcie_uplinks=1, peer_gbps=100.0)


def _cpu_host():
    """A 16-core CPU machine (gloo ranks), compute figures measured with all 16 threads."""
    return dataclasses.replace(builtin("h100-box"), name="cpu16", accelerator="cpu", gpu_memory_bytes=0, pcie_is_memcpy=True,
                               compute_threads=16, adamw_impl="exact")


def test_world_size_one_is_the_single_process_plan(shape, capsys):
    prof = builtin("h100-box")
    one = make_dist_plan(CFG, prof, 1, shape=shape)
    assert not isinstance(one, DistPlan) and one.lines() == make_plan(CFG, prof, shape=shape).lines()
    # the cost model's rank path at one rank (shards = layers, no collective time) times the same step
    p = make_plan(dataclasses.replace(CFG, placement="ram", gpu_update="none"), prof, shape=shape)
    d = RankDist(1, 1, shape.numels, True, Link("x", 100.0, 10.0), 0.0)
    st = step_time(p.cfg, shape, p.placement, p.gpu_update, prof, dist=d, saves=p.saves)
    assert st.step_s == p.step.step_s and st.stages() == {**p.step.stages(), "collectives": 0.0}
    args = ["plan", "tiny", "--machine", "h100-box", "--seq-len", "16", "--micro-batch-size", "2", "--no-extrapolate"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--world-size", "1"]) == 0
    assert capsys.readouterr().out == plain and "world:" not in plain


@pytest.mark.parametrize("engine", ["engine", "design"])
def test_ranks_divide_the_state(shape, engine):
    assert shard_numels((10, 8, 7), 4) == (3, 2, 2)  # ceil: the last shard is padded
    prof = _two_gpu_host()
    cfg = dataclasses.replace(CFG, placement="ram", gpu_update="none")
    one = make_plan(cfg, prof, shape=shape)
    c = shape.compute_bytes
    for w, nodes in ((2, 1), (4, 2), (8, 4)):
        p = make_dist_plan(cfg, prof, w, nodes=nodes, shape=shape, engine=engine)
        s = shard_numels(shape.numels, w)
        # a store per rank: each keeps both generations of its shards
        assert p.memory.disk == {"full": 24 * sum(s), "weights": 8 * sum(s), "none": 0}
        assert one.memory.disk["full"] / w <= p.memory.disk["full"] <= one.memory.disk["full"] / w + 24 * len(s)
        # both reduce-scatter on the GPU (NCCL), so only the gradient's shard comes to the host
        assert p.memory.host == sum(16 * si + c * n for si, n in zip(s, shape.numels, strict=True))
        # the rank's CPU AdamW updates its shard only; ranks on separate hosts each have a whole host's rate
        assert p.step.optimizer_s == pytest.approx(one.step.optimizer_s * p.layout.ranks_per_host / w, rel=0.01)


def test_the_engine_shards_the_gpu_ram_and_disk_tiers(shape):
    prof = builtin("8x-h100")
    auto = make_dist_plan(CFG, prof, 8, shape=shape)
    # NCCL on the GPUs; auto takes the GPU first from the rank's budget (the tiny model fits), never disk
    assert set(auto.placement) == {"gpu"} and auto.gpu_update == set() and auto.dist.reduce_scatter
    assert auto.engine.device_collectives and "nccl" in auto.dist.link.name
    tight = make_dist_plan(dataclasses.replace(CFG, gpu_budget_gb=1e-4), prof, 8, shape=shape)
    assert "ram" in tight.placement and "disk" not in tight.placement
    assert make_dist_plan(dataclasses.replace(CFG, placement="gpu"), prof, 8, shape=shape).placement == ["gpu"] * shape.n_layers
    assert make_dist_plan(dataclasses.replace(CFG, placement="disk"), prof, 8, shape=shape).placement == ["disk"] * shape.n_layers
    with pytest.raises(ConfigError, match="--placement ram and --gpu-update none"):  # gloo in host memory: no gpu tier
        make_dist_plan(dataclasses.replace(CFG, placement="gpu"), prof, 8, shape=shape, engine="host")
    assert make_dist_plan(dataclasses.replace(CFG, placement="ram", gpu_update="1-2"), prof, 8, shape=shape).gpu_update == {1, 2}
    with pytest.raises(ConfigError, match="gpu_update '1-2' names layers"):  # gloo in host memory: the host updates
        make_dist_plan(dataclasses.replace(CFG, placement="ram", gpu_update="1-2"), prof, 8, shape=shape, engine="host")
    with pytest.raises(ConfigError, match="durability 'none' cannot run on several ranks"):
        make_dist_plan(dataclasses.replace(CFG, durability="none"), prof, 8, shape=shape)
    design = make_dist_plan(CFG, prof, 8, shape=shape, engine="design")
    assert "gpu" in design.placement and design.dist.reduce_scatter  # the tiny model fits the GPUs


def test_ranks_on_one_host_share_its_cpu(shape):
    prof = _two_gpu_host()
    host = adamw_rate(prof, 0)
    rank = adamw_rate(rank_profile(prof, Layout.of(2, 1, prof)), 0)
    assert rank == pytest.approx(host / 2)  # two ranks together: the host's rate, not double it
    assert adamw_rate(rank_profile(prof, Layout.of(2, 2, prof)), 0) == host  # one rank per host: all of it
    cfg = dataclasses.replace(CFG, placement="ram", gpu_update="none")
    one = make_plan(cfg, prof, shape=shape).step.optimizer_s
    shared = make_dist_plan(cfg, prof, 2, nodes=1, shape=shape).step.optimizer_s
    apart = make_dist_plan(cfg, prof, 2, nodes=2, shape=shape).step.optimizer_s
    assert shared == pytest.approx(one, rel=0.01) and apart == pytest.approx(one / 2, rel=0.01)
    # one uplink for both GPUs: each rank gets half of it
    assert rank_profile(prof, Layout.of(2, 1, prof)).both_gbps == prof.both_gbps / 2
    # CPU ranks split the cores; compute measured with 16 threads runs slower on 8
    cpu = _cpu_host()
    r = rank_profile(cpu, Layout.of(2, 1, cpu))
    assert r.cores == 8 and r.compute_threads == 8 and r.other_scale_fwd == 2 * cpu.other_scale_fwd
    assert r.store_write_gbps == cpu.store_write_gbps / 2 and r.host_available_bytes == cpu.host_available_bytes // 2
    # a store per rank: the ranks of a host share its disk
    assert rank_profile(cpu, Layout.of(2, 1, cpu)).store_write_gbps == cpu.store_write_gbps / 2


def test_scaling_names_the_shared_resource_that_limits_it():
    # a compute-bound CPU run: ranks on one host split its cores, ranks on their own hosts do not
    cpu = dataclasses.replace(_cpu_host(), other_scale_fwd=1e4, other_scale_bwd=1e4)
    sh = model_shape(CFG, "float32")
    shared = "\n".join(scaling(CFG, cpu, sh, 8, (1, 2, 4)))
    assert "limits scaling at N=4" in shared and "compute (CPU): the ranks of a host share its cores" in shared, shared
    apart = scaling(CFG, cpu, sh, 1, (1, 2, 4))
    row4 = next(line for line in apart if line.split()[:3] == ["4", "4", "x"])
    assert float(row4.split()[7].rstrip("%")) >= 90, apart  # near-linear: each rank has a whole host


def test_collective_bytes_follow_the_ring_formula(shape):
    for n in (2, 3, 8):
        assert ring_bytes("all_reduce", 1000.0, n) == pytest.approx(2 * (n - 1) / n * 1000)
        assert ring_bytes("reduce_scatter", 1000.0, n) == ring_bytes("all_gather", 1000.0, n) == pytest.approx((n - 1) / n * 1000)
    link = Link("l", 50.0, 20.0)
    assert link.seconds("all_reduce", 4e9, 4) == pytest.approx(1.5 * 4e9 / 50e9 + 6 * 20e-6)
    assert link.seconds("all_gather", 4e9, 1) == 0.0
    prof = _two_gpu_host()
    padded = 4 * sum(shard_numels(shape.numels, 4))
    p = make_dist_plan(CFG, prof, 4, nodes=2, shape=shape, engine="design")
    assert p.collective_bytes() == {"gradient reduce-scatter (fp32)": pytest.approx(0.75 * 4 * padded),
                                    "weights all-gather (bf16)": pytest.approx(0.75 * 2 * padded)}
    link = p.dist.link  # two hosts of two ranks: the slower of the GPUs' peer link and the network
    assert link.gbps == min(prof.peer_gbps, 12.5) and any("network" in a for a in p.assumed)
    busy = sum(link.seconds("reduce_scatter", 4 * 4 * s, 4) + link.seconds("all_gather", 2 * 4 * s, 4)
               for s in shard_numels(shape.numels, 4) if s)
    assert p.step.stages()["collectives"] == pytest.approx(busy)
    # the engine on CUDA: NCCL, as the design
    e = make_dist_plan(CFG, prof, 4, nodes=2, shape=shape)
    assert e.dist.link == p.dist.link and e.collective_bytes() == p.collective_bytes()
    # dp_collectives host (gloo in host memory): the whole gradient crosses to the host, gloo reduce-scatters it
    g = make_dist_plan(CFG, prof, 4, nodes=2, shape=shape, engine="host")
    assert g.collective_bytes()["gradient reduce-scatter (fp32)"] == pytest.approx(0.75 * 4 * padded)
    assert g.dist.link.gbps == 2.0 and "gloo" in g.dist.link.name  # loopback gloo is slower than the network here
    busy = sum(g.dist.link.seconds("reduce_scatter", 4 * 4 * s, 4) + g.dist.link.seconds("all_gather", 2 * 4 * s, 4)
               for s in shard_numels(shape.numels, 4) if s)
    assert g.step.stages()["collectives"] == pytest.approx(busy)
    one_host = make_dist_plan(CFG, dataclasses.replace(prof, gloo_gbps=0.7), 2, nodes=1, shape=shape, engine="host")
    assert one_host.dist.link.gbps == 0.7 and not any("loopback" in a for a in one_host.assumed)  # `mtc calibrate` measured it
    c = make_dist_plan(CFG, _cpu_host(), 2, shape=model_shape(CFG, "float32"))
    assert c.layout.backend == "gloo" and next(iter(c.collective_bytes())) == "gradient reduce-scatter (fp32)"


def test_fit_check_counts_each_rank_and_the_host(shape, monkeypatch, tmp_path):
    placement = ["ram"] * shape.n_layers
    one = check_fit_ranks(CFG, shape, placement, 2, 1, disk_free=10**12, host_available=10**12, gpu_total=80 * 2**30, where="x")
    two = check_fit_ranks(CFG, shape, placement, 2, 2, disk_free=10**12, host_available=10**12, gpu_total=80 * 2**30, where="x")
    need = {c.what.split(" (")[0]: c.need for c in one}
    need2 = {c.what.split(" (")[0]: c.need for c in two}
    assert need2["host RAM"] == 2 * need["host RAM"]  # two ranks of one host: their RAM adds up
    # a store per rank: two ranks of one host keep their shards' generations on its disk
    assert need2["disk"] == 2 * need["disk"] and need2["GPU memory per rank"] == need["GPU memory per rank"]
    mem = rank_memory(dataclasses.replace(CFG, grad_accum=4), shape, placement, 2, cuda=True)
    # each rank is a process with its own store: its bounce buffers and the process overhead count
    # beside its engine, per rank, in what the host must hold
    assert mem.store_io > 0 and mem.process == pl.PROCESS_HOST_BYTES
    assert need["disk"] == mem.disk["full"] and need["host RAM"] == mem.host + mem.store_io + mem.process
    host_line = next(c.what for c in two if c.what.startswith("host RAM"))
    assert "process overhead" in host_line and "store I/O bounce buffers" in host_line
    for have, ok in ((2 * mem.host_total, True), (2 * mem.host_total - 2**20, False)):
        checks = check_fit_ranks(CFG, shape, placement, 2, 2, disk_free=10**12, host_available=have, gpu_total=80 * 2**30, where="x")
        assert next(c.ok for c in checks if c.what.startswith("host RAM")) is ok
    # `mtc train`'s preflight under torchrun: a RAM budget that holds one rank's shards, not the whole state
    from mtc.tracer import trace
    from mtc.train import build_model

    cfg = dataclasses.replace(CFG, placement="ram", compute_dtype="float32", device="cpu")
    program = trace(build_model(cfg, device="meta"), cfg.micro_batch_size, cfg.seq_len)
    cshape = model_shape(cfg, "float32", program=program)
    rank_need = rank_memory(dataclasses.replace(cfg, grad_accum=4), cshape, placement, 2, cuda=False).host
    whole = make_plan(dataclasses.replace(cfg, durability="full"), _cpu_host(), shape=cshape).memory.host
    assert rank_need < whole
    cfg = dataclasses.replace(cfg, ram_budget_gb=(rank_need + whole) / 2 / 2**30)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_fit(cfg, program, placement, set(), tmp_path / "store", new_run=True)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match="this run does not fit: host RAM"):  # one process holds all of it
        check_fit(cfg, program, placement, set(), tmp_path / "store", new_run=True)
    # a store per rank: the two ranks of this host keep their shards' generations on its disk (the
    # whole store between them, plus padding), so a disk one byte short of the whole store is short
    monkeypatch.setenv(DISK_FREE_ENV, str(need["disk"] - 1))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"this run does not fit: disk .*2 rank\(s\) x"):
        check_fit(dataclasses.replace(cfg, ram_budget_gb=None), program, placement, set(), tmp_path / "store", new_run=True)


def test_plan_cli_world_size(capsys):
    base = ["plan", "tiny", "--machine", "h100-box", "--seq-len", "16", "--micro-batch-size", "2", "--grad-accum", "8",
            "--no-extrapolate"]
    assert main([*base, "--world-size", "2", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "world: 2 ranks = 2 host(s) x 1 rank(s)" in out and "collectives per step" in out and "--dp-model engine" in out
    assert "tokens/s per GPU" in out and "per host (1 ranks)" in out
    rows = [line.split()[0] for line in out.splitlines() if line.strip() and line.split()[0] in ("1", "2", "4", "8")]
    assert rows == ["1", "2", "4", "8"] and "limits scaling at N=8" in out
    assert "assumed: network 12.5 GB/s per host" in out
    assert main([*base, "--world-size", "2", "--nodes", "2", "--dp-model", "design"]) == 0
    assert "collectives (nccl: network)" in capsys.readouterr().out
    for bad, words in ((["--world-size", "2"], "--nodes 2"), (["--world-size", "3", "--nodes", "2"], "multiple of the node count"),
                       (["--world-size", "3", "--nodes", "3"], "--grad-accum a multiple of 3"),
                       (["--world-size", "2", "--nodes", "2", "--durability", "none"], "--durability weights or full")):
        assert main([*base, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mtc: error: ") and words in err[0], err


def test_layout_refuses_more_ranks_than_gpus():
    with pytest.raises(ConfigError, match="8x-h100"):
        Layout.of(4, 1, builtin("h100-box"))
    assert Layout.of(8, 1, builtin("8x-h100")).ranks_per_host == 8
    assert Layout.of(16, 2, builtin("8x-h100")).backend == "nccl"


# -- bench_train.py --world-size (bench/dp_runs.py): the parts that need no launch ---------------


def _dp_runs():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import dp_runs

    return dp_runs


def test_bench_world_size_commands_and_metrics(tmp_path):
    dp = _dp_runs()
    assert [n for n, _ in dp.settings(2)] == ["plain", "torchrun-1", "torchrun-2"] and len(dp.settings(1)) == 2
    plain = dp.train_argv(tmp_path / "run.json", tmp_path / "s", tmp_path / "d.bin", None)
    two = dp.train_argv(tmp_path / "run.json", tmp_path / "s", tmp_path / "d.bin", 2)
    assert plain[1:3] == ["-m", "mtc"] and two[1:3] == ["-m", "torch.distributed.run"]
    assert two[two.index("--nproc-per-node") + 1] == "2" and two[-8:] == plain[-8:]  # the same `mtc train` flags
    # two ranks' metrics (any layout under the store): warm-up dropped, the slower rank sets the step
    for rank, secs in ((0, [9.0, 1.0, 1.2, 1.1]), (1, [9.0, 1.3, 1.4, 1.5])):
        logs = tmp_path / "s" / f"rank{rank}" / "logs"
        logs.mkdir(parents=True)
        (logs / "metrics.jsonl").write_text("".join(f'{{"step": {i + 1}, "seconds": {x}}}\n' for i, x in enumerate(secs)))
    per_file = dp.step_seconds(tmp_path / "s", warmup=1)
    assert per_file == {"rank0/logs/metrics.jsonl": [1.0, 1.2, 1.1], "rank1/logs/metrics.jsonl": [1.3, 1.4, 1.5]}
    s = dp.summarize("torchrun-2", 2, per_file, tokens_per_step=1000)
    assert s["median_step_s"] == 1.4 and s["tokens_per_s_per_rank"] == pytest.approx(500 / 1.4)
    assert "error" in dp.summarize("x", 1, {"a": []}, 1000)
    runs = [{"setting": "plain", "tokens_per_s_per_rank": 100.0}, {"setting": "torchrun-1", "tokens_per_s_per_rank": 99.0},
            {"setting": "torchrun-2", "error": "no engine"}]
    assert dp.ratios(runs, 2) == {"torchrun_1_over_plain": 0.99, "goal_torchrun_1_over_plain": 0.98,
                                  "torchrun_2_per_rank_over_plain": None}
    mid = dp.median_round([{"tokens_per_s_per_rank": 5.0, "tokens_per_s": 5.0, "median_step_s": 2.0}, {"error": "x"},
                           {"tokens_per_s_per_rank": 8.0, "tokens_per_s": 8.0, "median_step_s": 1.0}])
    assert mid["median_step_s"] == 1.5 and mid["tokens_per_s_per_rank"] == 6.5 and mid["rounds_median_step_s"] == [2.0, None, 1.0]
    import importlib.util

    assert (dp.dist_engine_missing() is None) == (importlib.util.find_spec("mtc.dist") is not None)


def test_bench_world_size_puts_the_plans_prediction_beside(tmp_path, monkeypatch, shape):
    import mtc.calibrate

    dp = _dp_runs()
    monkeypatch.setattr(mtc.calibrate, "DEFAULT_PROFILE_PATH", tmp_path / "machine.json")
    assert "mtc calibrate" in dp.predicted(CFG, 2)["error"]
    _two_gpu_host().save(tmp_path / "machine.json")
    pred = dp.predicted(CFG, 2)
    tokens = CFG.grad_accum * CFG.micro_batch_size * CFG.seq_len
    assert pred["profile"] == "2x-h100" and set(pred) >= {"world_1", "world_2"}
    assert pred["world_2"]["step_s"] == make_dist_plan(CFG, _two_gpu_host(), 2, shape=shape).step.step_s
    assert pred["world_1"]["tokens_per_s_per_rank"] == pytest.approx(tokens / make_plan(CFG, _two_gpu_host(), shape=shape).step.step_s)


@pytest.mark.slow  # one real `python -m mtc train` (~10 s)
def test_bench_world_size_reads_a_real_runs_metrics(tmp_path):
    import json

    from tests.runtime.engine_util import skewed_tokens

    dp = _dp_runs()
    skewed_tokens(tmp_path / "d.bin")
    cfg = dataclasses.replace(CFG, grad_accum=2, steps=3, durability="none", device="cpu", compute_dtype="float32")
    (tmp_path / "run.json").write_text(json.dumps(cfg.to_dict()))
    r = dp.run_setting("plain", None, config=tmp_path / "run.json", data=tmp_path / "d.bin", root=tmp_path, warmup=1,
                       tokens_per_step=2 * 2 * 16, timeout_s=300)
    assert r["returncode"] == 0 and list(r["median_step_s_by_file"]) == ["logs/metrics.jsonl"], r
    assert r["tokens_per_s_per_rank"] == pytest.approx(64 / r["median_step_s"])


def test_ranks_on_the_cpu_count_their_steps_compute_and_auto_placement_leaves_room_for_it(monkeypatch):
    """On the CPU device each rank computes its micro-batches in host RAM: the rank's fit check
    counts it beside the engine, and the ranks' automatic placement (`rank_ram_budget`, as
    `mtc.dist` takes it at run time) puts layers on disk rather than past the host's memory."""
    from mtc.planner import cpu_compute_bytes
    from mtc.runtime.dp_placement import rank_ram_budget

    cfg = TrainConfig(model="tiny", micro_batch_size=4, seq_len=256, grad_accum=2, durability="none", placement="auto",
                      model_overrides={"max_seq_len": 256, "dim": 512, "ffn_dim": 2048, "n_heads": 8, "n_kv_heads": 8})
    shape = model_shape(cfg, "float32")
    rcfg = dataclasses.replace(cfg, grad_accum=1)  # one rank's share of two micro-batches
    compute = cpu_compute_bytes(rcfg, shape)
    ram = ["ram"] * shape.n_layers
    mem = rank_memory(rcfg, shape, ram, 2, cuda=False)
    assert mem.compute == compute > 0
    # a host whose default budget (available less 2 GiB) holds both ranks' state in RAM, but not beside their steps
    from mtc.runtime.dp_placement import rank_host_bytes

    all_ram = sum(rank_host_bytes("ram", n, 2, shape.compute_bytes) for n in shape.numels)  # as dp_auto_placement counts it
    avail = 2 * all_ram + compute + 2 * 2**30
    monkeypatch.setattr(pl, "available_host_bytes", lambda: avail)
    assert rank_ram_budget(cfg, 2) > all_ram > rank_ram_budget(cfg, 2, compute)

    def host_check_on(c: TrainConfig, have: int):
        checks = check_fit_ranks(c, shape, ram, 2, 2, disk_free=10**12, host_available=have, gpu_total=None, where="x")
        return next(ch for ch in checks if ch.what.startswith("host RAM"))

    def host_check(c: TrainConfig):
        return host_check_on(c, avail)

    auto = host_check(cfg)
    assert auto.ok and "disk" in auto.what and "compute on the CPU" in auto.what, auto.line()
    # all in RAM, as told: both ranks' engines, with their steps beside them, against what the host has
    told = host_check(dataclasses.replace(cfg, placement="ram"))
    assert told.need == 2 * mem.host_total and "compute on the CPU" in told.what, told.line()
    assert not host_check_on(dataclasses.replace(cfg, placement="ram"), told.need - 2**20).ok


def test_mtc_plan_of_cpu_ranks_leaves_room_for_their_steps_compute():
    """`mtc plan --world-size N` on a CPU machine profile places each rank's layers in RAM only as
    far as its share of the host holds them beside its step's compute, and takes the same
    placement as the run (`rank_ram_budget`: one default margin per host, not per rank: a plan
    that took 2 GiB off each rank's share put every layer on disk where the run kept all in RAM)."""
    from mtc.planner import cpu_compute_bytes
    from mtc.runtime.dp_placement import dp_auto_placement, rank_host_bytes, rank_ram_budget

    cfg = TrainConfig(model="tiny", micro_batch_size=4, seq_len=256, grad_accum=2, durability="weights", placement="auto",
                      model_overrides={"max_seq_len": 256, "dim": 512, "ffn_dim": 2048, "n_heads": 8, "n_kv_heads": 8})
    shape = model_shape(cfg, "float32")
    compute = cpu_compute_bytes(dataclasses.replace(cfg, grad_accum=1), shape)  # one rank's share of the micro-batches
    all_ram = sum(rank_host_bytes("ram", n, 2, shape.compute_bytes) for n in shape.numels)
    # one host, two ranks: the default margin (2 GiB on a host this small) comes off the host, then
    # each rank gets half of the rest, less its step's compute
    placements = {}
    for name, avail in {"tight": 2 * all_ram + compute + 2 * 2**30, "roomy": 2 * all_ram + 3 * compute + 2 * 2**30,
                        "small": all_ram + 2 * 2**30 + 2 * compute}.items():
        assert avail * 0.15 < 2 * 2**30  # (the margin is 2 GiB here, not 15 %)
        plan = make_dist_plan(cfg, dataclasses.replace(_cpu_host(), host_available_bytes=avail), 2, shape=shape).placement
        run = dp_auto_placement(list(shape.numels), 2, shape.compute_bytes, rank_ram_budget(cfg, 2, compute, available=avail))
        assert plan == run, (name, plan, run)
        placements[name] = plan
    assert set(placements["roomy"]) == {"ram"}
    assert "disk" in placements["tight"]
