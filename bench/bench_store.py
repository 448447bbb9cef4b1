"""Store throughput: checked, fsynced writes and parallel reads into a preallocated buffer.

Writes a 1-D fp32 array of --size-mb to a local store (CRC32C per chunk, fsync of every chunk
file and directory), then reads it back into one reused buffer with the store's I/O threads:
"warm" straight after the write (page cache hot, as when the optimizer just wrote the state) and
"cold" after evicting the chunk files from the page cache with posix_fadvise(DONTNEED) (no root
needed; close to a first read from disk). Beside it, the raw ceiling of the same disk: a plain
numpy tofile + fsync and a plain readinto. Medians over --repeats after one warm-up.

    python bench/bench_store.py --size-mb 256 --threads 4 --dir /tmp/bench-store
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, write_record
from mtc.calibrate import cpu_model
from mtc.store import TensorStore


def _timed(fn: Callable[[], None], repeats: int, before: Callable[[], None] | None = None) -> list[float]:
    """Seconds per call of ``fn`` (``before`` runs untimed ahead of each), after one warm-up call."""
    out = []
    for i in range(repeats + 1):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        if i:
            out.append(time.perf_counter() - t)
    return out


def _evict(paths: list[Path]) -> None:
    """Drop clean cached pages of ``paths`` (they were fsynced, so all of them are clean)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    """Measure, print a short table and write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=256, help="array size in MiB (default 256)")
    ap.add_argument("--threads", type=int, default=4, help="store I/O threads (default 4)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (default 5)")
    ap.add_argument("--dir", help="directory for the test store (default: a temp dir; removed afterwards)")
    a = ap.parse_args()

    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="mtc-bench-store-"))
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / "store", ignore_errors=True)
    n = a.size_mb * 2**20 // 4
    nbytes = n * 4
    data = torch.randn(n)
    out = torch.empty(n)
    try:
        with TensorStore.create(root / "store", io_threads=a.threads) as st:
            st.create_array("x", (n,), torch.float32)
            info = st.array_info("x")
            t_write = _timed(lambda: st.write("x", data), a.repeats)
            chunk_files = [st.chunk_path("x", c) for c in range(info.n_chunks)]
            t_read = _timed(lambda: st.read_into("x", out), a.repeats)
            assert torch.equal(out, data)
            out.zero_()
            t_cold = _timed(lambda: st.read_into("x", out), a.repeats, before=lambda: _evict(chunk_files))
            assert torch.equal(out, data)

        raw = root / "raw.bin"
        arr = data.numpy()

        def raw_write() -> None:
            with open(raw, "wb") as f:
                arr.tofile(f)
                f.flush()
                os.fsync(f.fileno())

        def raw_read() -> None:
            with open(raw, "rb") as f:
                f.readinto(memoryview(out.numpy()).cast("B"))

        r_write = _timed(raw_write, a.repeats)
        r_read = _timed(raw_read, a.repeats)
        r_cold = _timed(raw_read, a.repeats, before=lambda: _evict([raw]))
    finally:
        shutil.rmtree(root / "store", ignore_errors=True)
        (root / "raw.bin").unlink(missing_ok=True)
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)

    def gbs(ts: list[float]) -> float:
        return nbytes / median(ts) / 1e9

    record = {
        "size_bytes": nbytes,
        "chunks": info.n_chunks,
        "chunk_bytes": info.chunk_rows * 4,
        "io_threads": a.threads,
        "repeats": a.repeats,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "store_write_fsync_GBps": gbs(t_write),
        "store_read_warm_GBps": gbs(t_read),
        "store_read_cold_GBps": gbs(t_cold),
        "raw_write_fsync_GBps": gbs(r_write),
        "raw_read_warm_GBps": gbs(r_read),
        "raw_read_cold_GBps": gbs(r_cold),
        "seconds": {"store_write": t_write, "store_read_warm": t_read, "store_read_cold": t_cold,
                    "raw_write": r_write, "raw_read_warm": r_read, "raw_read_cold": r_cold},
    }  # fmt: skip
    path = write_record("bench_store", record)
    print(f"{a.size_mb} MiB fp32 in {info.n_chunks} chunks of {info.chunk_rows * 4 / 2**20:.0f} MiB, {a.threads} I/O threads, "
          f"median of {a.repeats}; {record['cpu_count']} CPUs ({record['cpu_model']})")  # fmt: skip
    print(f"  write + fsync       : store {gbs(t_write):6.2f} GB/s   raw tofile+fsync {gbs(r_write):6.2f} GB/s")
    print(f"  read, page cache    : store {gbs(t_read):6.2f} GB/s   raw readinto     {gbs(r_read):6.2f} GB/s")
    print(f"  read, evicted cache : store {gbs(t_cold):6.2f} GB/s   raw readinto     {gbs(r_cold):6.2f} GB/s")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
