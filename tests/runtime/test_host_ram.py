"""Host RAM with all state on disk: gradients spilled to the store, disk updates in bounded chunks,
fixed buffers that do not grow with depth, and the planner's count of them."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from mtc.calibrate import builtin
from mtc.runtime import placement as pl
from mtc.runtime.grad_spill import grad_scratch_name
from mtc.runtime.state import read_params
from mtc.runtime.tiers import StateTiers
from mtc.train import build_model, train
from tests.runtime.engine_util import skewed_tokens, small_config

GIB = 2**30
_DEPTH = {"n_layers": 4}  # deep enough that spilled gradients (4 B/param) outweigh the slabs they need (3 layers' worth)
_CHUNK = 4096  # disk update chunk (elements) in these tests: every layer of the tiny model updates in several


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "tok.bin")


@pytest.fixture(scope="module")
def all_ram(tokens):
    res = train(small_config(steps=2, placement="ram", model_overrides=_DEPTH), None, tokens)
    yield res
    res.store.close()


def _numels(cfg) -> list[int]:
    """The program's layer sizes of the tiny Llama: embed, each block, then the final norm and head."""
    with torch.device("meta"):
        params = dict(build_model(cfg).named_parameters())
    blocks = cfg.model_overrides["n_layers"]
    out = [0] * (blocks + 2)
    for name, p in params.items():
        i = 0 if name.startswith("embed.") else int(name.split(".")[1]) + 1 if name.startswith("layers.") else blocks + 1
        out[i] += p.numel()
    return out


def _weights(res):
    return read_params(res.program, res.store, res.generation)


def _spill_budget_gb(numels: list[int]) -> float:
    """A RAM budget that holds all-disk with spilled gradients but not with kept ones."""
    disk = ["disk"] * len(numels)
    kw = {"disk_compute": "store", "disk_chunk_numel": _CHUNK, "tied_weights": False}  # (the tiny Llama ties no weight)
    spill = pl.pipeline_host_bytes(disk, numels, grad_spill=True, **kw)
    keep = pl.host_bytes_needed(disk, numels, 4, disk_compute="store") + pl.pipeline_host_bytes(disk, numels, **kw)
    assert spill < keep
    return (spill + keep) / 2 / GIB


def _assert_same_training(res, ref):
    assert res.losses == ref.losses
    w, w_ref = _weights(res), _weights(ref)
    assert all(torch.equal(w[k], w_ref[k]) for k in w_ref)


@pytest.mark.parametrize("spill", [False, True])
def test_chunked_disk_updates_with_or_without_spilled_gradients_are_bit_identical_to_all_ram(tokens, tmp_path, all_ram, monkeypatch, spill):
    monkeypatch.setattr(StateTiers, "disk_chunk_numel", _CHUNK)
    numels = [s.numel for s in all_ram.tiers.layers]
    kw = {"ram_budget_gb": _spill_budget_gb(numels)} if spill else {}
    res = train(small_config(steps=2, placement="disk", model_overrides=_DEPTH, **kw), tmp_path / "c", tokens)
    try:
        assert (res.tiers.spill is not None) == spill
        if spill:  # no host byte per parameter: everything the engine holds is the fixed pipeline
            assert all(s.grad is None and s.master is None and s.compute is None for s in res.tiers.layers)
            assert res.tiers.host_bytes() == sum(res.tiers.pipeline_bytes.values())
            assert res.store.has_array(grad_scratch_name(1))
        # the ring's sets are one chunk each, however large the layers
        assert res.tiers.pipeline_bytes["disk_ring"] == 3 * (16 if spill else 12) * _CHUNK
        chunks = sum(-(-n // _CHUNK) for n in numels if n)
        assert len(res.timeline.spans("disk_read_wait")) == 2 * chunks
        _assert_same_training(res, all_ram)
    finally:
        res.store.close()


def test_fixed_host_buffers_do_not_grow_with_depth_and_the_planner_counts_them(tokens, tmp_path, monkeypatch):
    monkeypatch.setattr(StateTiers, "disk_chunk_numel", _CHUNK)
    held, planned = [], []
    for n_layers in (3, 6):
        cfg = small_config(steps=1, placement="disk", model_overrides={"n_layers": n_layers})
        numels = _numels(cfg)
        res = train(cfg.__class__(**{**cfg.to_dict(), "optim": cfg.optim, "ram_budget_gb": _spill_budget_gb(numels)}),
                    tmp_path / f"d{n_layers}", tokens)
        try:
            assert res.tiers.spill is not None and [s.numel for s in res.tiers.layers] == numels
            engine = res.tiers.host_bytes()
            plan = pl.pipeline_host_bytes(res.placement, numels, disk_compute="store", grad_spill=True, disk_chunk_numel=_CHUNK,
                                          tied_weights=False)
            assert engine == plan  # the planner counts exactly what the engine allocates (this model ties no weight)
            # by default it leaves room for tied weights: never less
            assert pl.pipeline_host_bytes(res.placement, numels, disk_compute="store", grad_spill=True, disk_chunk_numel=_CHUNK) > plan
            held.append(engine)
            planned.append(plan)
        finally:
            res.store.close()
    assert held[0] == held[1] and planned[0] == planned[1]  # twice the depth, the same bytes


def test_gradients_are_spilled_only_when_the_budget_cannot_hold_them():
    numels, disk = [100] * 8, ["disk"] * 8
    kw = {"disk_compute": "store", "disk_chunk_numel": 4096}
    keep = pl.host_bytes_needed(disk, numels, 4, disk_compute="store") + pl.pipeline_host_bytes(disk, numels, **kw)
    cpu = {"disk_compute": "store"}
    assert not pl.choose_grad_spill(disk, numels, 4, ram_bytes=keep, **cpu)
    assert pl.choose_grad_spill(disk, numels, 4, ram_bytes=keep - 1, **cpu)
    assert not pl.choose_grad_spill(["ram"] * 8, numels, 4, ram_bytes=0, **cpu)  # no disk layer: nothing to spill
    # CUDA: disk layers' gradients wait in GPU memory (4 B/param) unless the GPU budget cannot hold them
    gpu = {"ram_bytes": 0, "device_is_cuda": True}
    assert not pl.choose_grad_spill(disk, numels, 2, gpu_bytes=4 * 800, **gpu)
    assert pl.choose_grad_spill(disk, numels, 2, gpu_bytes=4 * 800 - 1, **gpu)
    assert not pl.choose_grad_spill(disk, numels, 2, gpu_bytes=None, **gpu)  # no budget known: as before
    # spilling trades the 4 B/param for two staging chunks and a gradient buffer per ring set
    big = [10**7] * 8
    spilled = pl.pipeline_host_bytes(disk, big, disk_compute="store", device_is_cuda=True, grad_spill=True)
    kept = pl.pipeline_host_bytes(disk, big, disk_compute="store", device_is_cuda=True)
    assert spilled - kept == 2 * 4 * 4 * 2**20  # ring sets are one 4M-element chunk, not a 10M-element layer


def test_auto_reads_bf16_disk_weights_from_the_store_when_ram_cannot_hold_their_copy(tokens, tmp_path, monkeypatch):
    """`disk_compute` auto keeps disk layers' bf16 copy pinned in RAM while the budget holds it
    for every layer on disk, and otherwise reads their weights from the store at each visit: the
    run trains, within its budget, exactly as one told `store`."""
    from mtc.train import run_disk_compute

    monkeypatch.setattr(StateTiers, "disk_chunk_numel", _CHUNK)
    cfg = small_config(steps=2, placement="disk", compute_dtype="bfloat16", model_overrides=_DEPTH)
    numels = _numels(cfg)
    disk = ["disk"] * len(numels)
    kw = {"grad_spill": True, "disk_chunk_numel": _CHUNK, "tied_weights": False}
    ram_need = pl.host_bytes_needed(disk, numels, 2, disk_compute="ram", grad_spill=True) + pl.pipeline_host_bytes(disk, numels, **kw)
    store_need = pl.host_bytes_needed(disk, numels, 2, disk_compute="store", grad_spill=True) + pl.pipeline_host_bytes(
        disk, numels, disk_compute="store", **kw)
    assert store_need < ram_need
    with_budget = lambda b, **more: cfg.__class__(**{**cfg.to_dict(), "optim": cfg.optim, "ram_budget_gb": b, **more})  # noqa: E731
    probe = train(with_budget(None), None, tokens)  # the traced layers, for the resolver
    program = probe.program
    probe.store.close()
    assert run_disk_compute(with_budget(ram_need / GIB), program) == "ram"
    tight = with_budget((store_need + ram_need) / 2 / GIB)
    assert run_disk_compute(tight, program) == "store"
    assert run_disk_compute(with_budget(ram_need / GIB, disk_compute="store"), program) == "store"  # told: kept
    assert run_disk_compute(with_budget(None, compute_dtype="float32"), program) == "store"  # fp32: always read
    res = train(tight, tmp_path / "auto", tokens)
    ref = train(with_budget(None, disk_compute="store"), tmp_path / "store", tokens)
    try:
        assert res.tiers.disk_compute == "store" and all(s.compute is None for s in res.tiers.layers)
        assert res.tiers.host_bytes() <= tight.ram_budget_gb * GIB
        assert res.losses == ref.losses and all(map(torch.isfinite, map(torch.tensor, res.losses)))
    finally:
        res.store.close()
        ref.store.close()


def test_host_bytes_count_the_master_of_fp32_ram_layers(all_ram):
    """In fp32 a ram layer's compute copy is its master: the tiers hold master, m, v and the
    gradient, 16 B/param (the master was once skipped as the compute copy: 12 B/param reported,
    so bench_train's host bytes per parameter read 4 B low for fp32 runs)."""
    tiers = all_ram.tiers
    assert all(s.compute is s.master for s in tiers.layers)
    params = sum(s.numel for s in tiers.layers)
    assert tiers.host_bytes() - sum(tiers.pipeline_bytes.values()) == 16 * params


def test_disk_layers_go_to_and_from_the_store_without_bounce_buffers(tokens, tmp_path, monkeypatch):
    """The store reads and writes page-aligned buffers of whole pages with O_DIRECT; anything else
    goes through a bounce buffer that each I/O thread keeps for the run. A new run's disk layers
    were written from torch-allocated tensors, and on the CPU device each visit read a disk layer's
    weights into a torch-allocated weight slot: every I/O thread then held a block-sized buffer
    the plan does not count (4 x 11.5 MiB at dim 512)."""
    from mtc.store import fastio

    # dim 512: every block's state is whole pages (the embed's and head's are not)
    cfg = small_config(steps=2, placement="disk", device="cpu", grad_accum=1,
                       model_overrides={"n_layers": 2, "dim": 512, "ffn_dim": 1536, "n_heads": 8, "n_kv_heads": 2})
    blocks = _numels(cfg)[1:-1]
    assert all(n * 4 % 4096 == 0 for n in blocks)  # whole pages: the store needs no bounce for them
    asked: list[int] = []
    real = fastio._bounce
    monkeypatch.setattr(fastio, "_bounce", lambda n: (asked.append(n), real(n))[1])
    res = train(cfg, tmp_path / "s", tokens)
    res.store.close()
    assert res.placement == ["disk"] * len(res.placement) and asked  # (the embed and head are not whole pages)
    assert max(asked) < min(blocks) * 4


def test_the_plan_counts_the_bounce_buffers_the_store_io_threads_keep(tokens, tmp_path, monkeypatch):
    """Every I/O thread of a store on disk keeps a bounce buffer for the run (a chunk's unaligned
    part: an edge chunk's zero fill, the CRC32C), up to 1 MiB each: 4 MiB at vocab 8193, where the
    embed's last chunk is almost all zero fill. The plan's host RAM counted none of it. Small
    chunks here make every layer's last chunk an edge chunk, as a large layer's is."""
    from mtc.costmodel import shape_from_program
    from mtc.planner import make_plan, memory
    from mtc.store import fastio, tensor_store

    monkeypatch.setattr(tensor_store, "_CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(fastio, "_tls", type(fastio._tls)())  # no buffer left from an earlier test
    held: dict[str, int] = {}
    real = fastio._bounce

    def bounce(n: int):
        b = real(n)
        held[threading.current_thread().name] = fastio._tls.bounce.nbytes  # what the thread keeps
        return b

    monkeypatch.setattr(fastio, "_bounce", bounce)
    cfg = small_config(steps=2, placement="disk", io_threads=3)
    res = train(cfg, tmp_path / "s", tokens)
    try:
        shape = shape_from_program(res.program, cfg.model, 4)
        mem = memory(cfg, shape, res.placement, set(), cuda=False)
        assert len(held) == cfg.io_threads and min(held.values()) > fastio.ALIGN  # every thread bounced an edge chunk
        assert sum(held.values()) <= mem.store_io <= cfg.io_threads * fastio.BOUNCE_MAX
        assert mem.host == res.tiers.host_bytes()  # the engine's figure stays exact; the buffers are beside it
        assert memory(cfg, shape, res.placement, set(), cuda=False, store_on_disk=False).store_io == 0
    finally:
        res.store.close()
    plan = make_plan(cfg, dataclasses.replace(builtin("h100-box"), accelerator="cpu", gpu_memory_bytes=0), program=res.program)
    check = next(c for c in plan.checks if c.what.startswith("host RAM"))
    assert check.need == plan.memory.host_total and "store I/O bounce buffers" in check.what, check.line()


def test_a_resumed_run_without_generated_kernels_does_not_import_triton(tokens, tmp_path):
    """The host optimizer's AdamW (`mtc.kernels.adamw_ref`) came from the Triton kernel's module,
    so every run imported triton, which a run without generated kernels never calls: ~80 MiB of
    RSS (a resumed tiny run on the CPU: 414 -> 338 MiB). A new run's trace imports it anyway
    (torch's dynamo does), so a resumed one shows it."""
    import json
    import os
    import subprocess
    import sys

    cfg = small_config(steps=1, placement="ram", device="cpu", kernels="unfused")
    train(cfg, tmp_path / "s", tokens).store.close()
    probe = (
        "import json, sys\n"
        "from mtc.config import TrainConfig\n"
        "from mtc.train import train\n"
        "cfg = TrainConfig.from_dict(json.loads(sys.argv[1]))\n"
        "res = train(cfg, sys.argv[2], sys.argv[3], allow_change=('steps',))\n"
        "res.store.close()\n"
        "print(res.end_step, 'triton' in sys.modules)\n"
    )
    # (the tests' conftest enables Triton's interpreter, which mtc.kernels then imports: not a user's CPU run)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": os.pathsep.join(sys.path)}
    resumed = dataclasses.replace(cfg, steps=2).to_dict()
    out = subprocess.run([sys.executable, "-c", probe, json.dumps(resumed), str(tmp_path / "s"), str(tokens.path)],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["2", "False"], out.stdout
