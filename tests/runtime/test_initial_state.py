"""A new run's start: its initial weights go straight into the tiers' buffers, and generation 0
holds them with zero moments.

`init_state` flattens a ram layer's parameters into that layer's master buffer itself (no host
copy of the layer first), and skips the zero pass over moments that are pinned (registering them
faulted every page in, zero-filled); unpinned moments are zeroed, a pass that is also their first touch.
"""

from __future__ import annotations

import pytest
import torch
from mtc.store import state_array_name

from mtc.errors import StoreError
from mtc.runtime.state import flatten_layer
from mtc.runtime.tiers import StateTiers
from mtc.train import init_state, open_run
from tests.runtime.engine_util import small_config


def _reference_flat(prog, layer: int, params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([params[p.key].detach().reshape(-1).float() for p in sorted(prog.layer_params(layer), key=lambda p: p.offset)])


def test_flatten_layer_writes_into_the_buffer_it_is_given_converting_the_dtype():
    run = open_run(small_config(), None)
    try:
        prog = run.program
        params = {k: v.to(torch.bfloat16) for k, v in run.params.items()}  # a compute-dtype source
        out = torch.full((prog.layer_numel(1),), float("nan"))
        got = flatten_layer(prog, 1, params, out=out)
        assert got is out
        assert torch.equal(out, _reference_flat(prog, 1, params))
        assert torch.equal(flatten_layer(prog, 1, params), out)  # a fresh buffer when none is given
        with pytest.raises(StoreError, match=r"layer 1 needs a 1-D float32 buffer of \d+ elements"):
            flatten_layer(prog, 1, params, out=torch.empty(prog.layer_numel(1) - 1))
        with pytest.raises(StoreError, match="float32"):
            flatten_layer(prog, 1, params, out=torch.empty(prog.layer_numel(1), dtype=torch.bfloat16))
    finally:
        run.store.close()


@pytest.mark.parametrize("durability", ["none", "full"])
def test_a_new_run_fills_ram_masters_in_place_and_generation_0_holds_zero_moments(durability):
    cfg = small_config(placement="stateless", durability=durability)
    run = open_run(cfg, None)
    try:
        prog = run.program
        want = {i: _reference_flat(prog, i, run.params) for i in range(prog.n_layers) if prog.layer_numel(i)}
        tiers = StateTiers(prog, ["ram"] * prog.n_layers, torch.device("cpu"), torch.float32)
        masters = {i: tiers.initial_master(i) for i in want}
        assert all(masters[i] is tiers[i].master for i in want)  # the buffers the weights are flattened into
        for s in tiers.layers:  # dirty moments: what a zero pass must clear (unpinned buffers get one)
            if s.numel:
                s.m.fill_(7.0)
                s.v.fill_(7.0)
        init_state(run.store, tiers, prog, run.params, durability)
        assert not run.params  # every parameter went into the tiers
        for i, flat in want.items():
            s = tiers[i]
            assert s.master is masters[i] and torch.equal(s.master, flat)
            assert not s.m.any() and not s.v.any()
            if durability == "full":
                assert torch.equal(run.store.read(state_array_name(i, "master", 0)), flat)
                for k in ("m", "v"):
                    assert not run.store.read(state_array_name(i, k, 0)).any()
    finally:
        run.store.close()


def test_gpu_layers_share_one_staging_buffer_and_disk_layers_take_a_host_copy():
    run = open_run(small_config(durability="full"), None)
    try:
        prog = run.program
        placement = ["gpu", "disk", "ram", "gpu"]
        tiers = StateTiers(prog, placement, torch.device("cpu"), torch.float32)
        a, b = tiers.initial_master(0), tiers.initial_master(3)
        assert a.numel() == prog.layer_numel(0) and b.numel() == prog.layer_numel(3)
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one buffer, reused
        assert a.data_ptr() != tiers[0].master.data_ptr()
        assert tiers.initial_master(2) is tiers[2].master
        d = tiers.initial_master(1)  # a disk layer's copy: its own, page-aligned (the store writes it with O_DIRECT)
        assert d.numel() == prog.layer_numel(1) and d.data_ptr() % 4096 == 0 and d.data_ptr() != a.data_ptr()
        want = {i: _reference_flat(prog, i, run.params) for i in range(prog.n_layers)}
        init_state(run.store, tiers, prog, run.params, "full")
        assert not tiers._stage  # the staging buffer went once the state was filled
        for i in (0, 2, 3):  # every layer got its own weights, though gpu ones came through one buffer
            assert torch.equal(tiers[i].master, want[i])
            assert torch.equal(run.store.read(state_array_name(i, "master", 0)), want[i])
            assert not run.store.read(state_array_name(i, "m", 0)).any()
    finally:
        run.store.close()


@pytest.mark.parametrize("pinned", [False, True])
def test_fresh_pinned_moments_are_left_as_allocated_and_unpinned_ones_are_zeroed(monkeypatch, pinned):
    run = open_run(small_config(), None)
    try:
        prog = run.program
        tiers = StateTiers(prog, ["ram"] * prog.n_layers, torch.device("cpu"), torch.float32)
        s = tiers[1]
        s.m.fill_(3.0)  # stands for memory a zero pass would touch; a pinned buffer is really zero-filled already
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: pinned)
        tiers.set_layer(1, flatten_layer(prog, 1, run.params), fresh=True)
        assert bool((s.m == 3.0).all()) is pinned
        assert not s.v.any()
        tiers.set_layer(1, s.master)  # not fresh (e.g. a reset): always zeroed
        assert not s.m.any()
    finally:
        run.store.close()


@pytest.mark.gpu
def test_gpu_fresh_pinned_moments_are_zero_without_a_pass():
    """On CUDA a GPU-updated ram layer's moments are registered (pinned) buffers: `init_state`
    leaves them as allocated, and they must read as zeros."""
    run = open_run(small_config(device="cuda"), None)
    try:
        prog = run.program
        tiers = StateTiers(prog, ["ram"] * prog.n_layers, torch.device("cuda"), torch.bfloat16, streamed={1, 2})
        init_state(run.store, tiers, prog, run.params, "none")
        for i in (1, 2):
            s = tiers[i]
            assert s.m.is_pinned() and s.v.is_pinned()
            assert not s.m.any() and not s.v.any()
            assert torch.equal(s.compute, s.master.to(torch.bfloat16))
    finally:
        run.store.close()


@pytest.mark.parametrize("placement", [["ram"] * 4, ["gpu", "gpu", "ram", "gpu"]], ids=["ram", "mixed"])
@pytest.mark.parametrize("durability", ["full", "weights"])
def test_a_resume_reads_the_arrays_into_buffers_it_keeps(durability, placement, monkeypatch):
    """Ram layers read straight into their own buffers; gpu layers through staging buffers they
    share (here on the CPU device); no array goes through a fresh host tensor."""
    cfg = small_config(placement="stateless", durability=durability)
    run = open_run(cfg, None)
    try:
        prog = run.program
        assert prog.n_layers == len(placement)
        tiers = StateTiers(prog, placement, torch.device("cpu"), torch.bfloat16)
        init_state(run.store, tiers, prog, run.params, durability)
        gen = torch.Generator().manual_seed(0)
        n = prog.layer_numel(1)
        m = torch.randn(n, generator=gen)
        if durability == "full":  # moments a step has moved: what the resume must bring back
            run.store.write(state_array_name(1, "m", 0), m)
            run.store.write(state_array_name(3, "v", 0), torch.rand(prog.layer_numel(3), generator=gen))
        again = StateTiers(prog, placement, torch.device("cpu"), torch.bfloat16)
        bufs = {i: (again[i].master, again[i].m, again[i].v) for i in range(prog.n_layers)}

        def no_copy(name: str) -> torch.Tensor:
            raise AssertionError(f"{name} was read into a fresh host tensor first")

        monkeypatch.setattr(run.store, "read", no_copy)
        again.load(run.store, 0, durability)
        monkeypatch.undo()
        for i in range(prog.n_layers):
            s = again[i]
            if not s.numel:
                continue
            assert all(a is b for a, b in zip((s.master, s.m, s.v), bufs[i], strict=True))  # read in place
            assert torch.equal(s.master, tiers[i].master)
            assert torch.equal(s.compute, s.master.to(torch.bfloat16))
            assert not s.v.any() or (i == 3 and durability == "full")
        assert torch.equal(again[1].m, m if durability == "full" else torch.zeros(n))
        if durability == "full":
            assert torch.equal(again[3].v, run.store.read(state_array_name(3, "v", 0)))
    finally:
        run.store.close()


def test_a_resume_missing_an_array_says_which():
    cfg = small_config(placement="stateless", durability="weights")
    run = open_run(cfg, None)
    try:
        prog = run.program
        tiers = StateTiers(prog, ["ram"] * prog.n_layers, torch.device("cpu"), torch.float32)
        init_state(run.store, tiers, prog, run.params, "weights")
        with pytest.raises(StoreError, match=r"no array 'layers/0000/m/g0'"):
            StateTiers(prog, ["ram"] * prog.n_layers, torch.device("cpu"), torch.float32).load(run.store, 0, "full")
    finally:
        run.store.close()


@pytest.mark.gpu
def test_gpu_new_and_resumed_gpu_layers_go_through_pinned_staging():
    run = open_run(small_config(device="cuda", durability="full"), None)
    try:
        prog = run.program
        placement = ["gpu", "gpu", "ram", "gpu"]
        first = StateTiers(prog, placement, torch.device("cuda"), torch.bfloat16)
        want = {i: _reference_flat(prog, i, run.params) for i in range(prog.n_layers)}
        init_state(run.store, first, prog, run.params, "full")  # gpu layers through one pinned staging buffer
        for i in range(prog.n_layers):
            assert torch.equal(first[i].master.cpu(), want[i])
        moved = torch.rand(prog.layer_numel(1), generator=torch.Generator().manual_seed(1))
        run.store.write(state_array_name(1, "m", 0), moved)
        again = StateTiers(prog, placement, torch.device("cuda"), torch.bfloat16)
        again.load(run.store, 0, "full")
        for i in range(prog.n_layers):
            assert torch.equal(again[i].master.cpu(), first[i].master.cpu())
            assert torch.equal(again[i].compute.cpu(), again[i].master.to(torch.bfloat16).cpu())
        assert again[1].m.is_cuda and torch.equal(again[1].m.cpu(), moved)
        assert not again[3].v.any()
    finally:
        run.store.close()
