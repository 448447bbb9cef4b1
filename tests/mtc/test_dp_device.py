"""Data parallelism with device collectives (issue 13, `mtc.runtime.device_comm`): the gradient is
reduce-scattered and the updated shards all-gathered on the device, and the gpu tier is sharded.

On the CPU, ``dp_collectives = "device"`` runs that very code path with gloo on the CPU "device"
tensors; the ranks are real processes on this host, compared with the single-process run of the
same config and global batch (the fp32 contract, to 1e-5). The NCCL run is the gpu-marked test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtc import dist, shards
from mtc.cli import main
from mtc.errors import ConfigError
from mtc.train import train
from tests.mtc.test_data_parallel import ROOT, STEPS, _assert_close, _config, _env, _free_port, _launch, _state, _train_args
from tests.runtime.engine_util import skewed_tokens

MIXED = "gpu:0,ram:1,disk:2,ram:3"  # embed resident and sharded on the device, a block on disk (its shard in the rank's store), the others in host RAM
STREAMED = "1"  # ram layer 1's shard is updated on the device (gpu_update), layer 3's by the host
# the head (ram) shares the embedding's weight (gpu): its fetch copies a resident gpu layer's gathered range
TIED = {"n_layers": 2, "tie_embeddings": True}


def _write(cfg: object, path: Path) -> Path:
    path.write_text(json.dumps(cfg.to_dict()))
    return path


def _wait(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        assert p.wait(timeout=400) == 0, p.stderr.read()[-3000:]


# -- placement and backend choice (fast) --------------------------------------------------------


def test_device_collectives_choice():
    assert dist.device_collectives(_config(dp_collectives="device"))  # the CPU device: gloo on its tensors
    assert not dist.device_collectives(_config(dp_collectives="auto"))  # CPU: the host path
    assert not dist.device_collectives(_config(dp_collectives="host"))
    with pytest.raises(ConfigError, match="dp_collectives"):
        _config(dp_collectives="nccl").validate()


def test_gpu_tier_is_sharded_only_with_device_collectives(program):
    w2, n = dist.World(0, 2, 0, 2), program.n_layers
    gpu = ["gpu"] * n
    dist.check_placement(w2, gpu, set(), program, device=True)
    with pytest.raises(ConfigError, match="only with device collectives .* --dp-collectives device"):
        dist.check_placement(w2, gpu, set(), program, device=False)
    dist.check_placement(w2, ["ram"] * n, {1}, program, device=True)  # the GPU updates ram layer 1's shard
    with pytest.raises(ConfigError, match="gpu_update names layers .* need device collectives"):
        dist.check_placement(w2, ["ram"] * n, {1}, program, device=False)
    dist.check_placement(w2, ["gpu", "disk"] + ["ram"] * (n - 2), set(), program, device=True)  # every tier (disk: dp_disk)
    # auto placement: gpu layers in forward order while their per-rank bytes fit the GPU budget, the rest in RAM
    auto = _config(placement="auto", gpu_update="auto", dp_collectives="device")
    plan = ["gpu", "disk"] + ["ram"] * (n - 2)  # the single-process choice does not matter
    need = [dist.gpu_shard_bytes(program.layer_numel(i), 2, 4) for i in range(n)]
    n0 = program.layer_numel(0)  # fp32: the shard's master, m, v, reduced gradient; the whole gradient and compute copy
    assert n0 % 2 == 0 and need[0] == 16 * n0 // 2 + 8 * n0
    assert dist.gpu_shard_bytes(n0, 8, 2) == 16 * n0 // 8 + 2 * n0 // 8 + 6 * n0  # bf16: and the shard's bf16 copy
    assert dist.data_parallel_placement(w2, auto, plan, {2}, program, gpu_bytes=need[0]) == (["gpu"] + ["ram"] * (n - 1), set())
    assert dist.data_parallel_placement(w2, auto, plan, {2}, program, gpu_bytes=sum(need)) == (["gpu"] * n, set())
    assert dist.data_parallel_placement(w2, auto, plan, {2}, program) == (["ram"] * n, set())  # no GPU
    host = _config(placement="auto", gpu_update="auto", dp_collectives="host")
    assert dist.data_parallel_placement(w2, host, plan, {2}, program, gpu_bytes=sum(need)) == (["ram"] * n, set())


def test_one_rank_runs_the_data_parallel_engine_only_when_asked():
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert not dist.world_from_env(env).distributed
    assert dist.world_from_env(dict(env, MTC_DP_ONE_RANK="1")).distributed
    assert not dist.world_from_env({"MTC_DP_ONE_RANK": "1"}).distributed  # not under torchrun: nothing to join


def test_the_engine_model_predicts_the_device_path_on_cuda():
    """`mtc plan --dp-model engine` on an 8-GPU box: NCCL, and only the gradient's shard crosses
    PCIe, where ``host`` (dp_collectives host) sends the whole gradient through gloo."""
    from mtc.calibrate import builtin
    from mtc.costmodel import model_shape
    from mtc.dist_plan import make_dist_plan

    cfg = _config(placement="ram", gpu_update="none", durability="weights", grad_accum=16)
    shape = model_shape(cfg, "bfloat16")
    dev, host = (make_dist_plan(cfg, builtin("8x-h100"), 8, shape=shape, engine=e) for e in ("engine", "host"))
    assert "nccl" in dev.dist.link.name and "gloo" in host.dist.link.name
    assert dev.step.step_s < host.step.step_s


# -- real ranks over gloo on the CPU "device" (slow) --------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process reference; 2 ranks with device collectives and mixed gpu/ram placement,
    unbroken, and the same stopped after step 1 and relaunched (the resume of sharded gpu- and
    ram-tier state); and one rank forced onto the data-parallel engine (MTC_DP_ONE_RANK=1)."""
    d = tmp_path_factory.mktemp("dpdev")
    tokens = skewed_tokens(d / "tok.bin")
    mixed = _write(_config(placement=MIXED, gpu_update=STREAMED, dp_collectives="device", model_overrides=TIED), d / "mixed.json")
    port = _free_port()
    stopped = [subprocess.Popen([sys.executable, *_train_args(mixed, d / "mixed", tokens.path), "--stop-after", "1"],
                                env=dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                                         LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2"),
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
    unbroken = _launch(2, mixed, d / "unbroken", tokens.path)
    res = train(_config(model_overrides=TIED), d / "ref", tokens)
    res.store.close()
    _wait(stopped)
    assert json.loads((d / "mixed" / "commit.json").read_text())["step"] == 1
    again = _launch(2, mixed, d / "mixed", tokens.path)  # resumes the sharded state
    one = subprocess.Popen([sys.executable, *_train_args(mixed, d / "one", tokens.path)], cwd=ROOT,
                           env=dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                                    LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MTC_DP_ONE_RANK="1"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait([*again, one, *unbroken])
    return d


@pytest.mark.slow
def test_device_path_matches_the_single_process_run(runs):
    """Loss, gradient norm (clipping active), master, m and v to 1e-5, with grad accumulation
    (3 micro-batches per rank): gpu layers, a ram layer the GPU updates and one the host updates
    side by side, stopped after step 1 and resumed
    (kill -9 of a rank: the ram-tier test in tests/mtc/test_data_parallel.py)."""
    _assert_close(runs / "mixed", runs / "ref")
    resolved = json.loads((runs / "mixed" / "logs" / "config-step1.json").read_text())
    assert resolved["resolved_placement"] == MIXED and resolved["dp_collectives"] == "device"
    assert resolved["gpu_update_layers"] == [1]
    for r in range(2):
        with shards.TensorStore.open(shards.rank_dir(runs / "mixed", r, 2), read_only=True) as rs:
            assert rs.last_commit().step == STEPS


@pytest.mark.slow
def test_stopped_and_relaunched_is_bit_identical_to_the_unbroken_run(runs):
    """Sharded gpu-tier (and ram-tier) state resumes bit-identically at the same world size."""
    (a, la, na), (b, lb, nb) = _state(runs / "mixed"), _state(runs / "unbroken")
    assert la == lb and na == nb and all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
def test_one_rank_forced_onto_the_data_parallel_engine(runs):
    """World size 1 with MTC_DP_ONE_RANK=1: a process group of one, a shard store, the device path."""
    assert shards.rank_dir(runs / "one", 0, 1).is_dir()
    assert json.loads((runs / "one" / "commit.json").read_text())["meta"]["shards"]["world_size"] == 1
    _assert_close(runs / "one", runs / "ref")


@pytest.mark.slow
def test_reshard_gpu_tier_store_2_to_1_is_bit_identical(runs, tmp_path):
    store = tmp_path / "mixed"
    shutil.copytree(runs / "mixed", store)
    before, _, _ = _state(store)
    assert main(["verify", str(store)]) == 0  # the global record and both shard stores
    assert main(["reshard", str(store), "--world-size", "1"]) == 0
    assert not shards.rank_dir(store, 0, 2).exists()
    after, _, _ = _state(store)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert main(["verify", str(store)]) == 0


# -- NCCL on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_device_path_world_one_under_torchrun(tmp_path):
    """torchrun with one process and MTC_DP_ONE_RANK=1: the data-parallel engine with NCCL on the
    device path (comm stream, events, gpu and ram tiers), to 1e-5 of the plain run (fp32, no TF32)."""
    tokens = skewed_tokens(tmp_path / "tok.bin")
    kw = {"device": "cuda", "allow_tf32": False, "placement": "gpu:0-1,ram:2-3", "grad_accum": 4}
    cfg = _write(_config(dp_collectives="device", **kw), tmp_path / "run.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), *_train_args(cfg, tmp_path / "w1", tokens.path)]
    one = subprocess.run(cmd, env=dict(_env(), MTC_DP_ONE_RANK="1"), cwd=ROOT, capture_output=True, text=True, timeout=600,
                         check=False)
    assert one.returncode == 0, one.stderr[-3000:]
    assert json.loads((tmp_path / "w1" / "commit.json").read_text())["meta"]["shards"]["world_size"] == 1
    res = train(_config(**kw), tmp_path / "ref", tokens)
    res.store.close()
    _assert_close(tmp_path / "w1", tmp_path / "ref")
