"""Disk throughput: the raw device (direct I/O, deep queue) and the store's own I/O path, same disk.

`raw_throughput` is the ceiling: ``O_DIRECT``, 1 MiB blocks, ``depth`` requests in flight (one
thread each doing ``pwrite``/``preadv`` on aligned buffers), sequential write, read and a 50/50
mix. The file is laid out first (that first pass is reported as ``write_fresh``), and the write
figure is the second pass over it, as fio measures a sequential write: on ext4 a direct write that
allocates blocks or extends the file holds the inode lock, so the first pass runs at queue depth
one and would understate the disk.

`store_throughput` moves the same bytes through `TensorStore` as the disk tier does (zarr format,
CRC32C, fsync, the store's I/O threads): write a generation of ``arrays`` arrays into new files
(``write_fresh``), write it again in place (``write``: the disk tier's steady state, where every
write lands on the generation the last commit does not name), read it back cold, and read half
the arrays while writing the other half (``mix``).

`compare_throughput` alternates raw and store trials over the same sizes (the disk is shared and
noisy: a trial's figure varies 2-3x on a cloud VM), every read cold (direct I/O, pages dropped),
and reports per mode the median of each side and the ratio of the medians.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from mtc.store.fastio import _O_DIRECT, ALIGN, _dev_of, _direct_refused, aligned_empty
from mtc.store.fastio import _open as _open_direct
from mtc.store.tensor_store import TensorStore

__all__ = ["MODES", "compare_throughput", "raw_throughput", "store_throughput"]

MODES = ("write", "read", "mix")  # the figures compared; ``write_fresh`` is reported beside them
_GB = 1e9


def _run_threads(n: int, fn: Callable[[int], None]) -> float:
    """Run ``fn(k)`` on ``n`` threads at once; seconds until all are done (the first error re-raised)."""
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
    ``block``-byte requests, ``depth`` of them in flight. Writes include the final fsync.
    """
    if block % ALIGN or block < 2**20:
        raise ValueError(f"block must be a multiple of {ALIGN} and at least 1 MiB, got {block}")
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    n_blocks = max(2 * depth, size_bytes // block)
    path = Path(directory) / f".mtc-rawbench-{uuid.uuid4().hex}"
    bufs = [aligned_empty(block) for _ in range(depth)]
    noise = np.random.default_rng(0).integers(0, 255, block, dtype=np.uint8)
    for b in bufs:
        b[:] = noise  # not all zeros: no sparse or compressing shortcuts
    fd, direct = _open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)

    def rd(k: int, off: int) -> None:
        os.preadv(fd, [memoryview(bufs[k])], off)

    def wr(k: int, off: int) -> None:
        os.pwrite(fd, memoryview(bufs[k]), off)

    def mix(k: int, off: int) -> None:  # half the threads read, half write: a 50/50 mix in flight at once
        (rd if k % 2 else wr)(k, off)

    def timed(op: Callable[[int, int], None], sync: bool) -> float:
        lock = threading.Lock()
        nxt = iter(range(n_blocks))

        def one(k: int) -> None:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                op(k, i * block)

        t = _run_threads(depth, one)
        if sync:
            t0 = time.perf_counter()
            os.fsync(fd)
            t += time.perf_counter() - t0
        _drop(fd)  # buffered fallback (no O_DIRECT here): the next pass starts cold
        return t

    try:
        t_f = timed(wr, True)
        t_w = timed(wr, True)
        t_r = timed(rd, False)
        t_m = timed(mix, True)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    total = n_blocks * block
    return {"write_fresh_GBps": total / t_f / _GB, "write_GBps": total / t_w / _GB, "read_GBps": total / t_r / _GB,
            "mix_GBps": total / t_m / _GB, "bytes": total, "block": block, "depth": depth, "direct": direct}


def _drop(fd: int) -> None:
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def store_throughput(directory: str | Path, size_bytes: int, *, io_threads: int = 8, arrays: int = 4) -> dict:
    """GB/s of the store's I/O path on ``size_bytes`` of fp32 state in a scratch store under ``directory``:
    write one generation of ``arrays`` arrays into new files (``write_fresh``), rewrite it in place
    (``write``), read it back cold, and read half the arrays while rewriting the other half (``mix``).
    Every write is durable (fsynced) when its time stops."""
    if arrays < 2:
        raise ValueError(f"arrays must be at least 2 (the mix reads half and writes half), got {arrays}")
    root = Path(tempfile.mkdtemp(prefix=".mtc-storebench-", dir=directory))
    try:
        st = TensorStore.create(root / "s", io_threads=io_threads)
        numel = max(1, size_bytes // 4 // arrays)
        bufs = [torch.from_numpy(aligned_empty(numel * 4).view(np.float32)) for _ in range(arrays)]
        for k, b in enumerate(bufs):
            b.copy_(torch.arange(numel, dtype=torch.float32) * (k + 1))
        names = [f"bench/{k}" for k in range(arrays)]
        for name in names:
            st.create_array(name, (numel,), torch.float32)
        total = numel * 4 * arrays

        def timed(futs_fn) -> float:
            t0 = time.perf_counter()
            for f in futs_fn():
                f.result()
            return time.perf_counter() - t0

        t_f = timed(lambda: [st.write_async(n, b, in_place=True) for n, b in zip(names, bufs, strict=True)])
        t_w = timed(lambda: [st.write_async(n, b, in_place=True) for n, b in zip(names, bufs, strict=True)])
        t_r = timed(lambda: [st.read_into_async(n, b) for n, b in zip(names, bufs, strict=True)])
        half = arrays // 2
        t_m = timed(lambda: [st.read_into_async(names[k], bufs[k]) for k in range(half)]
                    + [st.write_async(names[k], bufs[k], in_place=True) for k in range(half, arrays)])
        st.close()
        return {"write_fresh_GBps": total / t_f / _GB, "write_GBps": total / t_w / _GB, "read_GBps": total / t_r / _GB,
                "mix_GBps": total / t_m / _GB, "bytes": total, "io_threads": io_threads,
                "direct": st.direct_io and bool(_O_DIRECT) and _dev_of(root) not in _direct_refused}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def compare_throughput(directory: str | Path, size_bytes: int, *, trials: int = 5, io_threads: int = 8,
                       block: int = 2**20, depth: int = 16) -> dict:
    """Raw and store throughput in ``trials`` alternating pairs (raw first in even trials, store
    first in odd ones, so a drift of the disk's speed hits both alike) on ``size_bytes`` each.

    Returns per side every trial's figures and their medians, and per mode the ratio of the
    medians (``store_over_raw``) and the median of the per-trial ratios (``paired_ratio``).
    """
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    raw: list[dict] = []
    store: list[dict] = []
    t0 = time.perf_counter()
    for t in range(trials):
        pair = (lambda: raw.append(raw_throughput(directory, size_bytes, block=block, depth=depth)),
                lambda: store.append(store_throughput(directory, size_bytes, io_threads=io_threads)))
        for run in (pair if t % 2 == 0 else pair[::-1]):
            run()
    keys = (*MODES, "write_fresh")

    def med(side: list[dict]) -> dict[str, float]:
        return {k: statistics.median(r[f"{k}_GBps"] for r in side) for k in keys}

    raw_med, store_med = med(raw), med(store)
    return {
        "bytes": raw[0]["bytes"], "trials": trials, "block": block, "depth": depth, "io_threads": io_threads,
        "raw_direct_io": raw[0]["direct"], "store_direct_io": store[0]["direct"], "seconds": time.perf_counter() - t0,
        "raw_trials": [{k: r[f"{k}_GBps"] for k in keys} for r in raw],
        "store_trials": [{k: s[f"{k}_GBps"] for k in keys} for s in store],
        "raw_median": raw_med, "store_median": store_med,
        "store_over_raw": {k: store_med[k] / raw_med[k] for k in keys},
        "paired_ratio": {k: statistics.median(s[f"{k}_GBps"] / r[f"{k}_GBps"] for r, s in zip(raw, store, strict=True))
                         for k in keys},
    }
