"""Placement arithmetic: tiers from strings and budgets, the GPU-update cost model, bytes per tier."""

from __future__ import annotations

import pytest

from mtc.errors import ConfigError
from mtc.runtime import placement as pl


def test_placement_strings():
    assert pl.resolve_placement("stateless", 3) == ["ram"] * 3
    assert pl.resolve_placement("gpu:0,ram:1-2,disk:3", 4) == ["gpu", "ram", "ram", "disk"]
    assert pl.resolve_placement("auto", 2, auto=["gpu", "ram"]) == ["gpu", "ram"]
    with pytest.raises(ConfigError):
        pl.resolve_placement("gpu:0,ram:2", 3)  # layer 1 unplaced
    assert pl.describe(["gpu", "ram", "ram", "disk"]) == "gpu:0,ram:1-2,disk:3"


def test_gpu_update_names_only_ram_layers():
    placement = ["gpu", "ram", "ram", "disk"]
    assert pl.resolve_gpu_update("all", placement, [1, 1, 1, 1], device_is_cuda=True) == {1, 2}
    assert pl.resolve_gpu_update("none", placement, [1, 1, 1, 1], device_is_cuda=True) == set()
    assert pl.resolve_gpu_update("auto", placement, [1, 1, 1, 1], device_is_cuda=False) == set()
    with pytest.raises(ConfigError, match="not placed in ram"):
        pl.resolve_gpu_update("0-1", placement, [1, 1, 1, 1], device_is_cuda=True)


@pytest.mark.parametrize(("cpu", "bw"), [(2.7e9, 50e9), (8e9, 50e9), (1e9, 50e9)])
@pytest.mark.parametrize(("grads_on_device", "per_param"), [(True, 14), (False, 16)])
def test_cost_model_balances_cpu_and_pcie_time(cpu, bw, grads_on_device, per_param):
    # bf16: 12 B of master, m, v in and 14 B out with the compute copy; the gradient adds 4 B in
    # when it waits on the host (data parallel), so the busier direction carries 14 or 16 B/param
    numels = [100] * 40
    chosen = pl.choose_gpu_update(["ram"] * 40, numels, cpu, bw, grads_on_device=grads_on_device)
    f = sum(numels[i] for i in chosen) / sum(numels)
    t_cpu, t_gpu = (1 - f) * 4000 / cpu, f * 4000 * per_param / bw
    assert abs(t_cpu - t_gpu) <= 0.1 * max(t_cpu, t_gpu), (f, t_cpu, t_gpu)
    # interleaved over depth, so both engines move along the next forward together
    assert not chosen or (min(chosen) < 10 and max(chosen) >= 30)


def test_gpu_updates_fit_their_gpu_memory():
    # each layer the GPU updates keeps its 4 B/param gradient there, beside two scratch sets of
    # master, m, v and the bf16 copy (14 B/param) of the largest
    numels = [100] * 40
    free = pl.choose_gpu_update(["ram"] * 40, numels, 1e9, 50e9)
    assert pl.streamed_gpu_bytes(free, numels, 2) == 4 * 100 * len(free) + 2 * 14 * 100
    budget = 4 * 100 * 5 + 2 * 14 * 100
    capped = pl.choose_gpu_update(["ram"] * 40, numels, 1e9, 50e9, gpu_bytes=budget)
    assert len(free) > 5 and len(capped) == 5 and pl.streamed_gpu_bytes(capped, numels, 2) <= budget
    assert pl.choose_gpu_update(["ram"] * 40, numels, 1e9, 50e9, gpu_bytes=2 * 14 * 100 - 1) == set()
    # a data-parallel rank's gradient comes from the host: no gradient on the GPU, a fifth scratch array
    assert pl.streamed_gpu_bytes({0, 1}, numels, 2, grads_on_device=False) == 2 * 18 * 100


def test_prefetch_takes_the_gpu_memory_left_a_set_per_layer():
    numels = [100] * 40
    up = set(range(0, 40, 2))  # 20 GPU-updated layers
    two = pl.streamed_gpu_bytes(up, numels, 2)
    assert pl.streamed_gpu_bytes(up, numels, 2, prefetch=2) == two  # the two sets the update has anyway
    assert pl.streamed_gpu_bytes(up, numels, 2, prefetch=5) == two + 3 * 14 * 100
    auto = dict(gpu_bytes=two + 4 * 14 * 100 + 13 + pl.PREFETCH_MARGIN_BYTES, grads_on_device=True)
    assert pl.choose_prefetch(None, up, numels, 2, **auto) == 6  # two sets and four more
    assert pl.choose_prefetch(None, up, numels, 2, gpu_bytes=10**10, grads_on_device=True) == 20  # at most every layer
    # the margin stays free: no room beyond the two sets the update has anyway
    assert pl.choose_prefetch(None, up, numels, 2, gpu_bytes=pl.PREFETCH_MARGIN_BYTES + two, grads_on_device=True) == 2
    assert pl.choose_prefetch(3, up, numels, 2, gpu_bytes=0, grads_on_device=False) == 3  # named: taken as it is
    assert pl.choose_prefetch(50, up, numels, 2, gpu_bytes=None, grads_on_device=True) == 20
    # unknown GPU memory, or gradients that come from the host (a fixed activation budget): none
    assert pl.choose_prefetch(None, up, numels, 2, gpu_bytes=None, grads_on_device=True) == 0
    assert pl.choose_prefetch(None, up, numels, 2, gpu_bytes=10**10, grads_on_device=False) == 0
    assert pl.choose_prefetch(None, set(), numels, 2, gpu_bytes=10**10, grads_on_device=True) == 0


def test_prefetch_shifts_the_balance_to_the_gpu():
    """State loaded during the backward, into sets of their own, leaves only the new weights' copy
    back (2 B per parameter in bf16) after the norm, at the one-way rate: the GPU's share grows to
    balance it (t_gpu per parameter 12 (1 - phi)/bw + max(0, out - 12 (1 - phi))/one_way)."""
    numels = [100] * 40
    cpu, bw, one_way = 2.2e9, 41e9, 55e9
    without = pl.choose_gpu_update(["ram"] * 40, numels, cpu, bw, one_way_bytes_per_s=one_way)
    every = pl.choose_gpu_update(["ram"] * 40, numels, cpu, bw, one_way_bytes_per_s=one_way, prefetch=40)
    assert len(every) > len(without)
    f = len(every) / 40
    t_cpu, t_gpu = (1 - f) * 4000 / cpu, f * 4000 * 2 / one_way  # phi = psi = 1: all loaded ahead, weights back first
    assert abs(t_cpu - t_gpu) <= 0.1 * max(t_cpu, t_gpu), (f, t_cpu, t_gpu)
    # loaded ahead but through two sets the later layers reuse (2 of 40): their whole state goes
    # back in the window, so the share grows less
    two_sets = pl.choose_gpu_update(["ram"] * 40, numels, cpu, bw, one_way_bytes_per_s=one_way, prefetch=2)
    assert len(without) <= len(two_sets) < len(every)
    # auto with no GPU memory figure loads nothing ahead: the balance without
    assert pl.choose_gpu_update(["ram"] * 40, numels, cpu, bw, one_way_bytes_per_s=one_way, prefetch=None) == without


def test_bytes_per_tier():
    numels = [10, 20, 30]
    assert pl.disk_bytes_needed(["ram", "ram", "disk"], numels, "full") == 24 * 60
    assert pl.disk_bytes_needed(["ram", "ram", "disk"], numels, "weights") == 8 * 30 + 24 * 30
    assert pl.disk_bytes_needed(["ram", "ram", "ram"], numels, "none") == 0
    # bf16 compute: ram 12 state + 4 gradient + 2 copy; disk 4 gradient + 2 copy; fp32: no copy
    assert pl.host_bytes_needed(["ram", "disk", "gpu"], numels, 2) == 18 * 10 + 6 * 20
    assert pl.host_bytes_needed(["ram"], [10], 4) == 16 * 10
    # the RAM budget holds the disk layers' host bytes too (6 B/param here: bf16 copy + gradient)
    assert pl.auto_placement([10, 10, 10], 2, gpu_bytes=18 * 10, ram_bytes=18 * 10 + 6 * 10) == ["gpu", "ram", "disk"]
    assert pl.auto_placement([10, 10, 10], 2, gpu_bytes=18 * 10, ram_bytes=18 * 10) == ["gpu", "disk", "disk"]


def test_auto_placement_charges_resident_layers_their_extra_gpu_bytes():
    # bf16: 18 B/param on the GPU; a budget for two layers' state holds one once each costs 50 B more
    # (the CUDA graphs that would read its resident weights)
    budget = 2 * 18 * 10
    assert pl.auto_placement([10, 10, 10], 2, gpu_bytes=budget, ram_bytes=10**6) == ["gpu", "gpu", "ram"]
    assert pl.auto_placement([10, 10, 10], 2, gpu_bytes=budget, ram_bytes=10**6, gpu_extra=[50, 50, 50]) == ["gpu", "ram", "ram"]
    # only the layers that have such graphs pay: here layer 1 no longer fits, layer 2 (not replayed) does
    assert pl.auto_placement([10, 10, 10], 2, gpu_bytes=budget + 49, ram_bytes=10**6, gpu_extra=[0, 50, 0]) == ["gpu", "ram", "gpu"]


def test_a_layer_placed_in_ram_gives_back_its_gpu_gradient_reservation():
    """Every layer starts on disk, its gradient reserved on the GPU (4 B/param on CUDA); a layer that
    lands in RAM sends its gradient through the shared slab ring instead, so the reservation comes
    back and a later layer may use it."""
    # layer 0 takes the GPU (14 B/param beyond its reservation: 140); layer 1 does not fit and goes
    # to RAM, returning 400; layer 2 then fits (140)
    placement = pl.auto_placement([10, 100, 10], 2, gpu_bytes=4 * 120 + 140, ram_bytes=10**9, grads_on_device=True)
    assert placement == ["gpu", "ram", "gpu"]


@pytest.mark.parametrize(("cuda", "compute_bytes", "disk_compute"), [(False, 4, "store"), (True, 2, "ram"), (True, 4, "store")])
def test_auto_placement_takes_all_ram_whenever_the_budget_holds_it(cuda, compute_bytes, disk_compute):
    """The fill passes through placements with disk layers, charged the disk ring's buffers: at the
    exact budget of all-RAM (no ring) it once ended with disk layers, a mixed placement that is
    slower and holds less than the budget allowed."""
    numels = [16384, 50000, 50000, 50000, 50000, 16384]  # embed, blocks, head

    def pipeline(p: list[str]) -> int:
        return pl.pipeline_host_bytes(p, numels, disk_compute=disk_compute, device_is_cuda=cuda)

    def host(p: list[str]) -> int:
        return pl.host_bytes_needed(p, numels, compute_bytes, disk_compute=disk_compute, grads_on_device=cuda) + pipeline(p)

    def auto(ram: int, gpu: int = 0) -> list[str]:
        return pl.auto_placement(numels, compute_bytes, gpu_bytes=gpu, ram_bytes=ram, disk_compute=disk_compute,
                                 grads_on_device=cuda, pipeline=pipeline)

    all_ram = ["ram"] * len(numels)
    assert auto(host(all_ram)) == all_ram
    under = auto(host(all_ram) - 1)
    assert "disk" in under and host(under) <= host(all_ram) - 1
    if cuda:  # the layers the GPU takes stay there; the rest go to RAM when it holds them all
        gpu = (16 + (compute_bytes if compute_bytes != 4 else 0)) * numels[0] + 4 * sum(numels[1:])
        mixed = ["gpu"] + ["ram"] * (len(numels) - 1)
        assert auto(host(mixed), gpu) == mixed
        assert "disk" in auto(host(mixed) - 1, gpu)


def test_auto_placement_charges_each_candidate_its_own_pipeline():
    """The pipeline's host bytes change with the placement (on the CPU device the first `ram` layer
    opens gradient slabs sized by the largest): each candidate is charged its own, not the
    all-disk pipeline's."""
    numels = [10, 10, 10]  # fp32: ram 16 B/param, disk 4 (the gradient; weights read from the store)

    def pipeline(p: list[str]) -> int:
        return 100 if "ram" in p else 0  # slabs appear with the first ram layer

    all_disk = 4 * 30
    one_ram = all_disk + 12 * 10 + 100
    assert pl.auto_placement(numels, 4, gpu_bytes=0, ram_bytes=one_ram, disk_compute="store", pipeline=pipeline) == ["ram", "disk", "disk"]
    assert pl.auto_placement(numels, 4, gpu_bytes=0, ram_bytes=one_ram - 1, disk_compute="store", pipeline=pipeline) == ["disk"] * 3
    # without it the slabs were missed, and the placement did not fit the budget it was made for
    assert pl.auto_placement(numels, 4, gpu_bytes=0, ram_bytes=one_ram - 1, disk_compute="store") == ["ram", "disk", "disk"]
