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
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np
import torch

__all__ = ["host_buffer", "host_nbytes", "pinning_report", "registered_bytes"]

_lock = threading.Lock()
_registered: dict[int, int] = {}  # data pointer -> bytes, of every live registered buffer
_failed: list[str] = []  # why registration failed, once (the fallback then serves every buffer)


def _unregister(ptr: int) -> None:
    with _lock:
        _registered.pop(ptr, None)
    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if err != torch.cuda.cudart().cudaError.success:  # nothing to recover at teardown: the memory is unmapped next
        _failed.append(f"cudaHostUnregister returned {err}")


def _mapped(nbytes: int) -> np.ndarray:
    """Page-aligned, zero-filled memory of ``nbytes`` (a private anonymous mapping: not shared with
    a forked child; its pages are allocated on first touch)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes)


def _register(arr: np.ndarray) -> bool:
    """Page-lock ``arr`` with the driver until it is freed; False when the driver refuses."""
    ptr, nbytes = arr.ctypes.data, arr.nbytes
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if err != cudart.cudaError.success:
        _failed.append(f"cudaHostRegister of {nbytes:,} bytes returned {err}")
        return False
    with _lock:
        _registered[ptr] = nbytes
    # the array dies once the last tensor view of it does: unregister then, before its pages go
    weakref.finalize(arr, _unregister, ptr)
    return True


def host_buffer(numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """A zero-filled, page-aligned 1-D host tensor of ``numel`` elements, page-locked when
    ``pinned`` and CUDA is available (exactly ``numel * itemsize`` bytes; see the module docstring)."""
    nbytes = numel * dtype.itemsize
    if not nbytes:
        return torch.zeros(numel, dtype=dtype)
    pin = pinned and torch.cuda.is_available()
    if pin and _failed:  # registration was refused before: torch's pinned allocator
        return torch.zeros(numel, dtype=dtype, pin_memory=True)
    arr = _mapped(nbytes)
    if pin and not _register(arr):
        del arr
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
    return f"host buffers: exact-size registered memory ({registered_bytes() / 2**30:.2f} GiB)"


def registered_bytes() -> int:
    """Bytes of host memory currently registered through `pinned_empty` (for reports and tests)."""
    with _lock:
        return sum(_registered.values())
