"""The engine's host buffers: page-aligned, exact-size, registered with the driver on CUDA.

On the CPU the driver is replaced by a recorder (the thing under test is mtc's allocation,
registry and release logic, not CUDA); the gpu-marked tests register real memory.
"""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

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
        self.registered_flags = flags
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def driver(monkeypatch):
    # real buffers of earlier tests (on CUDA) that die while the fake driver is in place would be
    # queued into its lists and "unregistered" by it: collect and release them with the real one first
    gc.collect()
    pinned.release_pending()
    drv = _FakeDriver()
    drv.capturing = False
    drv.cleared = 0  # runtime errors taken out after a failed call
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: drv.capturing)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: drv)
    monkeypatch.setattr(pinned, "_clear_cuda_error", lambda: setattr(drv, "cleared", drv.cleared + 1))
    for name in ("_failed", "_pending", "_unregister_errors"):
        monkeypatch.setattr(pinned, name, [])
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


def _vm_flags(ptr: int) -> list[str] | None:
    """The kernel's VmFlags of the mapping holding address ``ptr`` (Linux /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="needs Linux with transparent huge pages")
def test_buffers_of_a_huge_page_or_more_ask_for_huge_pages():
    big = pinned.host_buffer(2**20, torch.float32, pinned=False)  # 4 MiB
    small = pinned.host_buffer(1024, torch.float32, pinned=False)
    assert "hg" in _vm_flags(big.data_ptr())  # MADV_HUGEPAGE: first touch faults per 2 MiB, not per 4 KiB
    assert "hg" not in _vm_flags(small.data_ptr())
    assert not big.any() and big.data_ptr() % mmap.PAGESIZE == 0


def test_an_empty_buffer():
    assert pinned.host_buffer(0, torch.float32, pinned=True).numel() == 0


def test_registers_exactly_the_bytes_and_unregisters_when_the_last_view_dies(driver):
    t = pinned.host_buffer(1000003, torch.bfloat16, pinned=True)  # 2,000,006 bytes: torch would pin 2 MiB
    ptr = t.data_ptr()
    assert driver.registered == {ptr: 2_000_006} and driver.registered_flags == 1  # portable: every context
    assert pinned.registered_bytes() == 2_000_006 and pinned.host_nbytes(t) == 2_000_006
    view = t[10:20]
    del t
    gc.collect()
    pinned.release_pending()
    assert driver.unregistered == []  # a view still holds the memory
    del view
    gc.collect()
    # the finalizer only queues it (it may run inside any garbage collection): the next
    # allocation or release_pending unregisters it, not while this thread captures a CUDA graph
    assert driver.unregistered == [] and pinned._pending
    driver.capturing = True
    pinned.release_pending()
    assert driver.unregistered == []
    driver.capturing = False
    keep = pinned.host_buffer(10, torch.float32, pinned=True)
    assert driver.unregistered == [ptr] and not pinned._pending and keep.numel() == 10
    assert pinned.registered_bytes() == 40
    assert "exact-size registered memory" in pinned.pinning_report()


def test_a_refused_registration_is_reported_and_its_error_cleared(driver):
    driver.refuse = True
    arr, buf = pinned._mapped(8192)
    assert not pinned._register(arr, buf)
    assert driver.registered == {} and pinned.registered_bytes() == 0
    assert driver.cleared == 1  # torch's next kernel launch would otherwise raise the runtime's error as its own
    report = pinned.pinning_report()
    assert "rounded up to powers of two" in report and "cudaHostRegister of 8,192 bytes returned 2" in report


@pytest.mark.gpu
@pytest.mark.parametrize("numel", [1000003, 6_000_001])  # under a huge page, and over (asks for huge pages)
def test_gpu_registered_buffer_is_pinned_and_copies_asynchronously(numel):
    gc.collect()  # earlier tests' dead buffers go now, not during this test's count
    before = pinned.registered_bytes()
    t = pinned.host_buffer(numel, torch.bfloat16, pinned=True)
    assert "exact-size" in pinned.pinning_report(), pinned.pinning_report()
    assert t.is_pinned()
    assert pinned.registered_bytes() - before == 2 * numel
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
