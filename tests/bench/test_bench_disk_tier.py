"""bench/bench_disk_tier.py keeps what it measured when its training run is cut off."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_disks_figures_are_on_record_before_the_training_run(tmp_path, monkeypatch):
    # gpu_session.sh's timeout ends a part with TERM: the throughput trials (a minute or two of a
    # GPU session) were written only with the training run's figures at the very end, so a run cut
    # during training left no record at all
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_disk_tier

    def killed(*a, **k):
        raise KeyboardInterrupt  # stands in for the TERM that ends the process there

    monkeypatch.setattr(bench_disk_tier, "_run_child", killed)
    monkeypatch.setenv("BENCH_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setattr(sys, "argv", ["bench_disk_tier.py", "--smoke", "--dir", str(tmp_path / "disk"),
                                      "--disk-bytes", "4e6", "--disk-trials", "1"])
    with pytest.raises(KeyboardInterrupt):
        bench_disk_tier.main()
    (rec,) = [json.loads(p.read_text()) for p in (tmp_path / "results").glob("bench_disk_tier-*.json")]
    assert rec["disk"]["raw_median"]["mix"] > 0 and rec["disk"]["store_median"]["mix"] > 0
    assert rec["params"] > 0 and "pending" in rec["train"]
