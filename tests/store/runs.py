"""A tiny committed run in a store, as the engine leaves it, for the verify / repair / CLI tests."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from mtc.store import CommitRecord, TensorStore, create_layer_state, state_array_name

NUMELS = [40, 0, 24]  # layer 1 owns no parameter: it has no arrays
CHUNK_ROWS = 16  # 3 chunks for layer 0 (the last one ragged), 2 for layer 2
KINDS = ("master", "m", "v")


def record(step: int, generation: int, durability: str = "full") -> CommitRecord:
    """A commit record of ``step`` whose state is in ``generation``."""
    return CommitRecord(
        step=step, generation=generation, data_cursor=4 * step, rng_state={"torch": "AA=="}, config={"steps": 9, "model": "tiny"},
        time_unix=time.time(), durability=durability, meta={"data": "corpus.bin"},
    )


def write_generation(st: TensorStore, generation: int, *, kinds: tuple[str, ...] = KINDS, zero_moments: bool = False) -> None:
    """Write the state of every layer in ``generation`` (m and v all-zero if ``zero_moments``: fresh Adam state)."""
    for layer, n in enumerate(NUMELS):
        if n == 0:
            continue
        for kind in kinds:
            t = torch.zeros(n) if zero_moments and kind != "master" else torch.randn(n)
            st.write(state_array_name(layer, kind, generation), t)


def make_run(path: Path | None, steps: int = 2, durability: str = "full") -> TensorStore:
    """A store with commits 0..steps-1 (step s in generation s % 2), left open; step 0 has fresh (zero) moments."""
    st = TensorStore.create(path, io_threads=2)
    for layer, n in enumerate(NUMELS):
        for g in (0, 1):
            for kind in KINDS:
                if n:
                    st.create_array(state_array_name(layer, kind, g), (n,), torch.float32, chunk_rows=CHUNK_ROWS)
    create_layer_state(st, NUMELS)  # records the layout; the arrays exist already
    kinds = {"full": KINDS, "weights": ("master",), "none": ()}[durability]
    for step in range(steps):
        write_generation(st, step % 2, kinds=kinds if step else KINDS, zero_moments=step == 0)
        st.commit(record(step, step % 2, durability))
    return st


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every file and directory under ``root``: (mtime_ns, size, content of small files)."""
    out = {}
    for p in sorted([root, *root.rglob("*")]):
        st = p.lstat()
        small = p.read_bytes() if p.is_file() and st.st_size < 4096 else None
        out[str(p.relative_to(root))] = (st.st_mtime_ns, st.st_size, small)
    return out
