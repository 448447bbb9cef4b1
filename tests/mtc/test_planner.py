"""`mtc plan`, `mtc calibrate` and the early fit refusals of `mtc train` (issue 11, musts 3 and 4)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from mtc.calibrate import (COMMIT_FILE_ASSUMED, COMMIT_FILE_S, COMMIT_LATENCY_ASSUMED, COMMIT_LATENCY_S, MachineProfile, builtin,
                           calibrate)
from mtc.cli import main
from mtc.config import TrainConfig
from mtc.errors import ConfigError
from mtc.planner import DISK_FREE_ENV, extrapolations, largest_fit, make_plan
from mtc.runtime import placement as pl
from tests.runtime.engine_util import skewed_tokens


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "d.bin"
    skewed_tokens(path)
    return path


def _train(tmp_path, data, *extra):
    return main(["train", "--preset", "tiny", "--store", str(tmp_path / "s"), "--data", str(data), "--unfused", "--steps", "1",
                 "--micro-batch-size", "2", "--seq-len", "16", *extra])


def test_train_refuses_a_small_disk_before_creating_the_store(tmp_path, data, capsys, monkeypatch):
    monkeypatch.setenv(DISK_FREE_ENV, str(5 * 2**20))  # 5 MiB: 'full' needs 18.4, 'weights' 6.1
    assert _train(tmp_path, data) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("mtc: error: this run does not fit: disk")
    assert "needs 18.4 MiB, has 5.0 MiB" in err[0] and "choose --durability none" in err[0]
    assert not (tmp_path / "s").exists()
    monkeypatch.setenv(DISK_FREE_ENV, str(7 * 2**20))  # now 'weights' fits: the message names it
    assert _train(tmp_path, data) == 2
    assert "choose --durability weights" in capsys.readouterr().err
    assert _train(tmp_path, data, "--durability", "weights") == 0
    assert (tmp_path / "s" / "commit.json").exists()


def test_a_resume_is_checked_too_counting_the_state_the_store_holds(tmp_path, data, capsys, monkeypatch):
    """A weights run resumed with durability full needs moments on disk too: refused with the
    numbers before any array is created; the same resume in weights mode fits (its state is there)."""
    monkeypatch.setenv(DISK_FREE_ENV, str(7 * 2**20))
    assert _train(tmp_path, data, "--durability", "weights", "--steps", "4", "--stop-after", "2") == 0
    capsys.readouterr()
    arrays = sorted(p.name for p in (tmp_path / "s" / "layers" / "0000").iterdir())
    monkeypatch.setenv(DISK_FREE_ENV, str(1 * 2**20))  # the store's own 6 MiB of master count as free
    assert _train(tmp_path, data, "--durability", "full", "--steps", "4") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtc: error: this run does not fit: disk"), err
    assert "needs 18.4 MiB" in err[0] and "of state the store holds already" in err[0], err
    assert sorted(p.name for p in (tmp_path / "s" / "layers" / "0000").iterdir()) == arrays  # nothing created
    assert _train(tmp_path, data, "--durability", "weights", "--steps", "4") == 0


def test_train_refuses_a_small_ram_budget_and_names_a_placement_that_fits(tmp_path, data, capsys, monkeypatch):
    # 14 blocks: deep enough that disk layers (4 B/param on the CPU, plus fixed pipeline buffers)
    # need less host RAM than ram layers (16 B/param): all-disk ~24 MiB, all-ram ~45 MiB
    cfg = TrainConfig(model="tiny", model_overrides={"n_layers": 14}, micro_batch_size=2, seq_len=16, steps=1, kernels="unfused")
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(cfg.to_dict()))

    def run(*extra):
        return main(["train", "--config", str(cfg_file), "--store", str(tmp_path / "s"), "--data", str(data), *extra])

    monkeypatch.setenv(DISK_FREE_ENV, str(2**20))
    assert run("--ram-budget-gb", "0.001") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err  # both resources are short: one line each
    assert "disk" in err[0] and "host RAM" in err[1] and "even with every layer on disk the run needs" in err[1], err
    assert not (tmp_path / "s").exists()
    monkeypatch.delenv(DISK_FREE_ENV)
    assert run("--ram-budget-gb", "0.03", "--placement", "ram") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "host RAM" in err[0] and "has 30.7 MiB" in err[0], err
    assert not (tmp_path / "s").exists()
    suggested = err[0].split("--placement ")[1].split(")")[0]
    assert "disk" in suggested and "ram" in suggested, suggested
    # what the message says to change makes the run fit
    assert run("--ram-budget-gb", "0.03", "--placement", suggested) == 0
    assert (tmp_path / "s" / "commit.json").exists()


def test_gpu_too_small_for_one_layers_workspace_is_a_failed_check():
    cfg = TrainConfig(model="8b", seq_len=8192, micro_batch_size=16, placement="ram", durability="none")
    plan = make_plan(cfg, builtin("h100-box"))
    gpu = [c for c in plan.checks if c.what.startswith("GPU memory")]
    assert len(gpu) == 1 and not gpu[0].ok
    assert gpu[0].need > 80 * 2**30 and "--micro-batch-size" in gpu[0].line()
    assert not plan.fits


def test_plan_cli_on_a_builtin_machine(capsys):
    # without CUDA-graph buffers (0.8 GiB of workspace: with them one more block goes to disk and
    # no durability mode fits the 60 GiB, which is not what this test is about)
    rc = main(["plan", "8b", "--machine", "h100-box", "--seq-len", "4096", "--micro-batch-size", "2", "--grad-accum", "8",
               "--no-extrapolate", "--cuda-graphs", "off", "--ram-budget-gb", "70"])
    out = capsys.readouterr().out
    assert rc == 1  # 'full' needs ~180 GiB of disk, the box has 60
    assert "placement gpu:" in out and "durability full    needs   179.5 GiB" in out
    # a 70 GiB RAM budget leaves ~1.8B parameters on disk, whose state every mode keeps: only
    # 'none' fits the 60 GiB
    assert "DOES NOT FIT" in out and "choose --durability none" in out and ",disk:" in out
    assert "bottleneck:" in out and "per day of training" in out
    for stage in ("GPU compute", "PCIe", "CPU optimizer", "disk I/O"):
        assert stage in out
    assert main(["plan", "8b", "--machine", "h100-box", "--seq-len", "4096", "--micro-batch-size", "2", "--grad-accum", "8",
                 "--durability", "none", "--no-extrapolate", "--cuda-graphs", "off", "--ram-budget-gb", "70"]) == 0


def test_plan_cli_errors_are_one_line(capsys, tmp_path):
    assert main(["plan", "tiny", "--machine", "nope"]) == 2
    assert main(["plan", "tiny", "--machine", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x", "bogus": 1}))
    assert main(["plan", "tiny", "--machine", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("mtc: error: ") for e in err)
    assert "mtc calibrate" in err[1] and "unknown field" in err[2]


def test_extrapolations_say_plainly_what_does_not_fit():
    lines = extrapolations()
    text = "\n".join(lines)
    assert "70b (70.6B params) on h200-1.5tb" in text and "119.3B params" in text and "175.1B params" in text
    block_175 = text[text.index("175b"):]
    # 24 B/param of state and, since 175B parameters' gradients (0.7 TB) cannot wait on an 80 GB
    # GPU, 4 B/param of gradient scratch in the store; 256 GiB of RAM cannot hold the disk layers'
    # bf16 copy (0.35 TB), so they are read per visit, which leaves RAM for the first 7 layers
    assert "durability full    disk    4.86 TB: does NOT fit: disk needs 4.86 TB, has 4.00 TB" in block_175
    # (the visits' fp32 staging: two slots of the largest layer, the untied embedding, 11.7 GiB)
    assert "placement ram:0-6,disk:7-113;" in block_175 and "host RAM 192.8 GiB of 248.0 GiB" in block_175
    # without durability the disk layers keep one generation (12 B/param + the 4 of gradient scratch): it fits
    assert "durability none    disk    2.63 TB: fits" in block_175
    assert "GPU peak 71.9 GiB of 79.6 GiB" in block_175  # (a block's joint graph keeps no output buffer)
    block_70 = text[text.index("70b"):text.index("120b")]
    assert "durability full    disk    1.69 TB: fits" in block_70


def test_largest_model_on_the_h100_box():
    sizes = largest_fit(builtin("h100-box"))
    assert sizes["none"] >= sizes["weights"] >= sizes["full"] > 0
    # two generations of master, m and v (24 B/param) in a 60 GiB disk: ~2.3-2.7B (issue 11)
    assert 2.0e9 < sizes["full"] < 2.8e9


def test_calibrate_small_is_bounded_and_round_trips(tmp_path):
    t = time.perf_counter()
    prof = calibrate(directory=tmp_path, copy_mb=8, disk_mb=8, adamw_numel=500_000, matmul_size=256, repeats=1)
    assert 0 < prof.calibrate_s <= time.perf_counter() - t < 120  # ~5 s on the 2-core box when it is quiet
    assert prof.pcie_is_memcpy and any("memcpy" in a for a in prof.assumed)
    for v in (prof.h2d_gbps, prof.disk_write_gbps, prof.disk_read_gbps, prof.store_write_gbps, prof.store_write_busy_gbps,
              prof.store_both_gbps, prof.adamw_rate, prof.matmul_tflops, prof.gloo_gbps, prof.commit_latency_s):
        assert v > 0
    assert COMMIT_LATENCY_ASSUMED not in prof.assumed  # measured: a real commit's wall time
    assert prof.commit_file_s >= 0 and COMMIT_FILE_ASSUMED not in prof.assumed  # and its slope over more files
    assert prof.store_both_gbps >= prof.store_write_busy_gbps  # the busy writes' bytes, and the reads' beside them
    assert prof.identity["host"] and prof.identity["torch"]
    assert prof.reference_block["joint_s"] > prof.reference_block["fwd_s"] > 0
    assert list(tmp_path.iterdir()) == []  # its files are removed
    back = MachineProfile.load(prof.save(tmp_path / "p.json"))
    assert back == prof


def test_calibrate_says_when_the_machine_was_busy():
    """On a busy machine the intra-op threads' barriers stall (a descheduled thread holds the
    others for a scheduler tick), and calibrate's compute figures came out up to 100x too slow:
    `mtc plan` put the tiny preset's step at 2.76 s where it trained at 0.30 s (load average 8-10
    on the 2-core VM). Nothing said so; now the profile does, and the plan prints it."""
    from mtc.calibrate import BUSY_SPREAD, BUSY_THREADS, STEADY_PROBE_N, busy_reason

    quiet = (1.25e-3, 1.2e-3, 2.2e-3)  # (median, best, best on one thread) of the 512^3 probe on a quiet 2-core box
    assert busy_reason([quiet, quiet], 2, 0.3, 2) == ""
    stalled = (BUSY_SPREAD * 1.1 * 1.2e-3, 1.2e-3, 2.2e-3)  # most calls waited on a descheduled thread
    why = busy_reason([quiet, stalled], 2, 1.5, 2)
    assert why.startswith(f"the machine was busy while calibrating (a {STEADY_PROBE_N}^3 matmul timed around the compute figures "
                          f"took {BUSY_SPREAD * 1.1:.1f}x its best time at the median)") and "re-run `mtc calibrate`" in why
    every_call = (8.1e-3, 8.0e-3, 2.2e-3)  # every call stalled: steady, but slower on two threads than on one
    assert f"took {8.0 / 2.2:.1f}x as long at best on 2 threads as on one" in busy_reason([every_call, quiet], 2, 1.5, 2)
    assert busy_reason([(1.0, 1.0, 1.0 / (BUSY_THREADS * 0.9))], 2, 0.0, 2) == ""  # the thread check needs more than a hair
    # on one thread nothing stalls, but beside other jobs a run gets a share of the cores, not the best samples' speed
    assert busy_reason([every_call], 1, 1.5, 2) == ""
    assert busy_reason([quiet], 1, 9.5, 2).startswith("the machine was busy while calibrating (load average 9.5 on 2 cores)")
    prof = dataclasses.replace(builtin("h100-box"), busy=why)
    assert f"  warning: {why}" in make_plan(TrainConfig(model="tiny"), prof).lines()
    assert MachineProfile.from_dict(prof.to_dict()).busy == why
    assert not any("warning" in line for line in make_plan(TrainConfig(model="tiny"), builtin("h100-box")).lines())


def test_the_steadiness_probe_sees_a_busy_machine():
    """The probe itself, with the cores oversubscribed by busy loops (as a shared box is by its
    neighbours): a machine this busy never reads steady."""
    import os
    import subprocess
    import sys

    import torch

    from mtc.calibrate import _steady_probe, busy_reason

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: no intra-op threads to stall")
    burn = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * cores)]
    caller = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        time.sleep(0.2)  # (the burners are running)
        probes = [_steady_probe(torch) for _ in range(2)]
    finally:
        torch.set_num_threads(caller)
        for p in burn:
            p.kill()
            p.wait()
    assert busy_reason(probes, cores, 0.0, cores), probes  # (the probes alone, whatever the load average says)


def test_commit_pacing_counts_a_commits_fixed_latency():
    """The run commits once 20 commit durations have passed since the last began; a commit lasts its
    bytes at the store's rate plus a fixed cost (fsyncs, renames, the record), most of a small
    model's commit. Counting the bytes alone, the plan paced a tiny model's commits several times
    more often than the run did."""
    cfg = TrainConfig(model="tiny", placement="ram", commit_every=0)
    prof = builtin("h100-box")
    bare = make_plan(cfg, dataclasses.replace(prof, commit_latency_s=0.0, commit_file_s=0.0)).step
    latency = 0.15
    paced = make_plan(cfg, dataclasses.replace(prof, commit_latency_s=latency, commit_file_s=0.0)).step
    assert paced.commits.bytes_per_commit == bare.commits.bytes_per_commit > 0
    assert bare.commits.seconds == pytest.approx(bare.commits.bytes_per_commit / (prof.store_write_gbps * 1e9))
    assert paced.commits.seconds == pytest.approx(bare.commits.seconds + latency)
    base = paced.step_s - paced.commits.stall_s  # the step without the commit's stall
    assert abs(paced.commits.every - 20 * paced.commits.seconds / base) <= 1 and paced.commits.every > bare.commits.every


def test_a_profile_saved_before_the_commit_latency_was_measured_loads_with_the_stated_default(tmp_path):
    path = _this_host_profile(tmp_path / "machine.json")
    old = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("commit_latency_s", "commit_file_s")}
    path.write_text(json.dumps({**old, "assumed": []}))
    prof = MachineProfile.load(path)
    assert prof.commit_latency_s == COMMIT_LATENCY_S and prof.commit_file_s == COMMIT_FILE_S
    assert prof.assumed == [COMMIT_LATENCY_ASSUMED, COMMIT_FILE_ASSUMED]
    # saved and loaded again: once
    assert MachineProfile.from_dict(prof.to_dict()).assumed == [COMMIT_LATENCY_ASSUMED, COMMIT_FILE_ASSUMED]


def test_a_commit_costs_each_chunk_file_it_writes():
    """A commit writes each state array's chunks as files of their own, each with an fsync, a
    rename and a directory fsync (0.9 ms a file on the VM's ext4): the plan counted one fixed
    latency (measured with three files) whatever the number of files, so a large model's commit
    (thousands of 16 MiB chunks) was under-counted, and its commits paced too often."""
    from mtc.runtime.tiers import state_kinds

    prof = builtin("h200-1.5tb")
    for model in ("tiny", "8b"):
        cfg = TrainConfig(model=model, placement="ram", durability="full", commit_every=0)
        plan = make_plan(cfg, dataclasses.replace(prof, commit_file_s=0.0))
        per_file = 0.004
        got = make_plan(cfg, dataclasses.replace(prof, commit_file_s=per_file)).step.commits
        chunk_elems = 16 * 2**20 // 4  # the store's 16 MiB chunks of fp32
        files = sum(len(state_kinds("ram", "full")) * -(-n // chunk_elems) for n in plan.shape.numels if n)
        assert got.seconds == pytest.approx(plan.step.commits.seconds + per_file * (files - 3))
        assert got.every >= plan.step.commits.every  # paced by the whole commit


@pytest.mark.gpu
@pytest.mark.alone  # it times the GPU: other workers' kernels on the same device would skew the rates it compares
def test_gpu_calibrate_times_every_matmul_shape_and_anchors_the_layer_efficiency(tmp_path):
    """On CUDA: a point per `cuda_matmul_shapes` shape, timed over back-to-back launches (the
    thin ones at no less than a fifth of the largest's rate), and the layer efficiency from the
    anchor block (`anchored_efficiency`), said to be assumed."""
    from mtc.calibrate import cuda_matmul_shapes

    prof = calibrate(directory=tmp_path, copy_mb=64, disk_mb=8, adamw_numel=1_000_000, repeats=2)
    assert [(p["m"], p["k"], p["n"]) for p in prof.matmul] == cuda_matmul_shapes()
    peak = max(p["tflops"] for p in prof.matmul)
    assert peak > 50 and min(p["tflops"] for p in prof.matmul) > peak / 5
    assert 0.4 < prof.layer_efficiency < 1.0 and any(a.startswith("layer efficiency") for a in prof.assumed)
    assert not prof.pcie_is_memcpy and prof.h2d_gbps > 1


def test_stage_watch_warns_once_when_the_disk_is_slower_than_planned(tmp_path, data):
    import dataclasses

    from mtc.stagewatch import StageWatch
    from mtc.train import train
    from tests.runtime.engine_util import small_config

    cfg = small_config(steps=6, placement="disk", durability="none")
    fast_disk = dataclasses.replace(builtin("h100-box"), name="claims-1000GBps", accelerator="cpu", gpu_memory_bytes=0,
                                    store_write_gbps=1000.0)
    watch = StageWatch(make_plan(cfg, fast_disk))
    said: list[str] = []
    res = train(cfg, tmp_path / "s", data, watch=watch, notify=said.append)
    res.store.close()
    assert len(said) == 1, said
    assert "the disk writes at" in said[0] and "calibrated 1000.00 GB/s" in said[0]
    summary = watch.summary()
    assert any(s.startswith("disk writes: measured") for s in summary) and any(s.startswith("compute:") for s in summary)
    # a profile whose disk matches what the run sees stays quiet
    rate = min(watch.write_rates) / 1e9
    calm = StageWatch(make_plan(cfg, dataclasses.replace(fast_disk, store_write_gbps=rate * 0.2)))
    said.clear()
    res = train(cfg, tmp_path / "s2", data, watch=calm, notify=said.append)
    res.store.close()
    assert said == []


@pytest.mark.slow  # compiling the plan generates its kernels
def test_plan_cli_takes_a_plan_directory_and_a_config_file(tmp_path, capsys):
    assert main(["compile", "tiny", "-o", str(tmp_path / "plan"), "--seq-len", "32", "--micro-batch-size", "2"]) == 0
    (tmp_path / "run.json").write_text(json.dumps({"model": "tiny", "seq_len": 64, "micro_batch_size": 4, "durability": "weights"}))
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "plan"), "--machine", "h100-box", "--no-extrapolate"]) == 0
    out = capsys.readouterr().out
    assert "2 x 32 tokens" in out and "compute float32" in out  # the plan's shapes and dtype, as compiled
    assert main(["plan", "--config", str(tmp_path / "run.json"), "--machine", "h100-box", "--no-extrapolate"]) == 0
    out = capsys.readouterr().out
    chosen = [line for line in out.splitlines() if line.endswith("<- chosen")]
    assert "4 x 64 tokens" in out and len(chosen) == 1 and chosen[0].startswith("  durability weights")


def test_the_plan_times_the_host_adamw_the_run_chose():
    """`--host-adamw exact` on the H100 box is planned at exact's measured rate, not fused's."""
    prof = builtin("h100-box")
    base = TrainConfig(model="tiny", device="cuda", seq_len=16, micro_batch_size=2, placement="ram", gpu_update="none")
    cpu = {impl: make_plan(dataclasses.replace(base, host_adamw=impl), prof).step.stages()["CPU optimizer"]
           for impl in ("auto", "exact", "fused")}
    assert cpu["auto"] == cpu["fused"] > 0  # fused is the CUDA default
    rates = prof.adamw_gparams_s
    assert cpu["exact"] == pytest.approx(cpu["fused"] * rates["fused"] / rates["exact"])


# -- the GPU-update cost model's rates ---------------------------------------------------------


def _this_host_profile(path, **kw):
    """A profile as `mtc calibrate` would write it on this (CPU) host, with a slow CPU AdamW."""
    import dataclasses
    import socket

    prof = dataclasses.replace(builtin("h100-box"), name="this-host", accelerator="cpu", gpu_memory_bytes=0,
                               adamw_gparams_s={"exact": 0.5, "fused": 0.5}, adamw_impl="exact", adamw_one_thread_gparams_s=0.1,
                               adamw_with_copies=0.8, both_gbps=20.0, identity={"host": socket.gethostname(), "gpu": "none"},
                               source="mtc calibrate (copies 64 MiB)", created="2026-12-01")
    return dataclasses.replace(prof, **kw).save(path)


def test_the_gpu_update_cost_model_takes_this_hosts_calibrated_rates(tmp_path, monkeypatch):
    import mtc.calibrate
    from mtc.planner import local_update_rates
    from mtc.runtime import placement as pl
    from mtc.train import _gpu_update_rates

    cfg = TrainConfig(model="tiny")
    path = _this_host_profile(tmp_path / "machine.json")
    rates = local_update_rates(cfg, path)
    assert (rates.cpu_params_per_s, rates.pcie_bytes_per_s) == (0.5e9 * 0.8, 10e9)  # AdamW while copies run; half of both ways
    assert rates.line() == ("CPU AdamW 0.40 G params/s, PCIe 10.0 GB/s per direction "
                            "(machine profile 'this-host', 2026-12-01: mtc calibrate)")
    # with a CPU this slow the GPU takes more of the ram layers' updates than with the defaults
    measured = pl.resolve_gpu_update("auto", ["ram"] * 40, [100] * 40, device_is_cuda=True, cpu_params_per_s=rates.cpu_params_per_s,
                                     pcie_bytes_per_s=rates.pcie_bytes_per_s)
    assert len(measured) > len(pl.resolve_gpu_update("auto", ["ram"] * 40, [100] * 40, device_is_cuda=True))
    # `mtc train` reads the profile where `mtc calibrate` writes it
    monkeypatch.setattr(mtc.calibrate, "DEFAULT_PROFILE_PATH", path)
    assert _gpu_update_rates(cfg) == rates
    # another host's profile, another accelerator's, or none: the defaults, and why
    for kw, why in (({"identity": {"host": "elsewhere", "gpu": "none"}}, "measured on host 'elsewhere'"),
                    ({"accelerator": "cuda"}, "measured for accelerator 'cuda', the run uses 'cpu'")):
        other = local_update_rates(cfg, _this_host_profile(tmp_path / "other.json", **kw))
        assert (other.cpu_params_per_s, other.pcie_bytes_per_s) == (pl.DEFAULT_CPU_ADAMW_PARAMS_S, pl.DEFAULT_PCIE_BYTES_S)
        assert other.source.startswith("defaults: ") and why in other.source, other.source
    assert local_update_rates(cfg, tmp_path / "none.json").source.startswith("defaults: no calibrated profile at ")


def test_disk_layers_read_their_weights_per_visit_when_ram_cannot_hold_the_copy():
    """`disk_compute` auto keeps disk layers' bf16 copy in pinned RAM while the budget holds it,
    else reads their weights from the store at each visit: the plan fits the RAM, and each visit
    costs a read of 4 B/param from the store and an fp32 crossing. Told `ram`, the refusal names
    `--disk-compute store`."""
    prof = builtin("h100-box")
    # (two generations: 190 GB of state, too much for the page cache in either case)
    cfg = TrainConfig(model="8b", seq_len=4096, micro_batch_size=1, placement="disk", gpu_update="none", durability="full")
    roomy = make_plan(dataclasses.replace(cfg, ram_budget_gb=100), prof)
    tight = make_plan(dataclasses.replace(cfg, ram_budget_gb=12), prof)
    told = make_plan(dataclasses.replace(cfg, ram_budget_gb=12, disk_compute="ram"), prof)
    assert roomy.memory.disk_compute == told.memory.disk_compute == "ram" and tight.memory.disk_compute == "store"
    numels, disk = list(roomy.shape.numels), ["disk"] * roomy.shape.n_layers
    staging = (pl.pipeline_host_bytes(disk, numels, disk_compute="store", device_is_cuda=True, tied_weights=False)
               - pl.pipeline_host_bytes(disk, numels, disk_compute="ram", device_is_cuda=True, tied_weights=False))
    assert roomy.memory.host - tight.memory.host == 2 * sum(numels) - staging > 0  # the copy, less the visits' fp32 staging
    ram_check = [c for c in tight.checks if c.what.startswith("host RAM")]
    assert ram_check[0].ok and tight.memory.host <= 12 * 2**30
    bad = [c for c in told.checks if c.what.startswith("host RAM")][0]
    assert not bad.ok and "--disk-compute store" in bad.line()
    # every visit (forward and backward: 2 per block) reads the fp32 weights: state + visits
    L = roomy.shape.n_layers
    visits = 4 * (2 * sum(numels[: L - 1]) + numels[L - 1])
    bw = prof.store_read_gbps * 1e9
    assert tight.step.disk_read_s == pytest.approx(roomy.step.disk_read_s + visits / bw)
    assert tight.step.h2d_weights_s == pytest.approx(2 * roomy.step.h2d_weights_s)  # fp32, not bf16, crosses
    assert tight.step.step_s > roomy.step.step_s


def test_the_disk_tier_reads_ahead_while_it_writes():
    """The disk tier reads a step's state during its forward and backward and while earlier layers
    are written (a ring of chunk sets). Every read reaches the disk (the store works around the
    page cache), so reads and writes share it: a disk that serves both at once at the sum of their
    rates costs about the larger per step; one that takes turns (no joint rate measured) their
    sum; between, the bytes of both over the joint rate."""
    prof = builtin("h100-box")
    cfg = TrainConfig(model="1b", seq_len=1024, micro_batch_size=1, placement="disk", gpu_update="none", durability="none")
    turns = make_plan(cfg, prof).step
    r, w = turns.disk_read_s, turns.disk_write_s
    assert r > 0.3 * w and turns.stage_s["disk I/O"] == pytest.approx(r + w) and turns.step_s >= r + w
    full = make_plan(cfg, dataclasses.replace(prof, store_both_gbps=prof.store_read_gbps + prof.store_write_gbps)).step
    assert (full.disk_read_s, full.disk_write_s) == pytest.approx((r, w))
    assert full.stage_s["disk I/O"] == pytest.approx(max(r, w)) and max(r, w) <= full.step_s < max(r, w) + 0.2 * min(r, w)
    joint = 2.0  # GB/s: between the larger alone (1.7) and the sum (3.3)
    some = make_plan(cfg, dataclasses.replace(prof, store_both_gbps=joint)).step
    nbytes = r * prof.store_read_gbps + w * prof.store_write_gbps
    assert some.stage_s["disk I/O"] == pytest.approx(nbytes / joint) and full.step_s < some.step_s < turns.step_s
    slower = make_plan(cfg, dataclasses.replace(prof, store_write_gbps=prof.store_write_gbps / 2)).step
    assert slower.disk_write_s == pytest.approx(2 * w) and slower.step_s > turns.step_s + 0.9 * w


def test_a_disk_bound_step_is_never_shorter_than_the_disks_work():
    """Writes lag the next step's reads by a step, so a disk-bound schedule alternates long and
    short steps: the prediction is their mean, never less than the disk's busy time per step."""
    cfg = TrainConfig(model="8b", seq_len=4096, micro_batch_size=1, ram_budget_gb=20, durability="none")
    st = make_plan(cfg, builtin("h100-box")).step
    assert st.bottleneck == "disk I/O" and st.stage_s["disk I/O"] <= st.step_s < 1.1 * st.stage_s["disk I/O"]


def test_a_plan_weighs_gpu_updates_with_its_machines_rates():
    import dataclasses

    cfg = TrainConfig(model="8b", seq_len=4096, micro_batch_size=1, placement="ram", durability="none")
    box = builtin("h100-box")
    fast_cpu = dataclasses.replace(box, adamw_gparams_s={"fused": 50.0, "exact": 25.0})
    slow, fast = make_plan(cfg, box).gpu_update, make_plan(cfg, fast_cpu).gpu_update
    assert len(fast) < len(slow)  # a faster CPU keeps more of the updates


def test_disk_gradients_the_gpu_cannot_hold_are_planned_in_the_store():
    """As mtc.train decides it: when the GPU budget cannot hold disk layers' gradients they are
    spilled to the store, so they are not GPU memory, and they cost disk time (a write and a read
    of 4 B/param beside the 12 of master, m and v)."""
    prof = builtin("h100-box")
    base = TrainConfig(model="tiny", device="cuda", seq_len=16, micro_batch_size=2, placement="disk", gpu_update="none",
                       durability="none")
    kept = make_plan(dataclasses.replace(base, gpu_budget_gb=1000.0), prof)
    spilled = make_plan(dataclasses.replace(base, gpu_budget_gb=1e-6), prof)
    assert not kept.memory.grad_spill and spilled.memory.grad_spill
    n = sum(kept.shape.numels)
    assert kept.memory.gpu_state == 4 * n and spilled.memory.gpu_state == 0
    assert spilled.step.disk_read_s == pytest.approx(kept.step.disk_read_s * 16 / 12)
    assert spilled.step.disk_write_s > kept.step.disk_write_s
    # the disk written per step (and per day: wear) counts the spilled gradients, rewritten every step
    assert kept.step.disk_wear_bytes == 12 * n and spilled.step.disk_wear_bytes == 16 * n
    line = [ln for ln in spilled.lines() if ln.startswith("disk writes:")][0]
    assert "gradients waiting in the store add" in line
    # without --gpu-budget-gb the planned machine's GPU memory decides (not this machine's)
    small = dataclasses.replace(prof, gpu_memory_bytes=2**30)  # less than the workspace alone
    assert make_plan(base, small).memory.grad_spill and not make_plan(base, prof).memory.grad_spill


def test_gpu_updated_layers_plan_their_gradients_on_the_gpu():
    """A ram layer the GPU updates keeps its gradient there until the update: 4 B/param of GPU
    memory (with the two scratch sets) instead of a pinned host buffer, no gradient copy down and
    12 B/param up instead of 16; `auto` takes only what the GPU memory left can hold."""
    prof = builtin("h100-box")
    cfg = TrainConfig(model="8b", seq_len=4096, micro_batch_size=1, placement="ram", durability="none")
    plan = make_plan(cfg, prof)
    n, c = list(plan.shape.numels), plan.shape.compute_bytes
    up = plan.gpu_update
    # the GPU memory left beside them loads the first ones' state during the backward, a set each
    assert up and plan.prefetch and plan.memory.gpu_state == pl.streamed_gpu_bytes(up, n, c, prefetch=plan.prefetch)
    none = make_plan(dataclasses.replace(cfg, gpu_update="none"), prof)
    streamed = sum(n[i] for i in up)
    assert none.memory.host - plan.memory.host == 4 * streamed
    assert plan.memory.pinned - none.memory.pinned == (12 - 4) * streamed  # master, m and v pinned; the gradient not
    # a GPU budget that holds the scratch and a few layers' gradients caps the choice
    small = make_plan(dataclasses.replace(cfg, gpu_budget_gb=(pl.streamed_gpu_bytes(set(list(up)[:3]), n, c) + 1) / 2**30), prof)
    assert 0 < len(small.gpu_update) <= 3 and small.memory.gpu_state <= small.cfg.gpu_budget_gb * 2**30

    # a fixed activation budget keeps the GPU footprint independent of depth: the gradients go to the host
    fixed = make_plan(dataclasses.replace(cfg, activation_budget_gb=2.0), prof)
    assert fixed.memory.gpu_state == pl.streamed_gpu_bytes(fixed.gpu_update, n, c, grads_on_device=False)
    assert fixed.step.d2h_grads_s > plan.step.d2h_grads_s


def test_a_seeded_run_checks_the_gpu_memory_of_its_gpu_updated_layers(tmp_path, data, monkeypatch):
    """Opening a store seeded by `mtc import` or --init-from runs the fit check with the layers
    the GPU will update (their gradients and scratch are GPU memory), as a new run does."""
    import mtc.planner as planner
    from mtc.train import open_run, train
    from mtc.warmstart import init_from

    cfg = TrainConfig(model="tiny", micro_batch_size=2, seq_len=16, steps=1, kernels="unfused", placement="ram", gpu_update="all")
    train(cfg, tmp_path / "src", data).store.close()
    init_from(tmp_path / "src", tmp_path / "new", cfg)
    seen = []
    real = planner.check_fit
    monkeypatch.setattr(planner, "check_fit", lambda *a, **k: (seen.append(a[3]), real(*a, **k))[1])
    open_run(cfg, tmp_path / "new").store.close()
    assert seen and seen[-1] == set(range(len(seen[-1]))) and len(seen[-1]) > 1  # every ram layer, as --gpu-update all names


def test_a_seeded_run_checks_the_disk_it_adds_to_the_seed(tmp_path, data, monkeypatch):
    """A store seeded by `mtc import` or --init-from keeps its generation (its commit names it):
    without durability the disk layers then write a second one, and the fit check counts it
    against the free disk before the run starts, as for a new run."""
    from mtc.errors import ConfigError
    from mtc.train import train
    from mtc.warmstart import init_from

    cfg = TrainConfig(model="tiny", micro_batch_size=2, seq_len=16, steps=2, kernels="unfused", placement="disk", durability="none")
    train(dataclasses.replace(cfg, durability="full", steps=1), tmp_path / "src", data).store.close()
    init_from(tmp_path / "src", tmp_path / "new", cfg)
    probe = train(cfg, None, data)  # an in-memory run of the same model, for its layer sizes
    numels = [s.numel for s in probe.tiers.layers]
    probe.store.close()
    need = pl.disk_bytes_beyond_seed(["disk"] * len(numels), numels, "none")
    assert need == 12 * sum(numels)
    monkeypatch.setenv(DISK_FREE_ENV, str(need - 1))
    with pytest.raises(ConfigError, match="beyond the seeded generation") as e:
        train(cfg, tmp_path / "new", data)
    assert "disk" in str(e.value)
    monkeypatch.setenv(DISK_FREE_ENV, str(need))
    res = train(cfg, tmp_path / "new", data)
    try:
        assert len(res.losses) == 2 and res.store.last_commit().step == 0  # the seed's commit, still whole
    finally:
        res.store.close()
    # the same command again (nothing was committed): what the first attempt wrote counts as room
    monkeypatch.setenv(DISK_FREE_ENV, "0")
    again = train(cfg, tmp_path / "new", data)
    assert again.losses == res.losses
    again.store.close()


def test_compiled_backward_visits_are_modelled_without_the_blocks_last_matmul():
    """A compiled joint graph does not recompute what only a block's output needs (its down
    projection): the cost model's backward for fused plans leaves exactly that matmul out."""
    import torch

    from mtc.costmodel import _matmul_seconds, compute_seconds, template_cost
    from mtc.models import build
    from mtc.tracer import trace

    with torch.device("meta"):
        prog = trace(build("8b", n_layers=1).to(torch.bfloat16), 1, 1024)
    block, head = template_cost(prog.template_of(1)), template_cost(prog.template_of(2))
    assert [block.matmuls[j] for j in block.output_only] == [(1, 1024, 14336, 4096)]  # the down projection only
    assert head.output_only == ()  # the head's loss is read
    prof = builtin("h100-box")
    full = compute_seconds(block, prof, backward=True)
    lean = compute_seconds(block, prof, backward=True, lean=True)
    assert full - lean == pytest.approx(_matmul_seconds(prof, 1024, 14336, 4096) * prof.other_scale_bwd, rel=1e-6)
    assert compute_seconds(block, prof, backward=False, lean=True) == compute_seconds(block, prof, backward=False)


def test_the_plan_keeps_blocks_activations_where_the_gpu_has_room():
    # P3's shape on the H100 box: every block's matmul and attention outputs fit beside the
    # resident state, and the predicted step loses the recomputed forward of every block
    over = {"dim": 2048, "ffn_dim": 8192, "n_heads": 32, "n_kv_heads": 8, "n_layers": 23, "vocab_size": 32000}

    def plan(**kw):
        kw = {"micro_batch_size": 16, **kw}
        return make_plan(TrainConfig(model="8b", model_overrides=over, seq_len=1024, device="cuda", durability="none", **kw),
                         builtin("h100-box"))

    off, auto = plan(save_activations="off"), plan()
    assert off.saves == [] and off.memory.gpu_saved == 0
    assert auto.saves == list(range(1, 24)) and auto.placement == off.placement
    # per token and block: q 2048 + k, v 512 each + attention 2048 + o 2048 + gate, up 8192 each, in bf16 (+ fp32 lse)
    assert auto.memory.gpu_saved == 23 * 16 * 1024 * (2 * 23552 + 4 * 32)
    assert auto.step.compute_s < 0.85 * off.step.compute_s and auto.fits
    assert any("23 of 23 blocks keep their activations" in line for line in auto.lines())
    assert plan(activation_budget_gb=1.0).saves == []  # a fixed activation budget: nothing kept (auto)
    assert plan(save_activations="5").saves == [19, 20, 21, 22, 23]
    # an explicit choice is not fitted: more than the GPU holds fails the GPU check
    big = plan(save_activations="all", grad_accum=4, placement="gpu")
    assert not big.fits and any("saved activations" in c.what and not c.ok for c in big.checks)


@pytest.mark.parametrize("seqs", [16, 48])
def test_a_compute_bound_step_trades_the_update_prefetch_for_saved_activations(monkeypatch, seqs):
    # P1's shape, stateless, on the H100 box's profile: at 48 sequences the step is bound by GPU
    # compute and the memory the prefetch's buffer sets would take keeps 11 blocks' activations
    # instead (predicted 3.22 s against 3.50 s at this commit); at 16 the optimizer bounds it and
    # the prefetch stays. `mtc.train` takes the same choice on a calibrated profile of its machine.
    import importlib

    import mtc.planner as planner

    tr = importlib.import_module("mtc.train")
    over = {"dim": 4096, "ffn_dim": 14336, "n_heads": 32, "n_kv_heads": 8, "n_layers": 20, "vocab_size": 32000}
    cfg = TrainConfig(model="8b", model_overrides=over, micro_batch_size=4, grad_accum=seqs // 4, seq_len=1024, device="cuda",
                      durability="none", placement="stateless")
    prof = builtin("h100-box")
    plan = make_plan(cfg, prof)
    with_prefetch = make_plan(cfg, prof) if seqs == 16 else planner._make_plan(cfg, prof)
    no_prefetch = planner._make_plan(dataclasses.replace(cfg, update_prefetch=0), prof)
    assert with_prefetch.prefetch > 0 and len(no_prefetch.saves) > len(with_prefetch.saves)
    monkeypatch.setattr(planner, "local_profile", lambda device: (prof, ""))
    got, why = tr.trade_prefetch_for_saves(cfg, None)
    if seqs == 48:
        assert no_prefetch.step.step_s < with_prefetch.step.step_s * (1 - planner.TRADE_MARGIN)
        assert plan.cfg.update_prefetch == 0 and plan.prefetch == 0 and plan.saves == no_prefetch.saves
        assert plan.choice.startswith("update prefetch off") and plan.choice in plan.lines()
        assert got.update_prefetch == 0 and why.startswith("update prefetch off") and "h100-box" in why
    else:
        assert no_prefetch.step.step_s > with_prefetch.step.step_s
        assert plan.cfg.update_prefetch is None and plan.prefetch > 0 and not plan.choice
        assert got is cfg and why == ""
    # told what to do, neither changes it
    fixed = dataclasses.replace(cfg, update_prefetch=2)
    assert make_plan(fixed, prof).prefetch == 2 and tr.trade_prefetch_for_saves(fixed, None) == (fixed, "")


def test_auto_placement_passes_the_fit_check_it_was_chosen_for():
    """`mtc train` on the CPU with a RAM budget between all-disk and all-RAM: auto placement keeps
    as many layers in RAM as fit with the gradient slabs the first RAM layer brings, so the fit
    check accepts it, and one more RAM layer would not fit (it once chose ram:0-3,disk:4,ram:5 and
    then refused it: 679 MiB against 563; and, while it charged every model's weight slots two
    layers and the check one for a model that ties none, it left a layer on disk at 0.52 GiB
    that the check would have taken in RAM). 0.46 GiB is just under all-RAM's 479 MiB: at
    0.52 GiB all-RAM fits, and auto placement takes it
    (`test_auto_placement_takes_all_ram_whenever_the_budget_holds_it`)."""
    from mtc.errors import ConfigError
    from mtc.planner import check_fit
    from mtc.train import build_model, plan_placement
    from mtc.tracer import trace

    cfg = TrainConfig(model="tiny", model_overrides={"n_layers": 4, "dim": 768, "ffn_dim": 2048, "n_heads": 8, "n_kv_heads": 2},
                      micro_batch_size=1, seq_len=16, placement="auto", ram_budget_gb=0.46, kernels="unfused", durability="none")
    program = trace(build_model(cfg, device="meta"), cfg.micro_batch_size, cfg.seq_len)
    assert plan_placement(dataclasses.replace(cfg, ram_budget_gb=0.52), program)[0] == ["ram"] * program.n_layers
    placement, gpu_update = plan_placement(cfg, program)
    assert "ram" in placement and "disk" in placement
    check_fit(cfg, program, placement, gpu_update, None, new_run=True)
    more = list(placement)
    more[more.index("disk")] = "ram"
    with pytest.raises(ConfigError, match="host RAM"):
        check_fit(cfg, program, more, gpu_update, None, new_run=True)
    cpu = dataclasses.replace(builtin("h100-box"), name="cpu", accelerator="cpu", gpu_memory_bytes=0)
    assert make_plan(cfg, cpu).placement == placement  # `mtc plan` places as `mtc train` does


def test_a_profile_without_the_joint_disk_rate_says_reads_and_writes_take_turns(tmp_path):
    """A profile written before calibrate measured the store's joint rate loads with that rate at 0
    and says so in its assumptions (which `mtc plan` prints); one that has it says nothing of it."""
    from mtc.calibrate import TAKE_TURNS

    measured = dataclasses.replace(builtin("h100-box"), store_both_gbps=2.0, assumed=[])
    d = measured.to_dict()
    assert MachineProfile.from_dict(d).assumed == []
    old = {k: v for k, v in d.items() if k not in ("store_both_gbps", "assumed")}
    back = MachineProfile.from_dict(old)
    assert back.store_both_gbps == 0.0 and back.assumed == [TAKE_TURNS]


def test_handed_over_weights_leave_the_pcie_and_the_forwards_wait():
    """P1-16 stateless on the H200 profile of 2026-11-27 with the layers that run updated on the GPU,
    all loaded ahead: with the handoff the visits' weights of those layers stop crossing PCIe
    (h2d_weights_s is the rest's, the embed's and head's) and the step is predicted shorter; in
    fp32 there is no handoff (the weights are the master, which the next load overwrites)."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    prof = MachineProfile.load(results / "machine-vm-20261127T1910.json")
    rec = json.loads((results / "bench_train-P1-16-vm-20261127T191418.json").read_text())
    s = next(x for x in rec["settings"] if x["setting"] == "stateless")
    layers = s["gpu_update_layers"]
    base = {**s["config"], "placement": s["placement"], "gpu_update": ",".join(map(str, layers)),
            "save_activations": str(len(s["saved_activation_layers"])), "update_prefetch": len(layers)}
    off = make_plan(TrainConfig.from_dict({**base, "update_handoff": False}), prof)
    on = make_plan(TrainConfig.from_dict({**base, "update_handoff": True}), prof)
    assert sorted(on.gpu_update) == layers and pl.deferred_layers(set(layers), len(layers)) == set(layers)
    numels = on.shape.numels
    c = on.shape.compute_bytes
    handed = sum(numels[i] for i in layers) * c * 2 / (prof.h2d_gbps * 1e9)  # two visits each
    assert on.step.h2d_weights_s == pytest.approx(off.step.h2d_weights_s - handed, rel=1e-6)
    assert on.step.step_s < off.step.step_s
    # `mtc plan` says how many (all those loaded ahead here)
    assert f"{len(layers)} handing their new weights to the next visits on the device" in "\n".join(on.lines())
    assert "handing" not in "\n".join(off.lines())
    fp32 = {**base, "compute_dtype": "float32"}
    a, b = (make_plan(TrainConfig.from_dict({**fp32, "update_handoff": h}), prof) for h in (False, True))
    assert a.step.step_s == b.step.step_s


def test_plan_shows_the_stateless_alternative_beside_an_automatic_placement_with_gpu_state(capsys):
    """P1's shape at 48 sequences on the H100 box: auto keeps 16 of 22 layers' state on the GPU; `mtc plan`
    also prints the step with all state in host RAM (its memory then keeps blocks' activations),
    both predictions, and that it does not choose (or that it would not fit); a placement that is
    not auto gets nothing."""
    from mtc.planner import stateless_alternative

    over = {"dim": 4096, "ffn_dim": 14336, "n_heads": 32, "n_kv_heads": 8, "n_layers": 20, "vocab_size": 32000}
    cfg = TrainConfig(model="8b", model_overrides=over, micro_batch_size=4, grad_accum=12, seq_len=1024, device="cuda",
                      durability="none")
    prof = builtin("h100-box")
    plan = make_plan(cfg, prof)
    assert plan.placement.count("gpu") == 16 and plan.placement.count("ram") == 6
    alt, line = stateless_alternative(plan)
    assert alt.placement == ["ram"] * 22 and alt.saves and alt.gpu_update
    assert f"predicted {alt.step.step_s * 1e3:,.0f} ms per step against {plan.step.step_s * 1e3:,.0f} ms" in line
    assert "not chosen automatically" in line
    assert stateless_alternative(make_plan(dataclasses.replace(cfg, placement="stateless"), prof)) == (None, "")
    rc = main(["plan", "8b", "--machine", "h100-box", "--seq-len", "1024", "--micro-batch-size", "2", "--grad-accum", "4",
               "--no-extrapolate"])
    out = capsys.readouterr().out
    # (8B's fp32 state, 128 GB, is more than the box's 122 GiB of RAM: the CLI says the alternative does not fit)
    assert rc in (0, 1) and "all state in host RAM (--placement stateless) would not fit this machine" in out


def test_plan_says_what_durability_keeps_when_layers_live_on_disk():
    """Disk layers keep m and v in the store whatever the mode (they live there): the weights mode
    says so, and an all-disk plan's commits add no state writes (each step writes the state)."""
    from mtc.calibrate import builtin

    lines = make_plan(TrainConfig(model="8b", placement="disk", durability="weights"), builtin("h100-box")).lines()
    weights = next(ln for ln in lines if ln.startswith("  durability weights"))
    assert "and of the disk layers' m and v, which live there: resume restarts Adam's moments (the disk layers' too)" in weights
    assert any("adds no state writes: the disk layers' state is written every step" in ln for ln in lines)
    ram = make_plan(TrainConfig(model="8b", placement="ram", durability="weights"), builtin("h100-box")).lines()
    assert any("two generations of the weights: resume restarts Adam's moments" in ln for ln in ram)
    assert any(ln.startswith("disk writes:") and "(commits of " in ln for ln in ram)


def test_parameter_counts_read_at_any_size():
    from mtc.planner import _count

    assert [_count(n) for n in (45_888, 1_250_000, 4_600_000_000, 0)] == ["45,888", "1.2M", "4.600B", "0"]


@pytest.mark.parametrize("model", ["tiny", "gpt2-tiny"])
def test_host_ram_of_disk_layers_is_what_the_engine_holds_for_untied_weights(data, model):
    """The plan's host RAM for all-disk state on the CPU (gradients, the disk ring, the executor's
    weight ring and slabs, which are host memory there) against what the engine allocated: equal
    for a model that ties no weight (a Llama), never less for one that does (GPT-2's head reads the
    embedding). The ring was once counted at two layers per slot for every model."""
    from mtc.costmodel import shape_from_program
    from mtc.planner import memory
    from mtc.train import train

    cfg = TrainConfig(model=model, placement="disk", micro_batch_size=2, seq_len=16, steps=1, kernels="unfused", durability="none")
    res = train(cfg, None, data)
    try:
        shape = shape_from_program(res.program, model, 4)
        planned = memory(cfg, shape, res.placement, set(), cuda=False).host
        engine = res.tiers.host_bytes()
        assert planned == engine if shape.fetch_numels == shape.numels else planned >= engine, (planned, engine)
    finally:
        res.store.close()


def test_plan_advice_to_read_disk_weights_from_the_store_runs_with_mtc_plan(tmp_path, capsys):
    """A RAM budget that cannot hold disk layers' bf16 copy is refused with `--disk-compute store`
    as the way out: `mtc plan` takes that flag too, and with it the RAM fits (it once stopped at
    'unrecognized arguments')."""
    cfg = TrainConfig(model="8b", seq_len=4096, micro_batch_size=1, placement="disk", gpu_update="none", durability="none",
                      disk_compute="ram", ram_budget_gb=12)
    (tmp_path / "run.json").write_text(json.dumps(cfg.to_dict()))
    args = ["plan", "--config", str(tmp_path / "run.json"), "--machine", "h100-box", "--no-extrapolate"]
    main(args)
    ram = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fit: host RAM")]
    assert len(ram) == 1 and "DOES NOT FIT" in ram[0] and "--disk-compute store" in ram[0], ram
    main([*args, "--disk-compute", "store"])
    ram = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fit: host RAM")]
    assert len(ram) == 1 and ": fits:" in ram[0], ram


def test_a_ram_budget_too_small_for_all_disk_is_refused_with_the_least_that_fits():
    """With few layers, spilling disk layers' gradients to the store costs more host RAM than it
    frees (slabs of the largest layer, ring gradient buffers, staging chunks): a budget just under
    what all-disk needs keeping them is refused with that figure, which fits, and nothing less does.
    The spill was chosen there and the refusal named its larger figure."""
    prof = dataclasses.replace(builtin("h100-box"), accelerator="cpu", gpu_memory_bytes=0)
    cfg = TrainConfig(model="tiny", placement="disk", kernels="unfused", durability="none")

    def plan(budget_bytes: float):
        return make_plan(dataclasses.replace(cfg, ram_budget_gb=budget_bytes / 2**30), prof)

    keep = plan(2**30).memory
    assert not keep.grad_spill
    short = plan(keep.host - 2**20)
    check = next(c for c in short.checks if c.what.startswith("host RAM"))
    assert not check.ok and "even with every layer on disk the run needs" in check.fix, check.line()
    line = check.line()  # "... needs A, has B; even with every layer on disk the run needs A (..."
    assert check.need == keep.host and line.split("needs ")[1].split(",")[0] == line.split("run needs ")[1].split(" (")[0], line
    assert plan(check.need).fits and not plan(check.need - 4096).fits


@pytest.mark.parametrize("placement,every", [("disk", 0), ("ram", 1)])
def test_every_step_commits_put_their_fixed_latency_in_the_step(placement, every):
    """Committing every step (disk layers, or commit_every 1), a step's commit follows its writes and
    the next step's writes wait for it (they may overwrite only what the last commit does not name),
    so a commit's fixed cost (fsyncs, renames, the record) paces the steps once it outlasts the
    slack. The plan counted only the commit's bytes: the step time did not move with the latency
    (a tiny model on the CPU here: +50 ms per commit made each step 31 ms longer)."""
    cfg = TrainConfig(model="tiny", placement=placement, commit_every=every)
    prof = builtin("h100-box")
    bare = make_plan(cfg, dataclasses.replace(prof, commit_latency_s=0.0)).step
    latency = 10 * bare.step_s
    slow = make_plan(cfg, dataclasses.replace(prof, commit_latency_s=latency)).step
    assert slow.commits.every == 1 and slow.commits.seconds >= latency
    assert latency <= slow.step_s <= bare.step_s + latency  # one commit per step, overlapping the step at most
    paced = make_plan(dataclasses.replace(cfg, placement="ram", commit_every=0), dataclasses.replace(prof, commit_latency_s=latency)).step
    assert paced.commits.every > 1 and paced.step_s < latency  # paced commits stay behind the steps


def test_the_process_overhead_is_its_own_line_in_the_plan_and_the_fit_check():
    """An `mtc train` process holds ~260 MiB of anonymous memory before any state (torch, sympy,
    torch.export's trace, the program): host RAM the plan did not count, so a machine with less
    left than that beside the engine's bytes was planned to fit. It is its own line, beside the
    engine's figure (which stays what the engine holds), in the plan and the check against the
    machine's memory; --ram-budget-gb bounds the engine's part only."""
    prof = dataclasses.replace(builtin("h100-box"), accelerator="cpu", gpu_memory_bytes=0)
    cfg = TrainConfig(model="tiny", placement="disk", kernels="unfused", durability="none")
    mem = make_plan(cfg, prof).memory
    assert mem.process == pl.PROCESS_HOST_BYTES and mem.host_total == mem.host + mem.store_io + mem.process + mem.compute
    lines = make_plan(cfg, prof).lines()
    assert any(ln.startswith("memory:") and "process overhead" in ln for ln in lines), lines

    def host_check(available: int, **kw):
        plan = make_plan(dataclasses.replace(cfg, **kw), dataclasses.replace(prof, host_available_bytes=available))
        return next(c for c in plan.checks if c.what.startswith("host RAM"))

    short = host_check(mem.host_total - 2**20)  # holds the engine and the store's buffers, not the process
    assert not short.ok and short.need == mem.host_total and "process overhead" in short.what, short.line()
    assert host_check(mem.host_total).ok
    budget = host_check(mem.host_total, ram_budget_gb=mem.host / 2**30)  # the budget bounds the engine's bytes
    assert budget.ok and budget.need == mem.host and "process overhead" in budget.what, budget.line()


def test_a_cpu_runs_compute_is_host_ram_that_the_plan_counts_and_auto_placement_leaves_room_for():
    """On the CPU device a step's activations, one layer's work and the logits are host memory
    (2-core VM, 2026-11-29: peak RSS 0.93 GB at 1 and 2.40 GB at 16 sequences of 1024 tokens, 4
    blocks of width 512, all state in RAM, where the plan said 0.62 GB for both; 0.72 and 2.26 now). The plan counts
    them beside the engine's bytes, grows them with the micro-batch, refuses a machine that holds
    the state but not the step, and auto placement leaves room for them (layers go to disk)."""
    from mtc.planner import cpu_compute_bytes, placement_for

    prof = dataclasses.replace(builtin("h100-box"), accelerator="cpu", gpu_memory_bytes=0)
    cfg = TrainConfig(model="tiny", kernels="unfused", durability="none", placement="ram", seq_len=256,
                      model_overrides={"max_seq_len": 256, "dim": 512, "ffn_dim": 2048, "n_heads": 8, "n_kv_heads": 8})
    small, big = (make_plan(dataclasses.replace(cfg, micro_batch_size=b), prof) for b in (1, 4))
    assert small.memory.host == big.memory.host and 0 < small.memory.compute < big.memory.compute
    assert big.memory.compute == cpu_compute_bytes(big.cfg, big.shape)
    assert any(ln.startswith("memory:") and "compute" in ln for ln in big.lines()), big.lines()
    need = big.memory.host_total

    def host_check(available: int):
        plan = make_plan(dataclasses.replace(big.cfg), dataclasses.replace(prof, host_available_bytes=available))
        return next(c for c in plan.checks if c.what.startswith("host RAM"))

    short = host_check(need - 2**20)  # holds the state, the pipeline and the process, not the step
    assert not short.ok and short.need == need and "compute on the CPU" in short.what, short.line()
    assert host_check(need).ok
    # auto placement: a machine whose default budget holds every layer in RAM, but not beside the step
    auto = dataclasses.replace(big.cfg, placement="auto")
    # (the default budget: available less 15 %, at least 2 GiB: here the 2 GiB)
    avail = big.memory.host + big.memory.compute // 2 + 2 * 2**30
    assert pl.default_ram_budget(avail) - big.memory.compute < big.memory.host < pl.default_ram_budget(avail)
    roomy = dataclasses.replace(prof, host_available_bytes=avail + big.memory.compute)
    tight = dataclasses.replace(prof, host_available_bytes=avail)
    assert placement_for(auto, big.shape, roomy)[0] == ["ram"] * big.shape.n_layers
    placed = make_plan(auto, tight)
    assert "disk" in placed.placement and all(c.ok for c in placed.checks if c.what.startswith("host RAM")), placed.lines()
    # a CUDA run computes on the GPU: nothing of it in host RAM
    assert make_plan(dataclasses.replace(big.cfg, device="cuda"), builtin("h100-box")).memory.compute == 0


def test_the_process_overhead_is_what_a_fresh_process_holds_before_any_state(tmp_path):
    """The planned figure against a fresh process that has imported what a run imports and traced
    the tiny preset as a new run does (and imported what autograd imports at the first backward)."""
    import os
    import subprocess
    import sys

    probe = (
        "import torch.fx.experimental.symbolic_shapes\n"
        "from mtc.config import TrainConfig\n"
        "from mtc.graphs.trace import trace\n"
        "from mtc.runtime.placement import process_anon_bytes\n"
        "from mtc.train import build_model\n"
        "program = trace(build_model(TrainConfig(model='tiny'), device='meta'), 16, 128)\n"
        "print(process_anon_bytes())\n"
    )
    # (without the tests' TRITON_INTERPRET, as a user's run on the CPU)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    held = int(out.stdout.split()[-1])
    assert held > 0
    # (within a quarter of it: torch's CUDA build, another Python, a later torch hold somewhat more or less)
    assert 0.75 * held <= pl.PROCESS_HOST_BYTES <= 1.25 * held, (held / 2**20, pl.PROCESS_HOST_BYTES / 2**20)



def test_the_live_fit_check_counts_the_process_once(monkeypatch):
    """`mtc train` checks the fit once it has imported and traced: it asks for the process overhead
    beside the engine's bytes, and adds the part of it the process holds already (which MemAvailable
    leaves out) to what there is."""
    from mtc.costmodel import shape_from_program
    from mtc.errors import ConfigError
    from mtc.planner import check_fit, memory
    from mtc.train import open_run

    cfg = TrainConfig(model="tiny", placement="disk", micro_batch_size=2, seq_len=16, steps=1, kernels="unfused",
                      durability="none")
    run = open_run(cfg, None)
    try:
        shape = shape_from_program(run.program, cfg.model, 4)
        disk = ["disk"] * shape.n_layers
        need = memory(cfg, shape, disk, set(), cuda=False, store_on_disk=False).host_total
        slack = 8 * 2**20  # (this process's memory moves a little between here and the check)
        monkeypatch.setattr(pl, "available_host_bytes", lambda: need - min(pl.process_anon_bytes(), pl.PROCESS_HOST_BYTES) + slack)
        check_fit(cfg, run.program, disk, set(), None, new_run=True)
        monkeypatch.setattr(pl, "available_host_bytes", lambda: need - min(pl.process_anon_bytes(), pl.PROCESS_HOST_BYTES) - slack)
        with pytest.raises(ConfigError, match="process overhead"):
            check_fit(cfg, run.program, disk, set(), None, new_run=True)
    finally:
        run.store.close()


def test_on_the_cpu_saved_activations_are_host_ram_in_the_plan_and_the_runs_fit_check(monkeypatch):
    """On the CPU device the blocks told to keep their activations keep them in host RAM: the
    plan says so and counts them in its host total and check, and `mtc train`'s fit check counts
    them too (the plan said "on the GPU" and neither counted them: a run 66 % over its plan)."""
    from mtc.errors import ConfigError
    from mtc.planner import check_fit
    from mtc.tracer import trace
    from mtc.train import build_model

    cpu = dataclasses.replace(builtin("h100-box"), name="cpu16", accelerator="cpu", gpu_memory_bytes=0, pcie_is_memcpy=True,
                              compute_threads=16, adamw_impl="exact")
    cfg = TrainConfig(model="tiny", micro_batch_size=8, seq_len=256, device="cpu", compute_dtype="float32", durability="none",
                      placement="ram", model_overrides={"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1408,
                                                        "max_seq_len": 512})
    off, kept = (make_plan(dataclasses.replace(cfg, save_activations=s), cpu) for s in ("off", "all"))
    assert kept.saves == list(range(1, 9)) and kept.memory.gpu_saved == 0 and kept.memory.host_saved > 100 * 2**20
    assert kept.memory.host_total == off.memory.host_total + kept.memory.host_saved
    host = next(c for c in kept.checks if c.what.startswith("host RAM"))
    assert "saved activations" in host.what and host.need == next(c for c in off.checks if c.what.startswith("host RAM")).need \
        + kept.memory.host_saved
    # some blocks only: their share, and no CUDA graph's second buffer set (nothing replays on the CPU)
    two = make_plan(dataclasses.replace(cfg, save_activations="2"), cpu)
    assert two.saves == [7, 8] and two.memory.host_saved * 4 == kept.memory.host_saved
    line = next(x for x in kept.lines() if x.startswith("placement"))
    assert "in host RAM" in line and "on the GPU" not in line and "unfused block's autograd graph keeps more" in line
    # the run's check, on a host whose memory holds the plan without the saved activations but not with them
    program = trace(build_model(cfg, device="meta"), cfg.micro_batch_size, cfg.seq_len)
    placement = ["ram"] * program.n_layers
    # (the check credits back the process overhead it counts, already resident in this process)
    have = off.memory.host_total - min(pl.process_anon_bytes(), off.memory.process) + kept.memory.host_saved // 2
    monkeypatch.setattr(pl, "available_host_bytes", lambda: have)
    check_fit(cfg, program, placement, set(), None, new_run=True)
    with pytest.raises(ConfigError, match=r"host RAM .*saved activations .*--save-activations"):
        check_fit(dataclasses.replace(cfg, save_activations="all"), program, placement, set(), None, new_run=True)


def test_gpu_layers_on_the_cpu_device_are_planned_as_the_run_holds_them():
    """`--placement gpu` on the CPU device: `mtc train` runs the layers resident there (the
    engine's tests do), so the plan takes the placement too and both count their state, 16 B per
    parameter in fp32, as host RAM (the plan refused it; the run counted none of it)."""
    from mtc.errors import ConfigError
    from mtc.planner import check_fit
    from mtc.tracer import trace
    from mtc.train import build_model

    cpu = dataclasses.replace(builtin("h100-box"), name="cpu16", accelerator="cpu", gpu_memory_bytes=0, pcie_is_memcpy=True,
                              compute_threads=16, adamw_impl="exact")
    cfg = TrainConfig(model="tiny", micro_batch_size=2, seq_len=64, device="cpu", compute_dtype="float32", durability="none")
    gpu, disk = (make_plan(dataclasses.replace(cfg, placement=p), cpu) for p in ("gpu:0-1,disk:2-5", "disk"))
    n = sum(gpu.shape.numels[:2])
    assert gpu.placement[:2] == ["gpu", "gpu"] and gpu.memory.gpu_state == 0
    # two layers moved from disk to resident: their 16 B/param, less what a disk layer keeps in RAM
    per_disk = pl.host_bytes_per_param("disk", 4, disk_compute=disk.memory.disk_compute, grads_on_device=False,
                                       grad_spill=disk.memory.grad_spill)
    assert gpu.memory.host - disk.memory.host == (16 - per_disk) * n
    program = trace(build_model(cfg, device="meta"), cfg.micro_batch_size, cfg.seq_len)
    tight = dataclasses.replace(cfg, placement="gpu", ram_budget_gb=16 * sum(gpu.shape.numels) / 2 / 2**30)
    with pytest.raises(ConfigError, match=r"this run does not fit: host RAM .*placement gpu:0-5"):
        check_fit(tight, program, ["gpu"] * program.n_layers, set(), None, new_run=True)


def test_a_cpu_runs_compute_that_does_not_fit_names_every_flag_it_grows_with(tmp_path, capsys):
    """`cpu_compute_bytes` keeps every micro-batch's boundary activations until the step's
    backward: it grows with --grad-accum too, and the refusal said only --micro-batch-size and --seq-len."""
    from mtc.planner import cpu_compute_bytes

    prof = dataclasses.replace(builtin("h100-box"), accelerator="cpu", gpu_memory_bytes=0, host_available_bytes=8 * 2**30)
    cfg = TrainConfig(model="125m", device="cpu")
    shape = make_plan(cfg, prof).shape
    assert cpu_compute_bytes(dataclasses.replace(cfg, grad_accum=256), shape) > 10 * cpu_compute_bytes(cfg, shape)
    machine = prof.save(tmp_path / "cpu.json")
    assert main(["plan", "125m", "--grad-accum", "256", "--machine", str(machine), "--no-extrapolate"]) == 1
    fit = next(ln for ln in capsys.readouterr().out.splitlines() if "host RAM" in ln and "DOES NOT FIT" in ln)
    assert "the step's compute on the CPU" in fit and "which grows with --micro-batch-size, --seq-len and --grad-accum" in fit, fit
    assert "lower --micro-batch-size, --seq-len or --grad-accum, " in fit, fit


def test_calibrate_refuses_an_output_path_it_cannot_write_before_measuring(tmp_path, capsys, monkeypatch):
    # -o DIR raised IsADirectoryError after ~30 s of measuring (leaving DIR.tmp), -o FILE/p.json FileExistsError
    import mtc.calibrate

    measured = []
    monkeypatch.setattr(mtc.calibrate, "calibrate", lambda **k: measured.append(1) or builtin("h100-box"))
    (tmp_path / "existing_dir").mkdir()
    (tmp_path / "afile").write_text("x")
    for out, says in ((tmp_path / "existing_dir", f"profile path {tmp_path / 'existing_dir'} is a directory; give a file "
                       f"path such as {tmp_path / 'existing_dir' / 'machine.json'}"),
                      (tmp_path / "afile" / "p.json", f"profile path {tmp_path / 'afile' / 'p.json'}: {tmp_path / 'afile'}, "
                       "a parent of it, is a file, not a directory")):
        assert main(["calibrate", "-o", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"mtc: error: {says}") and "\n" not in err, err
        with pytest.raises(ConfigError, match="profile path"):
            builtin("h100-box").save(out)  # the library's save says the same
    assert not measured and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "existing_dir"]
    assert main(["calibrate", "-o", str(tmp_path / "new" / "p.json")]) == 0 and measured == [1]
    assert MachineProfile.load(tmp_path / "new" / "p.json").name == "h100-box"


@pytest.mark.parametrize(("edit", "says"), [
    ({"cores": 0}, r"cores is 0, expected a measured figure > 0"),
    ({"cores": "two"}, r"cores is 'two', expected a finite integer >= 0"),
    ({"store_write_gbps": 0.0}, r"store_write_gbps is 0.0, expected a measured figure > 0"),
    ({"host_available_bytes": -5}, r"host_available_bytes is -5, expected a finite integer >= 0"),
    ({"h2d_gbps": float("nan")}, r"h2d_gbps is nan, expected a finite number >= 0"),
    ({"adamw_gparams_s": {"exact": 0}}, r"adamw_gparams_s is \{'exact': 0\}, expected G params/s > 0"),
    ({"adamw_impl": "fast"}, r"adamw_impl is 'fast', expected one of the measured implementations"),
])
def test_a_hand_edited_machine_profile_with_a_figure_that_cannot_be_is_refused_in_one_line(tmp_path, capsys, edit, says):
    # the planner divided by them (ZeroDivisionError) or compared them (TypeError), or printed nonsense
    d = {**builtin("h100-box").to_dict(), **edit}
    f = tmp_path / "m.json"
    f.write_text(json.dumps(d))
    assert main(["plan", "tiny", "--machine", str(f), "--no-extrapolate"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("mtc: error: machine profile 'h100-box': "), err
    assert __import__("re").search(says, err), err
    f.write_text(json.dumps([d]))
    assert main(["plan", "tiny", "--machine", str(f), "--no-extrapolate"]) == 2
    assert "machine profile must be a JSON object" in capsys.readouterr().err
