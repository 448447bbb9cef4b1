"""One rank of `mtc train` for tests/mtc/test_dp_disk.py, with a spy on the store's reads.

Run as ``python tests/mtc/dp_disk_rank.py LOG CHUNK mtc-arguments...`` under torchrun's
environment. ``CHUNK`` (> 0) sets the disk tier's chunk (`StateTiers.disk_chunk_numel`), so a tiny
model's disk shards are read and written in several chunks. Every read of a state array is recorded
as ``[store directory, array name, phase]`` (phase ``start`` before the first optimizer step begins,
``step`` after) and written to ``LOG.rank-R.json`` when the process ends; every chunk file written
from memory that is not page-aligned (the store's O_DIRECT then goes through a bounce buffer) as
``[chunk file, phase]`` to ``LOG.rank-R.unaligned.json``.
"""

from __future__ import annotations

import atexit
import json
import os
import sys


def main() -> int:
    """Install the spy, run `mtc` with the remaining arguments, return its exit code."""
    from mtc.store import TensorStore, fastio

    from mtc.cli import main as mtc_main
    from mtc.runtime.optimizer import StreamingAdamW
    from mtc.runtime.tiers import StateTiers

    log, chunk, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if chunk > 0:
        StateTiers.disk_chunk_numel = chunk
    reads: list[list[str]] = []
    phase = ["start"]

    def spy(name: str) -> None:
        orig = getattr(TensorStore, name)

        def wrapped(self: TensorStore, array: str, *a: object, **kw: object) -> object:
            if array.startswith("layers/"):
                reads.append([str(self.path), array, phase[0]])
            return orig(self, array, *a, **kw)

        setattr(TensorStore, name, wrapped)

    for name in ("read", "read_into", "read_into_async", "read_rows_into", "read_rows_into_async"):
        spy(name)
    begin = StreamingAdamW.begin_step

    def begin_step(self: StreamingAdamW, step: int, lr: float) -> None:
        phase[0] = "step"
        begin(self, step, lr)

    StreamingAdamW.begin_step = begin_step
    unaligned: list[list[str]] = []
    write_chunk_file = fastio.write_chunk_file

    def write_spy(path: object, chunk_bytes: int, data: object, **kw: object) -> bool:
        if not fastio.is_aligned(data):
            unaligned.append([str(path), phase[0]])
        return write_chunk_file(path, chunk_bytes, data, **kw)

    fastio.write_chunk_file = write_spy
    TensorStore_module = sys.modules[TensorStore.__module__]
    TensorStore_module.write_chunk_file = write_spy  # (imported by name there)
    rank = os.environ.get("RANK", "0")

    def dump() -> None:
        with open(f"{log}.rank-{rank}.json", "w") as f:
            json.dump(reads, f)
        with open(f"{log}.rank-{rank}.unaligned.json", "w") as f:
            json.dump(unaligned, f)

    atexit.register(dump)
    return mtc_main(argv)


if __name__ == "__main__":
    sys.exit(main())
