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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch is not None and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
