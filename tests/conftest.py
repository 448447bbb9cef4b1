"""Test setup: Triton's interpreter without CUDA (before any kernel import), seeds, the gpu marker."""

from __future__ import annotations

import os
import random

import pytest

# One intra-op thread per test process (and, through the environment, per CLI or torchrun process
# a test starts), unless the caller says otherwise: `./run test` runs one xdist worker per core,
# and each worker's torch with an OpenMP thread per core oversubscribes the cores; OpenMP's
# threads spin at their barriers while the other worker's want the core. Measured on the 2-core VM
# (2026-11-29, idle): tests/runtime/test_{parity,engine,timeline}.py with two workers, 305 s wall
# and 335 s CPU with two threads each, 126 s and 198 s with one; the whole `./run test`, 1025 s +
# 106 s (the `alone` part) with two, 963 s + 60 s with one. The code under test still sets its own
# thread counts where it chooses them (the host AdamW's pool, calibration, data-parallel ranks).
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

if torch is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if torch is not None and os.environ["OMP_NUM_THREADS"].isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # (a plugin may have imported torch first)


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    if torch is not None:
        torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _cpu_unless_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that names no device picks CUDA where there is one (`mtc.config.auto_device`); the
    CPU tests assert the CPU's behaviour, so on a GPU machine they keep it (gpu tests name cuda)."""
    if "gpu" in request.keywords or torch is None or not torch.cuda.is_available():
        return
    import mtc.api
    import mtc.config

    for mod in (mtc.config, mtc.api):
        monkeypatch.setattr(mod, "auto_device", lambda: "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch is not None and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
