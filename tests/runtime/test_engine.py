"""Every placement and optimizer mode keeps the parity contract; durability and fit checks."""

from __future__ import annotations

import math

import pytest
import torch

from mtc.config import OptimConfig
from mtc.errors import ConfigError
from mtc.runtime.state import read_params
from mtc.train import TrainingError, train
from tests.reference import reference_train
from tests.runtime.engine_util import skewed_tokens, small_config
from tests.runtime.test_parity import assert_losses_close, assert_weights_close


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "tok.bin")


@pytest.fixture(scope="module")
def reference(tokens):
    return reference_train(small_config(), tokens)


def _final_weights(res):
    # the tiers hold the state; the store's committed generation must agree with them
    return read_params(res.program, res.store, res.generation)


MODES = [
    dict(placement="gpu"),  # resident state, device-side (Triton interpreter) updates
    dict(placement="disk"),  # state read from and written to the store every step
    dict(placement="gpu:0,ram:1-2,disk:3"),
    dict(placement="ram", gpu_update="1-2"),  # ram state streamed to the device for the update
    dict(placement="stateless", gpu_update="all", commit_every=2),  # four layers through two scratch sets
    # state loaded during the backward: three layers in sets of their own, the fourth streamed through set 0
    dict(placement="stateless", gpu_update="all", update_prefetch=3, commit_every=2),
    # every layer loaded ahead: weights back first, master, m and v after (the commits wait for them)
    dict(placement="stateless", gpu_update="all", update_prefetch=4, commit_every=2),
    dict(placement="ram", commit_every=4),
    dict(placement="ram", activation_budget_gb=1e-9),  # every boundary activation offloaded
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_parity_in_every_mode(tokens, reference, mode):
    ref_losses, ref_weights = reference
    res = train(small_config(**mode), None, tokens)
    try:
        assert_losses_close(res.losses, ref_losses)
        # the Triton AdamW (gpu tier, gpu_update) rounds differently from torch's op-by-op math
        atol = 1e-5 if mode.get("placement") == "gpu" or "gpu:" in mode.get("placement", "") or "gpu_update" in mode else 1e-6
        assert_weights_close(_final_weights(res), ref_weights, atol=atol)
    finally:
        res.store.close()


def test_disk_and_ram_placements_are_bit_identical(tokens):
    results = {}
    for placement in ("ram", "disk"):
        res = train(small_config(steps=3, placement=placement), None, tokens)
        results[placement] = (_final_weights(res), res.losses)
        res.store.close()
    (w_ram, l_ram), (w_disk, l_disk) = results["ram"], results["disk"]
    assert l_ram == l_disk
    assert all(torch.equal(w_ram[k], w_disk[k]) for k in w_ram)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_overlapped_schedule_is_bit_identical_to_serialised(tokens, prefetch):
    # the CPU path runs copies and updates on real threads; the serialised schedule waits for each
    # (prefetch 1: layer 1's state loads during the backward, layer 2's streams after the norm;
    # 2: both load ahead, and send their weights back before the rest of their state)
    a = train(small_config(steps=3, gpu_update="1-2", update_prefetch=prefetch), None, tokens)
    b = train(small_config(steps=3, gpu_update="1-2", update_prefetch=prefetch), None, tokens, serialize=True)
    try:
        assert a.losses == b.losses
        wa, wb = _final_weights(a), _final_weights(b)
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    finally:
        a.store.close()
        b.store.close()


def test_a_failed_state_prefetch_surfaces_instead_of_vanishing(tokens, monkeypatch):
    # the prefetch of GPU-updated layers' state runs on the optimizer's GPU thread; its error used
    # to be dropped with its future (the update then loaded the state itself): now the step fails
    from mtc.runtime.optimizer import StreamingAdamW

    def broken(self, layers):
        raise RuntimeError("prefetch copy failed")

    monkeypatch.setattr(StreamingAdamW, "_prefetch_states", broken)
    with pytest.raises(Exception, match="prefetch copy failed"):
        train(small_config(steps=2, gpu_update="1-2", update_prefetch=1), None, tokens)


def test_a_failed_load_ahead_of_a_skipped_step_still_fails_the_run(tokens, monkeypatch):
    # lr 1e18: step 1 and every later one are skipped (non-finite), so no update reads step 1's
    # loads ahead; their error was dropped with them, and the run ended as if nothing had failed
    from mtc.runtime.optimizer import StreamingAdamW

    calls, orig = [], StreamingAdamW._prefetch_states

    def flaky(self, layers):
        calls.append(layers)
        if len(calls) == 2:
            raise RuntimeError("prefetch copy failed")
        return orig(self, layers)

    monkeypatch.setattr(StreamingAdamW, "_prefetch_states", flaky)
    cfg = small_config(steps=3, gpu_update="1-2", update_prefetch=1, max_nonfinite_steps=100,
                       optim=OptimConfig(lr=1e18, min_lr=1e18, warmup_steps=0, clip_norm=None))
    seen = []
    with pytest.raises(Exception, match="prefetch copy failed"):
        train(cfg, None, tokens, on_step=seen.append)
    assert len(calls) >= 2 and [r.skipped for r in seen][:2] == [False, True]


def test_commit_every_commits_on_schedule_and_at_the_end(tokens, tmp_path):
    res = train(small_config(steps=7, commit_every=3), tmp_path / "s", tokens)
    try:
        steps = [r.step for r in res.store.commit_history()]
        assert steps == [0, 3, 6, 7]
        assert [r.committed for r in res.records] == [False, False, True, False, False, True, True]
    finally:
        res.store.close()


def test_auto_commit_pacing_keeps_a_slow_disk_off_the_critical_path(tokens, tmp_path, monkeypatch):
    import time

    from mtc.store import TensorStore

    slow = TensorStore.commit

    def slow_commit(self, record):  # a disk on which each commit takes far longer than a step
        time.sleep(0.4)
        slow(self, record)

    monkeypatch.setattr(TensorStore, "commit", slow_commit)
    res = train(small_config(steps=12), tmp_path / "s", tokens)  # commit_every = 0: auto
    try:
        steps = [r.step for r in res.store.commit_history()]
        assert steps[0] == 0 and steps[-1] == 12
        # the seed, the first step, the last; between them one commit per 20 commits' time (8 s) of the run
        allowed = 3 + int(res.wall_s / (20 * 0.4))
        assert len(steps) <= allowed, f"auto pacing committed {steps} in {res.wall_s:.1f} s: more often than 1 in 20 of a commit's time allows"
    finally:
        res.store.close()


def test_durability_weights_keeps_only_master_arrays(tokens, tmp_path):
    res = train(small_config(steps=2, durability="weights"), tmp_path / "s", tokens)
    try:
        names = res.store.array_names()
        kinds = {n.split("/")[2] for n in names}
        assert kinds == {"master"}, names
        assert res.store.last_commit().step == 2
    finally:
        res.store.close()


def test_a_weights_commit_resumed_on_disk_layers_restarts_their_moments_as_ram_layers_do(tokens, tmp_path):
    """Moments in the store that no commit names (an older full commit's, or chunks never written)
    must not be read: a disk-layer resume of a weights commit equals a ram-layer resume of it."""
    import shutil

    full = small_config(steps=8, commit_every=2, placement="ram", grad_accum=1)
    train(full, tmp_path / "a", tokens, stop_after=4).store.close()  # full commits 2 (gen 1) and 4 (gen 0)
    weights = small_config(steps=8, commit_every=2, placement="ram", grad_accum=1, durability="weights")
    train(weights, tmp_path / "a", tokens, stop_after=6).store.close()  # gen 1: master
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    ram = train(weights, tmp_path / "a", tokens)
    disk = train(small_config(steps=8, commit_every=2, placement="disk", grad_accum=1, durability="weights"),
                 tmp_path / "b", tokens)
    try:
        assert ram.start_step == disk.start_step == 6
        assert ram.losses == disk.losses
        assert_weights_close(_final_weights(disk), _final_weights(ram), atol=0.0)
    finally:
        ram.store.close()
        disk.store.close()


@pytest.mark.parametrize("placement", ["ram", "disk"])
def test_a_weights_commit_resumes_as_a_new_adamw_over_its_weights(tokens, tmp_path, placement):
    """No moments were committed: the resumed run is torch's AdamW made afresh over the step's
    weights (zero moments, bias correction from its first update), on the same schedule and data;
    a later full commit carries that start on, so resuming it changes nothing."""
    from mtc.train import build_model
    from mtc.warmstart import load_state_dict

    cfg = small_config(steps=7, commit_every=3, durability="weights", placement=placement)
    train(cfg, tmp_path / "s", tokens, stop_after=3).store.close()
    model = build_model(cfg)
    model.load_state_dict(load_state_dict(tmp_path / "s"))
    ref_losses, ref_weights = reference_train(cfg, tokens, model, start_step=3)
    full = small_config(steps=7, commit_every=3, durability="full", placement=placement)
    first = train(full, tmp_path / "s", tokens, stop_after=5)  # commits 5 in full: moments from step 3 kept
    first.store.close()
    res = train(full, tmp_path / "s", tokens)
    try:
        assert first.start_step == 3 and res.start_step == 5
        assert_losses_close(first.losses + res.losses, ref_losses)
        assert_weights_close(_final_weights(res), ref_weights)
    finally:
        res.store.close()


def test_durability_none_writes_no_state_and_no_commit(tokens, tmp_path):
    res = train(small_config(steps=2, durability="none"), tmp_path / "s", tokens)
    try:
        assert res.store.array_names() == []
        assert res.store.last_commit() is None
    finally:
        res.store.close()


def test_not_enough_disk_is_refused_before_anything_is_written(tokens, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(ConfigError, match=r"does not fit: disk .*: needs .*durability 'full'.*choose --durability"):
        train(small_config(steps=1), tmp_path / "s", tokens)
    assert not (tmp_path / "s").exists()
    res = train(small_config(steps=1, durability="none"), tmp_path / "s2", tokens)  # needs no disk: runs
    res.store.close()


def test_not_enough_ram_is_refused(tokens, tmp_path):
    with pytest.raises(ConfigError, match="does not fit: host RAM"):
        train(small_config(steps=1, ram_budget_gb=1e-6), tmp_path / "s", tokens)
    assert not (tmp_path / "s").exists()


def test_non_finite_steps_are_skipped_then_stop_the_run(tokens, tmp_path):
    cfg = small_config(steps=8, optim=OptimConfig(lr=1e18, min_lr=1e18, warmup_steps=0, clip_norm=None))
    seen = []
    with pytest.raises(TrainingError, match="consecutive steps had a non-finite"):
        train(cfg, tmp_path / "s", tokens, on_step=seen.append)
    assert any(r.skipped for r in seen)
    from mtc.store import TensorStore

    from mtc.plan import load_plan

    with TensorStore.open(tmp_path / "s") as st:
        last = st.last_commit()
        weights = read_params(load_plan(tmp_path / "s" / "plan"), st, last.generation)
    assert all(torch.isfinite(w).all() for w in weights.values()), "a non-finite step must never be committed"


def test_skipped_steps_commit_like_any_step_and_resume_deterministically(tokens, tmp_path):
    # lr 1e18: step 1 blows the weights up, every later loss is not finite and its step is skipped
    cfg = small_config(steps=6, commit_every=1, max_nonfinite_steps=100,
                       optim=OptimConfig(lr=1e18, min_lr=1e18, warmup_steps=0, clip_norm=None))
    a = train(cfg, tmp_path / "a", tokens)
    try:
        skipped = [r.skipped for r in a.records]
        assert skipped[0] is False and all(skipped[1:]), skipped
        # a skipped step still commits (its state unchanged, in the next generation)
        assert [r.step for r in a.store.commit_history()] == list(range(7))
        wa = _final_weights(a)
        assert all(torch.equal(wa[k].reshape(-1), v) for k, v in _tier_masters(a).items())
    finally:
        a.store.close()
    b = train(cfg, tmp_path / "b", tokens, stop_after=3)
    b.store.close()
    b = train(cfg, tmp_path / "b", tokens)
    try:
        assert [r.skipped for r in b.records] == skipped[3:]
        wb = _final_weights(b)
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    finally:
        b.store.close()


def _tier_masters(res):
    out = {}
    for s in res.tiers.layers:
        for p in res.program.layer_params(s.layer):
            out[p.key] = s.master[p.offset : p.offset + p.numel]
    return out


def test_gpu_update_needs_tiers_allocated_for_it():
    # a GPU-side update streams pinned state and (here) finds its gradient on the device: tiers
    # built without `streamed` would make it copy pageable memory (a host sync on CUDA) and look
    # for a gradient that is on the host; the optimizer says so at once
    from mtc.runtime.tiers import StateTiers
    from mtc.runtime.timeline import Timeline
    from mtc.train import build_engine, open_run, plan_placement

    cfg = small_config(placement="ram", gpu_update="1", durability="none")
    run = open_run(cfg, None)
    try:
        placement, gpu_update = plan_placement(cfg, run.program)
        assert gpu_update == {1}
        tiers = StateTiers(run.program, placement, torch.device("cpu"), torch.float32)
        with pytest.raises(ValueError, match=r"gpu_update layers \[1\] were not allocated for it"):
            build_engine(cfg, run.program, tiers, gpu_update, run.store, Timeline())
        tiers = StateTiers(run.program, placement, torch.device("cpu"), torch.float32, streamed=gpu_update)
        assert tiers[1].device_grad and not tiers[2].device_grad
        build_engine(cfg, run.program, tiers, gpu_update, run.store, Timeline()).close()
    finally:
        run.store.close()


def test_an_engine_built_by_hand_trains_as_train_does(tokens):
    # the gpu tests drive an engine they build themselves (`hand_built_engine`); its set-up is
    # checked here, where CI runs it: a disk layer's ring reads its first generation when the
    # optimizer is built, so tiers filled without `init_state` failed before the first step
    from mtc.data import BatchSampler
    from mtc.runtime.schedule import lr_at
    from tests.runtime.engine_util import hand_built_engine

    cfg = small_config(steps=3, kernels="unfused", placement="gpu:0,ram:1-2,disk:3", durability="none")
    hb = hand_built_engine(cfg)
    sampler = BatchSampler(tokens, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    losses = []
    try:
        for step in range(cfg.steps):
            hb.engine.optimizer.begin_step(step, lr_at(step, cfg.steps, cfg.optim))
            mbs = [sampler.batch(step * cfg.grad_accum + j) for j in range(cfg.grad_accum)]
            out = hb.engine.executor.run_step(mbs, hb.engine.optimizer)
            losses.append(hb.engine.optimizer.finish_step(out.loss).loss)
        hb.engine.optimizer.wait()
    finally:
        hb.close()
    res = train(cfg, None, tokens)
    res.store.close()
    assert losses == res.losses


def test_gradients_are_written_whole_whatever_the_buffers_held(tokens):
    """A parameter's first gradient of a step is copied into its accumulator, later ones added,
    and what no gradient reached is zeroed: nothing a gradient buffer held before the step (a
    slab's last layer, the last step's gradient) reaches the norm or the update. Every buffer is
    filled with NaN between steps; the run must match a clean one exactly."""
    from mtc.data import BatchSampler
    from mtc.runtime.schedule import lr_at
    from tests.runtime.engine_util import hand_built_engine

    cfg = small_config(steps=3, kernels="unfused", placement="gpu:0,ram:1-2,disk:3", gpu_update="2", durability="none")

    def run(poison: bool) -> list[tuple[float, float]]:
        hb = hand_built_engine(cfg)
        sampler = BatchSampler(tokens, batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        out = []
        try:
            for step in range(cfg.steps):
                if poison and step:
                    hb.engine.optimizer.wait()
                    for buf in hb.engine.executor.slabs.buffers():
                        buf.fill_(float("nan"))
                    for s in hb.tiers.layers:
                        if s.device_grad and s.grad is not None:
                            s.grad.fill_(float("nan"))
                hb.engine.optimizer.begin_step(step, lr_at(step, cfg.steps, cfg.optim))
                mbs = [sampler.batch(step * cfg.grad_accum + j) for j in range(cfg.grad_accum)]
                res = hb.engine.executor.run_step(mbs, hb.engine.optimizer)
                st = hb.engine.optimizer.finish_step(res.loss)
                out.append((st.loss, st.grad_norm))
            hb.engine.optimizer.wait()
        finally:
            hb.close()
        return out

    clean, poisoned = run(False), run(True)
    assert all(math.isfinite(g) for _, g in poisoned)
    assert poisoned == clean
    # and both are right: the losses follow PyTorch's training of the same model (wrong gradients
    # would change every loss after the first)
    assert_losses_close([loss for loss, _ in clean], reference_train(cfg, tokens)[0])
