"""The launch-configuration tuner: fastest candidate wins, failures are skipped, results cached."""

from __future__ import annotations

import pytest
from mtc.kernels.tuning import Tuner

from mtc.errors import KernelInputError


def test_fastest_wins_and_is_remembered():
    times = {"a": 3.0, "b": 1.0, "c": 2.0}
    launched = []
    tuner = Tuner("t", bench=lambda fn: (fn(), times[launched[-1]])[1])
    assert tuner.choose("k", ["a", "b", "c"], launched.append) == "b"
    assert launched == ["a", "b", "c"]
    assert tuner.choose("k", ["a", "b", "c"], launched.append) == "b"
    assert launched == ["a", "b", "c"], "a chosen key is not timed again"
    assert [c for c, _ in tuner.timings["k"]] == ["a", "b", "c"]


def test_single_candidate_is_not_timed():
    tuner = Tuner("t", bench=lambda fn: pytest.fail("timed"))
    assert tuner.choose("k", ["only"], lambda c: None) == "only"


def test_failing_candidates_are_skipped_and_all_failing_is_an_error():
    def launch(c):
        if c != "ok":
            raise RuntimeError(f"{c} needs too much shared memory")

    tuner = Tuner("t", bench=lambda fn: (fn(), 1.0)[1])
    assert tuner.choose("k", ["big", "ok"], launch) == "ok"
    with pytest.raises(KernelInputError, match="no launch configuration works") as e:
        tuner.choose("k2", ["big", "huge"], launch)
    assert "big needs too much" in str(e.value)
