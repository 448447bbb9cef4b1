"""The schedule, asserted on the timeline that the production code records (CPU, real threads)."""

from __future__ import annotations

import time

import pytest
import torch
from mtc.store import TensorStore

from mtc.train import train
from tests.runtime.engine_util import skewed_tokens, small_config


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "tok.bin")


@pytest.fixture(scope="module")
def run(tokens, tmp_path_factory):
    # four blocks: six program layers; a local store so write-behind and commits really hit a disk.
    # Blocks of width 384: each update takes a few ms, so the updates still running when the next
    # step's forward starts are ~40 ms of work, not ~15 ms that a loaded 2-core machine's thread
    # scheduling could eat (the overlap test failed once by 1.3 ms at the preset's width 128)
    cfg = small_config(steps=4, model_overrides={"n_layers": 4, "dim": 384, "ffn_dim": 1024}, optim_threads=1, commit_every=1)
    res = train(cfg, tmp_path_factory.mktemp("run") / "s", tokens)
    yield res
    res.store.close()


def test_next_layers_copy_starts_before_this_layers_compute_ends(run):
    tl, L = run.timeline, run.program.n_layers
    for step in range(1, 4):
        copies = {s.layer: s for s in tl.spans("h2d", step=step)}  # first copy of each layer: its forward fetch
        for layer in range(L - 2):
            computes = [s for s in tl.spans("compute", step=step) if s.layer == layer]
            assert copies[layer + 1].start < computes[-1].end, f"step {step}: layer {layer + 1}'s fetch waited for compute"


class _SlowLink:
    """A copy destination that takes ``seconds`` to fill: a slow PCIe link, inside the copy's span."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def copy_(self, src: torch.Tensor) -> None:
        time.sleep(self.seconds)


def _fetches_overlapping_compute(tokens, monkeypatch, *, serialize: bool) -> tuple[list, object]:
    """Each forward weight copy made 20 ms slow, and each micro-batch's compute 5 ms: (the layers
    whose next layer's forward copy ran while their own forward computed, per step after the first;
    the run's timeline)."""
    from mtc.runtime.executor import StreamingExecutor
    from mtc.runtime.transfer import CopyEngine

    h2d, args = CopyEngine.h2d, StreamingExecutor._args

    def slow_h2d(self, copies, **kw):
        if kw.get("stage", "h2d") == "h2d":
            copies = [(_SlowLink(0.02), torch.empty(0)), *copies]
        return h2d(self, copies, **kw)

    def slow_args(self, *a, **kw):  # evaluated inside each micro-batch's compute span
        time.sleep(0.005)
        return args(self, *a, **kw)

    monkeypatch.setattr(CopyEngine, "h2d", slow_h2d)
    monkeypatch.setattr(StreamingExecutor, "_args", slow_args)
    res = train(small_config(steps=3, model_overrides={"n_layers": 4}, durability="none"), None, tokens, serialize=serialize)
    tl, L = res.timeline, res.program.n_layers  # embed, 4 blocks, head: 4 layers with a next one before the head
    overlapped = []
    for step in (1, 2):
        copies = {}
        for s in tl.spans("h2d", step=step):  # first copy of each layer: its forward fetch
            copies.setdefault(s.layer, s)
        head = min(s.start for s in tl.spans("compute", step=step) if s.layer == L - 1)
        for layer in range(L - 2):
            fwd = [s for s in tl.spans("compute", step=step) if s.layer == layer and s.end <= head]  # its forward visit
            nxt = copies[layer + 1]
            if nxt.start < fwd[-1].end and nxt.end > fwd[0].start:
                overlapped.append((step, layer))
    return overlapped, tl


def test_weight_copies_run_on_their_own_thread_beside_compute(tokens, monkeypatch):
    """With each copy slowed to 20 ms, the next layer's weights cross while this layer computes, on
    the copy lane's own thread (gradients on theirs); the serialized reference schedule, run the
    same way, overlaps none: the check can tell the two apart."""
    overlapped, tl = _fetches_overlapping_compute(tokens, monkeypatch, serialize=False)
    assert len(overlapped) == 2 * 4, f"only {overlapped} of the steps' layers overlapped their next layer's copy"
    assert {s.thread.rsplit("_", 1)[0] for s in tl.spans("h2d")} == {"mtc-main-h2d"}
    assert {s.thread.rsplit("_", 1)[0] for s in tl.spans("grad_d2h")} == {"mtc-main-d2h"}
    assert {s.thread for s in tl.spans("compute")} == {"MainThread"}
    serial, _ = _fetches_overlapping_compute(tokens, monkeypatch, serialize=True)
    assert serial == [], f"the serialized schedule overlapped {serial}"


def test_updates_run_while_the_next_forward_computes(run):
    tl, L = run.timeline, run.program.n_layers
    for step in range(3):
        last_update = max(s.end for s in tl.spans("update", step=step))
        first_compute = min(s.start for s in tl.spans("compute", step=step + 1))
        assert first_compute < last_update, f"step {step + 1} waited for the whole optimizer step"
        # and each layer's forward starts only after that layer's update
        for layer in range(L - 1):
            upd = next(s for s in tl.spans("update", step=step) if s.layer == layer)
            fwd = next(s for s in tl.spans("compute", step=step + 1) if s.layer == layer)
            assert fwd.start >= upd.end, f"layer {layer} computed with stale weights"


def test_update_waits_for_its_gradient_copy(run):
    tl = run.timeline
    for step in range(4):
        for d2h in tl.spans("grad_d2h", step=step):
            upd = next(s for s in tl.spans("update", step=step) if s.layer == d2h.layer)
            assert upd.start >= d2h.end


def test_each_layers_gradient_crosses_once_per_step_as_one_flat_slab(run):
    """Gradients go to the host as one flat slab per layer and step (after all micro-batches have
    accumulated into it), not per parameter and not per micro-batch."""
    tl, L = run.timeline, run.program.n_layers
    for step in range(4):
        spans = tl.spans("grad_d2h", step=step)
        assert sorted(s.layer for s in spans) == list(range(L)), f"step {step}: {sorted(s.layer for s in spans)}"


def test_commit_follows_every_write_and_runs_off_the_training_thread(run):
    tl = run.timeline
    for step in range(4):
        writes, commits = tl.spans("write_behind", step=step), tl.spans("commit", step=step)
        assert writes and len(commits) == 1
        assert commits[0].start >= max(w.end for w in writes)
        assert all(not s.thread.startswith("MainThread") for s in writes + commits)


def _spy_store_reads(monkeypatch) -> list[str]:
    """Every array the store reads, by name: `TensorStore._read_rows` is the one path under the
    blocking reads and the asynchronous ones the executor, the read-ahead and the tier loads use."""
    reads: list[str] = []
    orig = TensorStore._read_rows
    monkeypatch.setattr(TensorStore, "_read_rows", lambda self, info, *a, **k: (reads.append(info.name), orig(self, info, *a, **k))[1])
    return reads


def test_no_visit_reads_the_disk_with_all_state_in_ram(tokens, tmp_path, monkeypatch):
    reads = _spy_store_reads(monkeypatch)
    res = train(small_config(steps=3, placement="ram"), tmp_path / "s", tokens)
    try:
        assert reads == [], f"the store was read during training: {reads}"
        assert not res.timeline.spans("visit_read") and not res.timeline.spans("disk_read_wait")
        assert res.timeline.spans("write_behind")  # (the store was there: written behind, never read)
    finally:
        res.store.close()


@pytest.mark.parametrize("disk_compute", ["store", "ram"])
def test_the_read_spy_sees_a_disk_placements_reads(tokens, tmp_path, monkeypatch, disk_compute):
    """The control of the test above: with state on disk the same spy sees the store read every step."""
    reads = _spy_store_reads(monkeypatch)
    res = train(small_config(steps=3, placement="disk", disk_compute=disk_compute), tmp_path / "s", tokens)
    res.store.close()
    assert len(reads) >= 3 * len(res.placement), f"{len(reads)} reads for {len(res.placement)} disk layers over 3 steps"


def test_timeline_keeps_a_bounded_window_of_steps():
    from mtc.runtime.timeline import Timeline

    tl = Timeline(keep_steps=3)
    for step in range(10):
        tl.begin_step(step)
        for layer in range(4):
            tl.add("compute", layer, 0.0, 1.0)
    assert sorted({s.step for s in tl.spans()}) == [7, 8, 9]


def test_gpu_updated_layers_load_their_state_during_the_backward(tokens):
    """update_prefetch: the first GPU-updated layers' master, m, v cross in before the step's norm
    (while later layers' backward still computes), and after it only the others' state does."""
    cfg = small_config(steps=4, model_overrides={"n_layers": 4}, placement="stateless", gpu_update="1-4", update_prefetch=2,
                       durability="none")
    res = train(cfg, None, tokens)
    try:
        tl = res.timeline
        for step in range(4):
            pre = tl.spans("opt_prefetch", step=step)
            assert sorted(s.layer for s in pre) == [1, 2], f"step {step}: {[s.layer for s in pre]}"
            # the embed layer's backward is the step's last compute: the loads overlap the backward
            last_bwd = max(s.end for s in tl.spans("compute", step=step) if s.layer == 0)
            assert min(s.start for s in pre) < last_bwd, f"step {step}: the state loaded only after the backward"
            streamed = tl.spans("update_streamed", step=step)
            assert sorted(s.layer for s in streamed) == [1, 2, 3, 4]
        # after the norm only the layers not loaded ahead copy their state in (each step's copies are
        # issued once the next step has begun: counted over the run)
        assert sorted({s.layer for s in tl.spans("opt_h2d")}) == [3, 4]
        for layer in (1, 2):  # each update of a loaded layer copies back after its load, and before the next load
            loads = sorted((s for s in tl.spans("opt_prefetch") if s.layer == layer), key=lambda s: s.start)
            backs = sorted((s for s in tl.spans("opt_d2h") if s.layer == layer), key=lambda s: s.start)
            assert len(loads) == len(backs) == 4
            for k, (load, back) in enumerate(zip(loads, backs, strict=True)):
                assert back.start >= load.end
                if k + 1 < len(loads):
                    assert loads[k + 1].start >= back.end
    finally:
        res.store.close()


def test_one_layer_more_than_sets_reuses_the_last_set_and_the_first_layers_still_defer(tokens):
    """Five GPU-updated layers, four loaded ahead into sets of their own: the fifth (the head, the
    last the next forward fetches) reuses the fourth's set, so layers 0-2, the first the next
    forward fetches, send their weights back ahead of their state (the embed's used to wait behind
    its whole state: the first set was the one reused)."""
    from mtc.runtime.placement import deferred_layers, scratch_set

    assert [scratch_set(j, 5, 4) for j in range(5)] == [0, 1, 2, 3, 3]
    assert [scratch_set(j, 13, 2) for j in range(6)] == [0, 1, 0, 1, 0, 1]  # many jobs: the plain cycle
    assert deferred_layers({0, 1, 2, 3, 4}, 4) == {0, 1, 2}
    assert deferred_layers(set(range(18)), 17) == set(range(16))
    res, weights, state = _copies_back(tokens, steps=3, model_overrides={"n_layers": 3}, gpu_update="all", update_prefetch=4)
    try:
        assert sorted({s.layer for s in weights}) == [0, 1, 2]
        assert sorted({s.layer for s in state}) == [0, 1, 2, 3, 4]
        for k in range(3):  # each update: the deferred layers' weights go back before their own state
            w = [_kth(weights, layer, k) for layer in (0, 1, 2)]
            st = [_kth(state, layer, k) for layer in (0, 1, 2)]
            assert min(s.start for s in st) >= max(x.end for x in w)
    finally:
        res.store.close()


def _copies_back(tokens, **kw):
    """A stateless fp32 run with GPU-side updates: (result, its weights-back spans, its state-back spans)."""
    res = train(small_config(placement="stateless", durability="none", compute_dtype="float32", **kw), None, tokens)
    return res, res.timeline.spans("opt_d2h_weights"), res.timeline.spans("opt_d2h")


def _kth(spans, layer: int, k: int):
    """The k-th span of ``layer`` by start time."""
    return sorted((s for s in spans if s.layer == layer), key=lambda s: s.start)[k]


def test_loaded_layers_send_their_weights_back_before_the_rest_of_their_state(tokens):
    """Every GPU-updated layer loaded ahead into a set of its own (update_prefetch 4 of 4): after
    the norm each sends back its new weights first (what the next forward waits for), and the
    master, m and v of all of them follow behind every layer's weights."""
    res, weights, state = _copies_back(tokens, steps=4, model_overrides={"n_layers": 4}, gpu_update="1-4", update_prefetch=4)
    try:
        tl = res.timeline
        assert sorted({s.layer for s in weights}) == sorted({s.layer for s in state}) == [1, 2, 3, 4]
        assert len(weights) == len(state) == 16  # four steps
        for k in range(4):  # the k-th update of each layer: all weights, then all state
            w_k = [_kth(weights, layer, k) for layer in (1, 2, 3, 4)]
            s_k = [_kth(state, layer, k) for layer in (1, 2, 3, 4)]
            assert min(s.start for s in s_k) >= max(w.end for w in w_k)
        # a layer's next forward computes with its new weights: after they are back
        for step in range(3):
            for layer in (1, 2, 3, 4):
                back = _kth(weights, layer, step)
                fwd = next(s for s in tl.spans("compute", step=step + 1) if s.layer == layer)
                assert fwd.start >= back.end
    finally:
        res.store.close()


def _handoff_run(tokens, *, handoff: bool, delay_back: float = 0.0, delay_layers=None, monkeypatch=None, **kw):
    """A stateless bf16 run whose four blocks the GPU path updates, all loaded ahead into sets of
    their own (so all deferred); ``delay_back``: every copy back of a GPU-side update (weights or
    state) of ``delay_layers`` (None: of every layer) reaches the host that many seconds late."""
    if delay_back:
        import time
        from concurrent.futures import ThreadPoolExecutor

        from mtc.runtime.transfer import CopyEngine, Transfer

        late = ThreadPoolExecutor(max_workers=4)
        orig = CopyEngine._copy

        def slow(self, direction, copies, after, layer, stage, lane):
            if stage in ("opt_d2h_weights", "opt_d2h") and (delay_layers is None or layer in delay_layers):
                afters = [] if after is None else list(after) if isinstance(after, (list, tuple)) else [after]
                after = [*afters, Transfer(future=late.submit(time.sleep, delay_back))]
            return orig(self, direction, copies, after, layer, stage, lane)

        monkeypatch.setattr(CopyEngine, "_copy", slow)
    cfg = small_config(steps=4, model_overrides={"n_layers": 4}, placement="stateless", gpu_update="1-4", update_prefetch=4,
                       durability="none", compute_dtype="bfloat16", update_handoff=handoff)
    return train(cfg, None, tokens, **kw)


def test_deferred_layers_hand_their_new_weights_to_the_visits_on_the_device(tokens):
    """bf16, every GPU-updated layer deferred: from the second step on their visits copy the
    weights from the scratch set (stage d2d), never from the host, and the weights never cross
    back (only master, m and v do); the step 0 visits, before any update, and every visit of a
    run without the handoff come from the host. Same losses and norms bit for bit either way,
    and at the end the host copy holds the same weights (`StreamingAdamW.wait` brought them back)."""
    on = _handoff_run(tokens, handoff=True)
    off = _handoff_run(tokens, handoff=False)
    try:
        tl = on.timeline
        assert not tl.spans("d2d", step=0)
        for step in range(1, 4):
            d2d = tl.spans("d2d", step=step)
            assert sorted({s.layer for s in d2d}) == [1, 2, 3, 4], f"step {step}: {[s.layer for s in d2d]}"
            assert not {s.layer for s in tl.spans("h2d", step=step)} & {1, 2, 3, 4}
        assert not tl.spans("opt_d2h_weights") and sorted({s.layer for s in tl.spans("opt_d2h")}) == [1, 2, 3, 4]
        assert not off.timeline.spans("d2d") and sorted({s.layer for s in off.timeline.spans("opt_d2h_weights")}) == [1, 2, 3, 4]
        assert [r.loss for r in on.records] == [r.loss for r in off.records]
        assert [r.grad_norm for r in on.records] == [r.grad_norm for r in off.records]
        for i in (1, 2, 3, 4):
            a, b = on.tiers[i], off.tiers[i]
            assert a.device_copy is not None and a.device_copy.result() is not None
            assert b.device_copy is not None and b.device_copy.result() is None
            assert not a.host_compute_stale
            assert torch.equal(a.compute, b.compute) and torch.equal(a.master, b.master)
            assert torch.equal(a.compute, a.master.to(torch.bfloat16))
    finally:
        on.store.close()
        off.store.close()


@pytest.mark.parametrize("handoff", [True, False])
def test_the_next_forward_does_not_wait_for_the_update_to_cross_back(tokens, monkeypatch, handoff):
    """Every copy back of the GPU-side updates lands 0.4 s late: with the handoff each deferred
    layer's next forward computes before its state is back (nothing it reads crosses back);
    without it, only after its weights are (`test_loaded_layers_send_their_weights_back_before
    _the_rest_of_their_state`)."""
    res = _handoff_run(tokens, handoff=handoff, delay_back=0.4, monkeypatch=monkeypatch)
    try:
        tl = res.timeline
        back = tl.spans("opt_d2h_weights") if not handoff else tl.spans("opt_d2h")
        for step in range(3):
            for layer in (1, 2, 3, 4):
                landed = _kth(back, layer, step).end
                fwd = next(s for s in tl.spans("compute", step=step + 1) if s.layer == layer)
                assert (fwd.start < landed) == handoff, f"step {step + 1}, layer {layer}: forward {fwd.start}, copy back {landed}"
    finally:
        res.store.close()


def test_the_next_steps_loads_do_not_wait_for_every_layers_state_to_land(tokens, monkeypatch):
    """Layer 4's state lands 0.4 s late after every update: the next step's load of layer 1,
    whose own state is back, starts before that (it waits for its own set's copy out, not for the
    whole step's on the host), and still after its own state landed. (Loads queued behind the
    wait for every layer made the H200's P1-16 steps alternate 0.93 / 2.62 s.) Same losses as a
    run without the delay."""
    res = _handoff_run(tokens, handoff=True, delay_back=0.4, delay_layers={4}, monkeypatch=monkeypatch)
    ref = _handoff_run(tokens, handoff=True)
    try:
        tl = res.timeline
        backs, loads = tl.spans("opt_d2h"), tl.spans("opt_prefetch")
        for step in range(3):
            late = _kth(backs, 4, step)
            own = _kth(backs, 1, step)
            load = _kth(loads, 1, step + 1)
            assert load.start >= own.end, f"step {step + 1}: layer 1 loaded before its state landed"
            assert load.start < late.end - 0.2, f"step {step + 1}: the load of layer 1 waited for layer 4's state"
        assert [r.loss for r in res.records] == [r.loss for r in ref.records]
    finally:
        res.store.close()
        ref.store.close()


def test_a_layers_update_lands_without_waiting_for_a_later_layers_issue(tokens, monkeypatch):
    """fp32, every GPU-updated layer streamed after the norm: layer 4's update waits 0.3 s before
    it is issued (as for its last write behind, on a slow disk); layer 1's new weights still land,
    and its future completes, before that (the copies back are waited for on their own thread as
    they are issued, not after the whole step's issue)."""
    from mtc.runtime import optimizer

    orig = optimizer._wait_all

    def slow(timeline, layer, deps, step):
        if layer == 4:
            time.sleep(0.3)
        orig(timeline, layer, deps, step)

    monkeypatch.setattr(optimizer, "_wait_all", slow)
    res = train(small_config(steps=3, model_overrides={"n_layers": 4}, placement="stateless", gpu_update="1-4",
                             update_prefetch=0, durability="none", compute_dtype="float32"), None, tokens)
    try:
        tl = res.timeline
        for step in range(3):
            landed = next(s for s in tl.spans("streamed_back", step=step) if s.layer == 1)
            issued = next(s for s in tl.spans("update_streamed", step=step) if s.layer == 4)
            assert landed.end < issued.start, f"step {step}: layer 1 landed at {landed.end}, layer 4 issued at {issued.start}"
    finally:
        res.store.close()


def test_a_reader_between_steps_gets_the_handed_over_weights(tokens):
    """`TierWeights` (what `mtc watch`'s probes read between steps) of a handed-over layer returns
    the new weights from its scratch set, where the host copy still holds older ones."""
    from mtc.weight_sources import TierWeights, wait_for_updates

    seen = []

    def probe(rec):
        tiers = run_tiers[0]
        wait_for_updates(tiers)
        for i in (1, 2, 3, 4):
            s = tiers[i]
            keys = [p.key for p in program[0].layer_params(i)]
            got = TierWeights(program[0], tiers, "cpu").get(keys)
            want = s.master.to(torch.bfloat16)
            flat = torch.cat([got[k].reshape(-1) for k in keys])
            seen.append((rec.step, i, s.host_compute_stale, torch.equal(flat, want[: flat.numel()]),
                         torch.equal(s.compute, want)))

    import sys

    train_mod = sys.modules["mtc.train"]  # (the package's `train` is the function)
    program, run_tiers = [], []
    orig = train_mod.build_engine

    def capture(cfg, prog, tiers, *a, **k):
        program.append(prog)
        run_tiers.append(tiers)
        return orig(cfg, prog, tiers, *a, **k)

    import unittest.mock

    with unittest.mock.patch.object(train_mod, "build_engine", capture):
        res = _handoff_run(tokens, handoff=True, on_step=probe)
    res.store.close()
    assert len(seen) == 16, seen
    for step, layer, stale, got_new, host_new in seen:
        assert got_new, f"step {step}, layer {layer}: TierWeights read older weights"
        # (the first step's learning rate is 0, warm-up: its weights did not change)
        assert stale and (step == 1 or not host_new), f"step {step}, layer {layer}: the host copy was current (nothing to test)"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_with_the_handoff_the_state_loads_from_the_steps_start(tokens, monkeypatch, dtype):
    """With the handoff (bf16) the loaded layers' visits leave the link to the device free during
    the forward, so their state loads are queued when the step begins, before any gradient is
    final; without it (fp32) only once the backward has begun (the first final gradient), so the
    loads do not slow the forward's weight copies."""
    from mtc.runtime.optimizer import StreamingAdamW

    final_at_start = []
    orig = StreamingAdamW._start_prefetch

    def spy(self):
        final_at_start.append(len(self._norms))
        return orig(self)

    monkeypatch.setattr(StreamingAdamW, "_start_prefetch", spy)
    cfg = small_config(steps=3, model_overrides={"n_layers": 4}, placement="stateless", gpu_update="1-4", update_prefetch=2,
                       durability="none", compute_dtype=dtype)
    res = train(cfg, None, tokens)
    res.store.close()
    assert final_at_start == ([0, 0, 0] if dtype == "bfloat16" else [1, 1, 1])


def test_an_update_that_starts_late_uses_its_own_steps_loads(tokens, monkeypatch):
    """Each GPU-side update starts 0.3 s late, so the next step's begin_step has queued the next
    loads ahead before it runs: the update must wait for its own step's loads, not those queued
    behind it on the same thread (which deadlocked the run, 2026-11-27)."""
    import threading
    import time

    from mtc.runtime.optimizer import StreamingAdamW

    orig = StreamingAdamW._update_streamed

    def late(self, *a, **k):
        time.sleep(0.3)
        return orig(self, *a, **k)

    monkeypatch.setattr(StreamingAdamW, "_update_streamed", late)
    out: list = []
    t = threading.Thread(target=lambda: out.append(_handoff_run(tokens, handoff=True)), daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the run hung: an update waited for loads queued behind it"
    out[0].store.close()
    assert len(out[0].records) == 4


def test_training_goes_on_while_a_commit_is_written(tokens, tmp_path, monkeypatch):
    """Durable commits without stalling: with each commit taking 1 s (a slow disk), the next step
    computes while the commit is still being written, and no step waits out a commit. (Margins
    relative to the commit's second: a loaded 2-core machine stretched a step to 0.43 s.)"""
    slow = TensorStore.commit

    def slow_commit(self, record):
        time.sleep(1.0)
        slow(self, record)

    monkeypatch.setattr(TensorStore, "commit", slow_commit)
    cfg = small_config(steps=5, model_overrides={"n_layers": 4}, commit_every=2)
    res = train(cfg, tmp_path / "s", tokens)
    try:
        tl = res.timeline
        assert [r.step for r in res.store.commit_history()] == [0, 2, 4, 5]
        for step in (1, 3):  # the steps that end in a commit (counted from 0: the 2nd and 4th)
            (commit,) = tl.spans("commit", step=step)
            nxt = min(s.start for s in tl.spans("compute", step=step + 1))
            assert nxt < commit.end - 0.5, f"step {step + 1} began computing {nxt - commit.start:.3f} s into a 1 s commit"
        stalls = [r.seconds for r in res.records[1:-1] if r.seconds > 0.7]
        assert not stalls, f"steps took most of a commit's time: {[round(r.seconds, 3) for r in res.records]}"
    finally:
        res.store.close()


def test_offloaded_activations_cross_on_their_own_lane(tokens):
    """Activations beyond the budget go to host memory and come back on the copy engine's ``act``
    lane (its own thread per direction here, its own streams on CUDA), not queued with the weights."""
    res = train(small_config(steps=2, model_overrides={"n_layers": 3}, activation_budget_gb=1e-9, durability="none"), None, tokens)
    tl = res.timeline
    outs, ins = tl.spans("act_out"), tl.spans("act_in")
    assert outs and len(outs) == len(ins)
    assert {s.thread.rsplit("_", 1)[0] for s in outs} == {"mtc-act-d2h"}
    assert {s.thread.rsplit("_", 1)[0] for s in ins} == {"mtc-act-h2d"}
    for step in (0, 1):
        for s in tl.spans("act_in", step=step):  # back only after it went out
            assert s.start >= min(o.end for o in tl.spans("act_out", step=step) if o.layer == s.layer)
