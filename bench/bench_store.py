"""Store throughput: checked, fsynced writes and parallel reads into a preallocated buffer.

Writes a 1-D fp32 array of --size-mb to a local store (CRC32C per chunk, fsync per chunk), then
reads it back into one reused buffer with the store's I/O threads (page cache warm, as when the
state was just written; cold reads need root to drop caches). Compares with the raw ceiling of
the same disk: a plain numpy tofile + fsync and a plain read into a buffer. Medians over repeats.

    python bench/bench_store.py --size-mb 256 --threads 4 --dir /tmp/bench-store
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, write_record  # noqa: E402

from mtc.store import TensorStore  # noqa: E402


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    """Measure and write the record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", help="directory for the test store (default: a temp dir)")
    a = ap.parse_args()

    root = Path(a.dir or tempfile.mkdtemp(prefix="mtc-bench-store-"))
    shutil.rmtree(root / "store", ignore_errors=True)
    n = a.size_mb * 2**20 // 4
    data = torch.randn(n)
    out = torch.empty(n)
    nbytes = n * 4
    with TensorStore.create(root / "store", io_threads=a.threads) as st:
        st.create_array("x", (n,), torch.float32)
        t_write = _timed(lambda: st.write("x", data), a.repeats)
        t_read = _timed(lambda: st.read_into("x", out), a.repeats)
        assert torch.equal(out, data)
        chunks = st.array_info("x").n_chunks

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
    shutil.rmtree(root, ignore_errors=True)

    gbs = lambda ts: nbytes / median(ts) / 1e9  # noqa: E731
    record = {
        "size_bytes": nbytes, "chunks": chunks, "io_threads": a.threads, "repeats": a.repeats,
        "store_write_GBps": gbs(t_write), "store_read_warm_GBps": gbs(t_read),
        "raw_write_fsync_GBps": gbs(r_write), "raw_read_warm_GBps": gbs(r_read),
        "store_write_s": t_write, "store_read_s": t_read, "raw_write_s": r_write, "raw_read_s": r_read,
    }
    path = write_record("bench_store", record)
    print(f"{a.size_mb} MiB in {chunks} chunks, {a.threads} I/O threads, median of {a.repeats}")
    print(f"  write (CRC32C, fsync): store {gbs(t_write):6.2f} GB/s   raw tofile+fsync {gbs(r_write):6.2f} GB/s")
    print(f"  read into buffer     : store {gbs(t_read):6.2f} GB/s   raw readinto     {gbs(r_read):6.2f} GB/s  (page cache warm)")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
