"""The disk tier: placement from a RAM budget, bit-identical training with state on disk, bounded
host RAM per parameter, reads ahead of write-behind, and the raw vs store throughput measurement."""

from __future__ import annotations

import threading

import pytest
import torch
from mtc.store.diskbench import MODES, compare_throughput, raw_throughput, store_throughput
from mtc.store.fastio import PRIORITY_READ, PRIORITY_READ_AHEAD, PRIORITY_WRITE, PriorityPool

from mtc.runtime import placement as pl
from mtc.runtime.state import read_params
from mtc.train import build_model, train
from tests.runtime.engine_util import skewed_tokens, small_config

GIB = 2**30


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "tok.bin")


def _weights(res):
    return read_params(res.program, res.store, res.generation)


# -- placement from budgets ------------------------------------------------------------------------


def test_auto_placement_fills_gpu_then_ram_then_disk_within_the_budgets():
    numels = [10, 10, 10, 10]
    # fp32 compute on the CPU device: ram 16 B/param, disk 4 (gradient; compute copy read per visit)
    kw = {"gpu_bytes": 0, "disk_compute": "store", "grads_on_device": False}
    assert pl.auto_placement(numels, 4, ram_bytes=16 * 40, **kw) == ["ram"] * 4
    assert pl.auto_placement(numels, 4, ram_bytes=4 * 40, **kw) == ["disk"] * 4
    assert pl.auto_placement(numels, 4, ram_bytes=0, **kw) == ["disk"] * 4  # does not fit at all: the fit check refuses
    # 2 ram layers (2 x 160) + 2 disk layers (2 x 40) = 400 bytes
    assert pl.auto_placement(numels, 4, ram_bytes=400, **kw) == ["ram", "ram", "disk", "disk"]
    assert pl.auto_placement(numels, 4, ram_bytes=399, **kw) == ["ram", "disk", "disk", "disk"]
    # CUDA, bf16: gpu first; disk layers' gradients wait on the GPU, their bf16 copy in RAM (2 B/param)
    got = pl.auto_placement(numels, 2, gpu_bytes=18 * 10 + 4 * 30, ram_bytes=18 * 10 + 2 * 20, disk_compute="ram", grads_on_device=True)
    assert got == ["gpu", "ram", "disk", "disk"]
    need = pl.host_bytes_needed(got, numels, 2, disk_compute="ram", grads_on_device=True)
    assert need == 18 * 10 + 2 * 20


def test_host_bytes_per_param_and_pipeline():
    assert pl.host_bytes_per_param("disk", 4, disk_compute="store", grads_on_device=True) == 0
    assert pl.host_bytes_per_param("disk", 4, disk_compute="store", grads_on_device=False) == 4
    assert pl.host_bytes_per_param("disk", 2, disk_compute="ram", grads_on_device=True) == 2
    assert pl.host_bytes_per_param("ram", 4) == 16
    # the pipeline depends on the largest disk layer, not on the depth
    shallow = pl.pipeline_host_bytes(["disk"] * 4, [100] * 4, disk_compute="store", device_is_cuda=True)
    deep = pl.pipeline_host_bytes(["disk"] * 40, [100] * 40, disk_compute="store", device_is_cuda=True)
    assert shallow == deep == 3 * 16 * 100 + 2 * 2 * 4 * 100
    assert pl.pipeline_host_bytes(["ram"] * 4, [100] * 4, device_is_cuda=True) == 0


def test_default_ram_budget_keeps_a_margin():
    assert pl.default_ram_budget(10 * GIB) == 8 * GIB  # at least 2 GiB
    assert pl.default_ram_budget(100 * GIB) == 85 * GIB  # 15 %
    assert pl.default_ram_budget(GIB) == 0
    assert 0 < pl.default_ram_budget() < pl.available_host_bytes()


# -- training with state on disk -------------------------------------------------------------------


# many narrow layers: the disk pipeline's fixed buffers (a few layers' worth) stay small beside the state
_DEEP = {"n_layers": 14, "dim": 64, "ffn_dim": 176, "n_heads": 4, "n_kv_heads": 2}


def test_a_small_ram_budget_puts_state_on_disk_and_training_is_bit_identical(tokens, tmp_path):
    base = small_config(steps=2, model_overrides=_DEEP)
    fp32_state = 12 * sum(p.numel() for p in build_model(base).parameters())  # master, m, v
    budget = 0.9 * fp32_state  # the model's fp32 state exceeds the budget
    small = train(small_config(steps=2, model_overrides=_DEEP, placement="auto", ram_budget_gb=budget / GIB),
                  tmp_path / "budget", tokens)
    ram = train(small_config(steps=2, model_overrides=_DEEP, placement="ram"), None, tokens)
    try:
        assert "disk" in small.placement and "ram" in small.placement, small.placement
        assert small.host_state_bytes <= budget
        assert ram.host_state_bytes > budget
        assert small.losses == ram.losses
        w_small, w_ram = _weights(small), _weights(ram)
        assert all(torch.equal(w_small[k], w_ram[k]) for k in w_ram)
    finally:
        small.store.close()
        ram.store.close()


@pytest.mark.parametrize("disk_compute", ["store", "ram"])
def test_all_disk_is_bit_identical_to_all_ram_on_a_local_store(tokens, tmp_path, disk_compute):
    disk = train(small_config(steps=3, placement="disk", disk_compute=disk_compute), tmp_path / "disk", tokens)
    ram = train(small_config(steps=3, placement="ram"), None, tokens)
    try:
        assert disk.losses == ram.losses
        w_disk, w_ram = _weights(disk), _weights(ram)
        assert all(torch.equal(w_disk[k], w_ram[k]) for k in w_ram)
        # the read-ahead ran: every disk update found its state read (a span per layer and step)
        waits = disk.timeline.spans("disk_read_wait")
        assert len(waits) == 3 * sum(1 for s in disk.tiers.layers if s.numel)
        if disk_compute == "store":  # weights came from the store at each visit, no compute copy in RAM
            assert disk.timeline.spans("visit_read")
            assert all(s.compute is None for s in disk.tiers.layers)
    finally:
        disk.store.close()


def test_the_disk_tier_rewrites_a_torn_generation_in_place_through_the_direct_path(tokens, tmp_path, monkeypatch):
    # A crash during write-behind leaves the uncommitted generation's chunk files torn (overwritten in
    # place: half new, half old). The resumed run reads the committed generation through the store's
    # direct chunk path and rewrites the torn files in place, and ends bit-identical to an unbroken run.
    from mtc.store import tensor_store

    cfg = small_config(steps=4, placement="disk")
    ram = train(small_config(steps=4, placement="ram"), None, tokens)
    part = train(cfg, tmp_path / "s", tokens, stop_after=2)
    try:
        last = part.store.last_commit()
        assert last.step == 2
        state = [s.layer for s in part.tiers.layers if s.numel]
        torn = [p for name in part.store.array_names() if name.startswith("layers/") and name.endswith(f"/g{1 - last.generation}")
                for p in (part.store.chunk_path(name, c) for c in range(part.store.array_info(name).n_chunks))]
    finally:
        part.store.close()
    assert len(torn) >= 3 * len(state)
    for p in torn:
        with open(p, "r+b") as f:
            f.write(b"\xff" * 4096)

    reads: list[str] = []
    writes: list[tuple[str, bool, bool]] = []  # (chunk file, in place asked, in place done)
    real_read, real_write = tensor_store.read_chunk_file, tensor_store.write_chunk_file

    def read(path, *a, **kw):
        reads.append(str(path))
        return real_read(path, *a, **kw)

    def write(path, *a, in_place=False, **kw):
        done = real_write(path, *a, in_place=in_place, **kw)
        writes.append((str(path), in_place, done))
        return done

    monkeypatch.setattr(tensor_store, "read_chunk_file", read)
    monkeypatch.setattr(tensor_store, "write_chunk_file", write)
    resumed = train(cfg, tmp_path / "s", tokens)
    try:
        assert resumed.store.last_commit().step == 4
        for kind in ("master", "m", "v"):  # every disk layer's state was read through fastio (O_DIRECT where allowed)
            assert all(any(f"layers/{i:04d}/{kind}/g" in r for r in reads) for i in state)
        steps = [w for w in writes if "/layers/" in w[0]]
        assert len(steps) >= 2 * 3 * len(state) and all(asked and done for _p, asked, done in steps)  # every one in place
        w_ram, w_res = _weights(ram), _weights(resumed)
        assert all(torch.equal(w_ram[k], w_res[k]) for k in w_ram)
    finally:
        ram.store.close()
        resumed.store.close()


def test_host_ram_per_parameter_with_all_state_on_disk_is_bounded(tokens, tmp_path):
    fixed = []
    for n_layers in (2, 6):
        cfg = small_config(steps=1, placement="disk", model_overrides={"n_layers": n_layers})
        res = train(cfg, tmp_path / f"s{n_layers}", tokens)
        try:
            numels = [s.numel for s in res.tiers.layers]
            params = sum(numels)
            pipeline = sum(res.tiers.pipeline_bytes.values())
            # per parameter only the gradient (the CPU device's memory is host memory); no compute copy
            assert all(s.compute is None and s.master is None for s in res.tiers.layers)
            assert res.tiers.host_bytes() - pipeline == 4 * params
            # the rest is the bounded pipeline (read-ahead ring, visit staging, device rings): a few layers' worth
            assert pipeline <= pl.pipeline_host_bytes(res.placement, numels, disk_compute="store") <= 100 * max(numels)
            assert res.tiers.host_bytes() <= 4 * params + 100 * max(numels)
            fixed.append(pipeline)
        finally:
            res.store.close()
    assert fixed[0] == fixed[1]  # three times the depth, the same fixed pipeline


# -- I/O ordering and throughput -------------------------------------------------------------------


def test_reads_that_gate_compute_run_before_read_ahead_and_write_behind():
    pool = PriorityPool(1, "test-io")
    gate = threading.Event()
    order: list[str] = []
    try:
        pool.submit(gate.wait, PRIORITY_READ)  # occupies the only worker while the queue fills
        futs = [pool.submit(lambda k=k: order.append(k), p) for k, p in
                [("w1", PRIORITY_WRITE), ("ahead1", PRIORITY_READ_AHEAD), ("w2", PRIORITY_WRITE), ("read", PRIORITY_READ),
                 ("ahead2", PRIORITY_READ_AHEAD)]]
        gate.set()
        for f in futs:
            f.result(timeout=10)
        assert order == ["read", "ahead1", "ahead2", "w1", "w2"]
    finally:
        pool.shutdown()


def test_raw_and_store_throughput_are_measured_on_the_same_disk(tmp_path):
    raw = raw_throughput(tmp_path, 32 * 2**20, depth=16)
    st = store_throughput(tmp_path, 32 * 2**20, io_threads=4)
    for r in (raw, st):
        for k in ("write_fresh_GBps", "write_GBps", "read_GBps", "mix_GBps"):
            assert r[k] > 0
    assert raw["block"] >= 2**20 and raw["depth"] >= 16
    assert list(tmp_path.iterdir()) == []  # scratch files removed
    with pytest.raises(ValueError):
        raw_throughput(tmp_path, 2**20, block=4096)


def test_compare_throughput_alternates_trials_and_reports_medians(tmp_path):
    r = compare_throughput(tmp_path, 16 * 2**20, trials=3, io_threads=2)
    assert len(r["raw_trials"]) == len(r["store_trials"]) == 3
    for side in ("raw", "store"):
        for k in MODES:
            assert r[f"{side}_median"][k] == sorted(t[k] for t in r[f"{side}_trials"])[1]
    for k in MODES:
        assert r["store_over_raw"][k] == r["store_median"][k] / r["raw_median"][k]
    assert list(tmp_path.iterdir()) == []


def _chunk_files(res, generation: int) -> list:
    """Chunk files of the disk layers' state arrays of ``generation`` that exist on disk."""
    from mtc.store import state_array_name

    out = []
    for s in res.tiers.layers:
        if s.tier == "disk" and s.numel:
            for kind in ("master", "m", "v"):
                name = state_array_name(s.layer, kind, generation)
                out += [p for c in range(res.store.array_info(name).n_chunks) if (p := res.store.chunk_path(name, c)).exists()]
    return out


@pytest.mark.parametrize("disk_compute", ["store", "ram"])
def test_without_durability_disk_layers_keep_one_generation_updated_in_place(tokens, tmp_path, disk_compute):
    """Durability none: nothing resumes, so disk layers update the generation they read in place,
    half the disk of two generations (as the fit check plans it); training is the same, bit for bit."""
    assert [pl.disk_bytes_needed(["disk", "ram"], [10, 5], m) for m in ("full", "weights", "none")] == [360, 280, 120]
    assert pl.disk_bytes_needed(["disk"], [10], "none", grad_spill=True) == 160
    none = train(small_config(steps=3, placement="disk", disk_compute=disk_compute, durability="none"), tmp_path / "none", tokens)
    full = train(small_config(steps=3, placement="disk", disk_compute=disk_compute), tmp_path / "full", tokens)
    try:
        assert none.losses == full.losses
        assert _chunk_files(none, 0) and not _chunk_files(none, 1)  # one generation on disk
        assert _chunk_files(full, 0) and _chunk_files(full, 1)
        w_none, w_full = read_params(none.program, none.store, 0), _weights(full)  # the newest state, where it started
        assert all(torch.equal(w_none[k], w_full[k]) for k in w_full)
        assert len(none.timeline.spans("disk_read_wait")) == 3 * sum(1 for s in none.tiers.layers if s.numel)
    finally:
        none.store.close()
        full.store.close()


def test_a_run_resumed_without_durability_leaves_its_last_commit_whole(tokens, tmp_path):
    """Resumed from a durable commit with durability none, the disk layers first write the other
    generation, then update that one in place: the commit's generation is never written, so the
    run can still resume from it; training goes on as an uninterrupted run."""
    from mtc.store import TensorStore, state_array_name

    path = tmp_path / "run"
    train(small_config(steps=4, placement="disk"), path, tokens, stop_after=2).store.close()
    with TensorStore.open(path, read_only=True) as st:
        last = st.last_commit()
        names = [n for n in st.array_names() if n.startswith("layers/") and n.endswith(f"/g{last.generation}")]
        before = {n: st.read(n) for n in names}
    assert last.step == 2 and before
    res = train(small_config(steps=4, placement="disk", durability="none"), path, tokens)
    ref = train(small_config(steps=4, placement="disk"), tmp_path / "ref", tokens)
    try:
        assert res.losses == ref.losses[2:]
        assert res.store.last_commit().step == 2
        assert all(torch.equal(res.store.read(n), t) for n, t in before.items())
        assert state_array_name(1, "master", last.generation) in before
    finally:
        res.store.close()
        ref.store.close()


def test_the_read_ahead_waits_for_the_last_write_of_an_in_place_generation(tokens, tmp_path, monkeypatch):
    """One disk layer (fewer than the ring's sets, so the ring does not order it) updated in place,
    with writes slowed: the next step's read-ahead must still wait for the last write of the
    layer, or it reads stale state and training drifts from the same run with all state in RAM."""
    import time

    from mtc.store import TensorStore

    cfg = small_config(steps=3, placement="ram:0-1,disk:2,ram:3", durability="none")
    ref = train(small_config(steps=3, placement="ram", durability="none"), None, tokens)
    ref.store.close()
    write = TensorStore.write_rows_async

    def slow(self, *a, **k):
        time.sleep(0.3)
        return write(self, *a, **k)

    monkeypatch.setattr(TensorStore, "write_rows_async", slow)
    res = train(cfg, tmp_path / "slow", tokens)
    res.store.close()
    assert res.placement.count("disk") == 1 and res.losses == ref.losses


def test_closing_the_ring_ends_a_read_ahead_that_waits_for_a_set_or_a_write(tmp_path):
    """After a failed step (a data-parallel peer killed mid-step) the update never gives its set
    back, or a layer's write is never issued: closing the ring must still stop its read-ahead at
    once (a rank whose peer died sat 30 s in the join) and fail the chunks it did not read."""
    import time
    from concurrent.futures import Future

    from mtc.store import TensorStore

    from mtc.runtime.disk_tier import DiskRing
    from mtc.runtime.tiers import StateTiers
    from mtc.tracer import trace

    cfg = small_config()
    program = trace(build_model(cfg, device="meta"), cfg.micro_batch_size, cfg.seq_len)
    tiers = StateTiers(program, ["disk"] * program.n_layers, torch.device("cpu"), torch.float32)
    for blocked_on in ("set", "write"):
        with TensorStore.create(tmp_path / blocked_on) as store:
            tiers.create_arrays(store, "full")
            ring = DiskRing(tiers, store, slots=1 if blocked_on == "set" else 2)
            first, second = ring.layers[:2]
            never = Future()  # a write that is never issued
            ring.post(0, {second: never} if blocked_on == "write" else {})
            chunks = ring.take(first)
            chunks[0].result(timeout=30)  # the first chunk holds a set (the update never releases it)
            later = ring.take(second)
            time.sleep(0.2)
            assert not later[0].done(), "the read-ahead should be waiting for a set or the layer's write"
            t0 = time.perf_counter()
            ring.close()
            assert time.perf_counter() - t0 < 5 and not ring._thread.is_alive()
            with pytest.raises(RuntimeError, match="read-ahead was stopped"):
                later[0].result(timeout=1)


def test_a_failed_write_reaches_the_update_whatever_its_error(tmp_path):
    """The read-ahead waits for a layer's last write: that write's own error (a TimeoutError too,
    the type a timed wait raises) is the chunk's, at once."""
    from concurrent.futures import Future

    from mtc.store import TensorStore

    from mtc.runtime.disk_tier import DiskRing
    from mtc.runtime.tiers import StateTiers
    from mtc.tracer import trace

    cfg = small_config()
    program = trace(build_model(cfg, device="meta"), cfg.micro_batch_size, cfg.seq_len)
    tiers = StateTiers(program, ["disk"] * program.n_layers, torch.device("cpu"), torch.float32)
    with TensorStore.create(tmp_path / "s") as store:
        tiers.create_arrays(store, "full")
        ring = DiskRing(tiers, store, slots=2)
        failed = Future()
        failed.set_exception(TimeoutError("the disk stopped answering"))
        ring.post(0, {ring.layers[0]: failed})
        with pytest.raises(TimeoutError, match="stopped answering"):
            ring.take(ring.layers[0])[0].result(timeout=5)
        ring.close()
        assert not ring._thread.is_alive()
