"""The engine's host buffers: page-aligned, exact-size, registered with the driver on CUDA.

On the CPU the driver is replaced by a recorder (the thing under test is mtc's allocation,
registry and release logic, not CUDA); the gpu-marked tests register real memory.
"""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from mtc.runtime import pinned


class _FakeDriver:
    """Records cudaHostRegister / cudaHostUnregister calls; refuses registration when told to."""

    class cudaError:  # noqa: N801 - the name torch's cudart module uses
        success = 0

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        if self.refuse:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def driver(monkeypatch):
    drv = _FakeDriver()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: drv)
    monkeypatch.setattr(pinned, "_failed", [])
    monkeypatch.setattr(pinned, "_registered", {})
    return drv


@pytest.mark.parametrize("numel,dtype", [(1, torch.float32), (1000003, torch.bfloat16), (4096, torch.float32)])
def test_unpinned_buffers_are_page_aligned_zeroed_and_exact(numel, dtype):
    t = pinned.host_buffer(numel, dtype, pinned=False)
    assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu"
    assert t.data_ptr() % mmap.PAGESIZE == 0  # the store writes it with O_DIRECT, no bounce copy
    assert not t.any()
    t.fill_(3)  # writable
    assert pinned.host_nbytes(t) == numel * dtype.itemsize


def test_an_empty_buffer():
    assert pinned.host_buffer(0, torch.float32, pinned=True).numel() == 0


def test_registers_exactly_the_bytes_and_unregisters_when_the_last_view_dies(driver):
    t = pinned.host_buffer(1000003, torch.bfloat16, pinned=True)  # 2,000,006 bytes: torch would pin 2 MiB
    ptr = t.data_ptr()
    assert driver.registered == {ptr: 2_000_006}
    assert pinned.registered_bytes() == 2_000_006 and pinned.host_nbytes(t) == 2_000_006
    view = t[10:20]
    del t
    gc.collect()
    assert driver.unregistered == []  # a view still holds the memory
    del view
    gc.collect()
    assert driver.unregistered == [ptr]
    assert pinned.registered_bytes() == 0
    assert "exact-size registered memory" in pinned.pinning_report()


def test_a_refused_registration_is_reported(driver):
    driver.refuse = True
    arr = pinned._mapped(8192)
    assert not pinned._register(arr)
    assert driver.registered == {} and pinned.registered_bytes() == 0
    report = pinned.pinning_report()
    assert "rounded up to powers of two" in report and "cudaHostRegister of 8,192 bytes returned 2" in report


@pytest.mark.gpu
def test_gpu_registered_buffer_is_pinned_and_copies_asynchronously():
    before = pinned.registered_bytes()
    t = pinned.host_buffer(1000003, torch.bfloat16, pinned=True)
    assert "exact-size" in pinned.pinning_report(), pinned.pinning_report()
    assert t.is_pinned()
    assert pinned.registered_bytes() - before == 2_000_006
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).to(torch.bfloat16))
    dev = t.to("cuda", non_blocking=True)
    back = pinned.host_buffer(t.numel(), torch.bfloat16, pinned=True)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, t)
    del t, back
    gc.collect()
    assert pinned.registered_bytes() == before


@pytest.mark.gpu
def test_gpu_torch_pinned_memory_counts_at_its_rounded_size():
    t = torch.empty(1000, dtype=torch.float32, pin_memory=True)  # 4,000 bytes -> 4,096
    assert pinned.host_nbytes(t) == 4096
