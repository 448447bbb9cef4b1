"""The batch loader: it samples ahead on its own thread and, for a CUDA run, hands each step its
micro-batches in page-locked buffers it allocated once (no pinned allocation per step)."""

from __future__ import annotations

import threading
import time

import torch

from mtc.train import _Loader


class _Counting:
    """A sampler whose batch ``c`` is filled with ``c``; it records who asked, and when."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, str]] = []

    def batch(self, cursor: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.asked.append((cursor, threading.current_thread().name))
        return torch.full((2, 8), cursor, dtype=torch.int64), torch.full((2, 8), cursor + 1, dtype=torch.int64)


def _wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.005)
    return False


def test_the_loader_samples_ahead_on_its_own_thread():
    s = _Counting()
    loader = _Loader(s, grad_accum=2, start=10, pin=False)
    try:
        first = loader.next()
        assert [int(i[0, 0]) for i, _ in first] == [10, 11]
        # before the consumer asks again, the next steps' micro-batches are already drawn
        assert _wait_for(lambda: max(c for c, _ in s.asked) >= 13), s.asked
        assert {name for _, name in s.asked} == {"mtc-loader"}
    finally:
        loader.close()


def test_pinned_batches_reuse_a_fixed_set_of_buffers_and_keep_each_steps_values():
    s = _Counting()
    loader = _Loader(s, grad_accum=2, start=0, pin=True)
    try:
        ptrs = set()
        for step in range(12):
            mbs = loader.next()
            # the step's values stay intact while the loader runs ahead as far as it goes: it has
            # drawn step + 3's micro-batches (and copied them into their set) and waits on the queue
            assert _wait_for(lambda: max(c for c, _ in s.asked) >= 2 * (step + 3) + 1)
            time.sleep(0.01)
            for j, (ids, targets) in enumerate(mbs):
                assert (ids == 2 * step + j).all() and (targets == 2 * step + j + 1).all(), f"step {step}"
            ptrs.update(t.data_ptr() for pair in mbs for t in pair)
        assert len(ptrs) == 4 * _Loader.PINNED_SETS  # 2 micro-batches x (ids, targets) per set
        assert loader.pinned_allocations == 4 * _Loader.PINNED_SETS
    finally:
        loader.close()


def test_a_batch_of_another_shape_gets_buffers_of_its_own():
    class Odd(_Counting):
        def batch(self, cursor):
            ids, t = super().batch(cursor)
            return (ids[:1], t[:1]) if cursor == 5 else (ids, t)

    loader = _Loader(Odd(), grad_accum=1, start=0, pin=True)
    try:
        shapes = [tuple(loader.next()[0][0].shape) for _ in range(8)]
        assert shapes == [(2, 8)] * 5 + [(1, 8)] + [(2, 8)] * 2
    finally:
        loader.close()
