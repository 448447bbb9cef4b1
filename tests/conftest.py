"""Test setup: Triton's interpreter without CUDA (before any kernel import), seeds, the gpu marker."""

from __future__ import annotations

import os
import random

import pytest

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

if torch is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
