"""Fixtures the data-parallel test files share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def program():
    """The tiny model of the data-parallel tests (`test_data_parallel._config`), traced."""
    from mtc.tracer import trace
    from mtc.train import build_model
    from tests.mtc.test_data_parallel import _config

    cfg = _config()
    return trace(build_model(cfg), cfg.micro_batch_size, cfg.seq_len)
