"""The engine's host buffers: page-aligned, and page-locked on CUDA at exactly the size asked for.

torch's pinned allocator (``pin_memory=True``) rounds every allocation up to the next power of
two before it asks CUDA for it (ATen's CachingHostAllocator: ``PowerOf2Ceil(size)``, then
``cudaHostAlloc``), so an h=4096 Llama layer's 436 MB bf16 compute copy pins 512 MiB and its 872 MB
fp32 gradient 1 GiB (+23 %; just above a power of two, +100 %). The engine keeps tens of GB pinned
for a whole run, and the placement's RAM budget counts bytes, so a buffer here is page-aligned
anonymous memory of its exact size, registered with the driver (``cudaHostRegister``): the GPU's
copy engines read and write it directly and copies from it are asynchronous, as from
``cudaHostAlloc`` memory. It is unregistered before its memory is returned. Where registration
fails (e.g. the locked-memory limit), the buffer comes from torch's allocator instead, and
`host_nbytes` counts it at its rounded size. Without CUDA nothing is pinned. Page alignment also
lets the store read and write every buffer with O_DIRECT, without a bounce copy (store/fastio.py).

A buffer dies when its last tensor view does, which may be inside a garbage collection at any
point of any thread (a CUDA graph capture included), so its finalizer only queues it; the next
allocation (or `release_pending`) unregisters it and lets its pages go, in that order.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref

import numpy as np
import torch

__all__ = ["host_buffer", "host_nbytes", "pinning_report", "registered_bytes", "release_pending"]

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process

_lock = threading.RLock()
_registered: dict[int, int] = {}  # data pointer -> bytes, of every registered buffer not yet released
_pending: list[tuple[int, mmap.mmap]] = []  # dead buffers still registered: (pointer, the mapping that holds their pages)
_failed: list[str] = []  # why registration failed, once (the fallback then serves every buffer)
_unregister_errors: list[str] = []


def _queue_release(ptr: int, buf: mmap.mmap) -> None:
    # a finalizer: may run inside a garbage collection anywhere, so no lock and no CUDA call here
    # (list.append is atomic); keeping `buf` keeps the pages mapped until they are unregistered
    _pending.append((ptr, buf))


def release_pending() -> None:
    """Unregister the buffers that died since the last call, then let their pages go (not while
    this thread captures a CUDA graph: the next call does it)."""
    if not _pending or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    with _lock:
        cudart = torch.cuda.cudart()
        while _pending:
            # one at a time (list.pop is atomic): a finalizer may append while this runs
            ptr, buf = _pending.pop()
            _registered.pop(ptr, None)
            err = cudart.cudaHostUnregister(ptr)
            if err != cudart.cudaError.success:
                _unregister_errors.append(f"cudaHostUnregister returned {err}")
                _clear_cuda_error()
            del buf  # the mapping goes now, after its pages were unregistered


def _clear_cuda_error() -> None:
    """A failed runtime call leaves its error as the thread's last error, which torch's next kernel
    launch check would raise as its own: take it out now (the launch check reads and resets it)."""
    with contextlib.suppress(RuntimeError):  # raised once, with the runtime's stale error: that is the point
        torch.zeros(1, device="cuda").add_(1)


_HUGE_PAGE = 2 * 2**20


def _mapped(nbytes: int) -> tuple[np.ndarray, mmap.mmap]:
    """Page-aligned, zero-filled memory of ``nbytes`` (a private anonymous mapping, its pages
    allocated on first touch) and the mapping that holds it. Mappings of a huge page or more ask
    for transparent huge pages (where THP is in 'madvise' mode, the usual default): a first touch,
    or pinning, then faults once per 2 MiB instead of once per 4 KiB (a 4.6B model's host state is
    ~70 GB: ~17 M small faults). On this project's 2-core CPU VM, first touch of a 2 GB mapping ran
    at 5-7 GB/s with them against ~5 without, and a new 0.57B stateless run's `init_state` took 4.0-4.8 s
    against 5.7-7.5 (its first step 12 s against 15-16 s). Registration is charged per page too:
    ROCm's mori measured hipHostRegister of a 1.5 TB range 2.47x faster with the same advice
    (github.com/ROCm/mori pull 679); not measured with cudaHostRegister here yet."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without THP: plain pages, as before
            buf.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes), buf


def _register(arr: np.ndarray, buf: mmap.mmap) -> bool:
    """Page-lock ``arr`` with the driver until it is released; False when the driver refuses."""
    ptr, nbytes = arr.ctypes.data, arr.nbytes
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE)
    if err != cudart.cudaError.success:
        _failed.append(f"cudaHostRegister of {nbytes:,} bytes returned {err}")
        _clear_cuda_error()
        return False
    with _lock:
        _registered[ptr] = nbytes
    # the array dies once the last tensor view of it does: queue it for unregistering then
    weakref.finalize(arr, _queue_release, ptr, buf)
    return True


def host_buffer(numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """A zero-filled, page-aligned 1-D host tensor of ``numel`` elements, page-locked when
    ``pinned`` and CUDA is available (exactly ``numel * itemsize`` bytes; see the module docstring)."""
    nbytes = numel * dtype.itemsize
    if not nbytes:
        return torch.zeros(numel, dtype=dtype)
    pin = pinned and torch.cuda.is_available()
    if pin:
        release_pending()
        if _failed:  # registration was refused before: torch's pinned allocator
            return torch.zeros(numel, dtype=dtype, pin_memory=True)
    arr, buf = _mapped(nbytes)
    if pin and not _register(arr, buf):
        del arr, buf
        return torch.zeros(numel, dtype=dtype, pin_memory=True)
    return torch.from_numpy(arr).view(dtype)


def host_nbytes(t: torch.Tensor) -> int:
    """Host bytes ``t``'s buffer holds: its size, or for torch-pinned memory the power of two the
    caching allocator rounded it up to."""
    n = t.untyped_storage().nbytes()
    if t.device.type != "cpu" or not n:
        return n
    ptr = t.untyped_storage().data_ptr()
    with _lock:
        if ptr in _registered:
            return n
    if torch.cuda.is_available() and t.is_pinned():
        return 1 << (n - 1).bit_length()
    return n


def pinning_report() -> str:
    """One line for the run's log: how host buffers were pinned."""
    if not torch.cuda.is_available():
        return "host buffers: not pinned (no CUDA)"
    if _failed:
        return f"host buffers: torch's pinned allocator (sizes rounded up to powers of two): {_failed[0]}"
    errs = f"; {len(_unregister_errors)} failed to unregister ({_unregister_errors[0]})" if _unregister_errors else ""
    return f"host buffers: exact-size registered memory ({registered_bytes() / 2**30:.2f} GiB){errs}"


def registered_bytes() -> int:
    """Bytes of host memory registered through `host_buffer` and not yet released (reports, tests)."""
    release_pending()
    with _lock:
        return sum(_registered.values())
