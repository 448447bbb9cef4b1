"""Import and export of a >= 1 GB checkpoint stay within 2x the largest layer's fp32 size + 200 MB of RSS."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_import_and_export_of_a_1gb_checkpoint_hold_about_one_layer(tmp_path):
    from bench_hf_rss import run

    res = run(tmp_path / "w", 1.0)
    assert res["checkpoint_bytes"] >= 10**9
    for name in ("import", "export"):
        assert res[name]["peak_increase_bytes"] < res["bound_bytes"], (name, res)
