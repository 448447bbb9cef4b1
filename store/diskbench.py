"""Disk throughput: the raw device (direct I/O, deep queue) and the store's own I/O path, same disk.

`raw_throughput` is the ceiling: ``O_DIRECT``, 1 MiB blocks, ``depth`` requests in flight (one
thread each doing ``pread``/``pwrite`` on aligned buffers), sequential read, write and a 50/50
mix. `store_throughput` moves the same bytes through `TensorStore` (zarr format, CRC32C, fsync,
the store's I/O threads) as the disk tier does: write a generation, read it back cold, and read
one generation while writing the other. Comparing both in one run tells how much of the disk
the trainer's I/O path leaves unused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from mtc.store.fastio import ALIGN, aligned_empty
from mtc.store.fastio import _open as _open_direct
from mtc.store.tensor_store import TensorStore

__all__ = ["raw_throughput", "store_throughput"]

_GB = 1e9


def _run_threads(n: int, fn) -> float:
    errors: list[BaseException] = []

    def wrap(k: int) -> None:
        try:
            fn(k)
        except BaseException as e:  # noqa: BLE001 -- re-raised on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(k,)) for k in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def raw_throughput(directory: str | Path, size_bytes: int, *, block: int = 2**20, depth: int = 16) -> dict:
    """Sequential write, read and 50/50 read/write GB/s of a ``size_bytes`` file in ``directory``.

    Direct I/O where the file system allows it (``direct`` in the result says whether it did),
    ``block``-byte requests, ``depth`` of them in flight.
    """
    if block % ALIGN or block < 2**20:
        raise ValueError(f"block must be a multiple of {ALIGN} and at least 1 MiB, got {block}")
    n_blocks = max(2 * depth, size_bytes // block)
    path = Path(directory) / f".mtc-rawbench-{uuid.uuid4().hex}"
    bufs = [aligned_empty(block) for _ in range(depth)]
    for b in bufs:
        b[:] = np.random.default_rng(0).integers(0, 255, block, dtype=np.uint8)  # not all zeros: no sparse shortcuts
    fd, direct = _open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    lock = threading.Lock()
    try:
        def runner(op_of):
            nxt = iter(range(n_blocks))

            def one(k: int) -> None:
                while True:
                    with lock:
                        i = next(nxt, None)
                    if i is None:
                        return
                    op_of(k, i)(fd, memoryview(bufs[k]), i * block)
            return one

        def wr(_k: int, _i: int):
            return lambda f, b, off: os.pwrite(f, b, off)

        def rd(_k: int, _i: int):
            return lambda f, b, off: os.preadv(f, [b], off)

        def mix(k: int, _i: int):  # half the threads read, half write: a 50/50 mix in flight at once
            return rd(k, _i) if k % 2 else wr(k, _i)

        t_w = _run_threads(depth, runner(wr))
        t0 = time.perf_counter()
        os.fsync(fd)
        t_w += time.perf_counter() - t0
        _drop(fd)
        t_r = _run_threads(depth, runner(rd))
        _drop(fd)
        t_m = _run_threads(depth, runner(mix))
        t0 = time.perf_counter()
        os.fsync(fd)
        t_m += time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    total = n_blocks * block
    return {"write_GBps": total / t_w / _GB, "read_GBps": total / t_r / _GB, "mix_GBps": total / t_m / _GB,
            "bytes": total, "block": block, "depth": depth, "direct": direct}


def _drop(fd: int) -> None:
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def store_throughput(directory: str | Path, size_bytes: int, *, io_threads: int = 8, arrays: int = 4) -> dict:
    """GB/s of the store's I/O path on ``size_bytes`` of fp32 state in a scratch store under ``directory``:
    write (one generation of ``arrays`` arrays, fsynced), cold read, and read one generation while
    writing the other (the disk tier's steady state, half the bytes each way)."""
    root = Path(tempfile.mkdtemp(prefix=".mtc-storebench-", dir=directory))
    try:
        st = TensorStore.create(root / "s", io_threads=io_threads)
        numel = max(1, size_bytes // 4 // arrays)
        bufs = [torch.from_numpy(aligned_empty(numel * 4).view(np.float32)) for _ in range(arrays)]
        for k, b in enumerate(bufs):
            b.copy_(torch.arange(numel, dtype=torch.float32) * (k + 1))
        for g in (0, 1):
            for k in range(arrays):
                st.create_array(f"bench/{k}/g{g}", (numel,), torch.float32)
        total = numel * 4 * arrays

        def timed(futs_fn) -> float:
            t0 = time.perf_counter()
            for f in futs_fn():
                f.result()
            return time.perf_counter() - t0

        t_w = timed(lambda: [st.write_async(f"bench/{k}/g0", b) for k, b in enumerate(bufs)])
        t_r = timed(lambda: [st.read_into_async(f"bench/{k}/g0", b) for k, b in enumerate(bufs)])
        half = arrays // 2 or 1

        def mixed():  # read the first arrays of g0 while writing the others into g1
            return ([st.read_into_async(f"bench/{k}/g0", bufs[k]) for k in range(half)]
                    + [st.write_async(f"bench/{k}/g1", bufs[k]) for k in range(half, arrays)])

        mixed_bytes = numel * 4 * arrays
        t_m = timed(mixed)
        st.close()
        return {"write_GBps": total / t_w / _GB, "read_GBps": total / t_r / _GB, "mix_GBps": mixed_bytes / t_m / _GB,
                "bytes": total, "io_threads": io_threads}
    finally:
        shutil.rmtree(root, ignore_errors=True)
