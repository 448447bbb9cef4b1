"""The launch-configuration tuner: fastest candidate wins, failures are skipped, results cached;
decisions are recorded as JSON and a tuner seeded with them times nothing for their keys."""

from __future__ import annotations

import json

import pytest
import torch
from mtc.kernels.tuning import Decisions, Tuner, tuning_input

from mtc.errors import KernelInputError, PlanError


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


def _timed_tuner(times: dict[str, float], launched: list[str]) -> Tuner:
    return Tuner("t", bench=lambda fn: (fn(), times[launched[-1]])[1])


def test_recorded_decisions_round_trip_and_seed_without_timing():
    # a compile-time process times, records and stores (JSON) ...
    launched: list[str] = []
    tuner = _timed_tuner({"a": 3.0, "b": 1.0}, launched)
    with tuner.recording() as rec:
        assert tuner.choose(("fwd", 64, True), ["a", "b"], launched.append) == "b"
        assert tuner.choose(("dq", 64, True), ["only"], launched.append) == "only"
    assert rec.choices == {"fwd/64/True": "b", "dq/64/True": "only"} and tuner.seconds > 0
    doc = json.loads(json.dumps(rec.to_json()))
    # ... a later process seeds a fresh tuner: the recorded choice comes back and nothing is timed
    spied: list[object] = []
    fresh = Tuner("t", bench=lambda fn: spied.append(fn) or 1.0)
    fresh.seed(Decisions.from_json(doc))
    with fresh.recording() as again:
        assert fresh.choose(("fwd", 64, True), ["a", "b"], launched.append) == "b"
    assert spied == [] and fresh.seconds == 0 and again.choices == {"fwd/64/True": "b"}
    assert fresh.recall(("fwd", 64, True), ["a", "b"]) == "b"
    # another shape is another key: timed
    fresh.choose(("fwd", 128, True), ["a", "b"], launched.append)
    assert len(spied) == 2 and fresh.seconds > 0


def test_a_recorded_choice_that_is_no_candidate_is_timed_again():
    spied: list[object] = []
    tuner = Tuner("t", bench=lambda fn: spied.append(fn) or float(len(spied)))
    tuner.seed(Decisions({"k": {"BLOCK_M": 256}}))  # e.g. a tile list that no longer offers it
    assert tuner.recall("k", [{"BLOCK_M": 64}, {"BLOCK_M": 128}]) is None
    assert tuner.choose("k", [{"BLOCK_M": 64}, {"BLOCK_M": 128}], lambda c: None) == {"BLOCK_M": 64}
    assert len(spied) == 2


@pytest.mark.parametrize("doc", [None, {"choices": {}}, {"format": "mtc-tuning", "choices": []}, "x"])
def test_malformed_decisions_are_a_plan_error(doc):
    with pytest.raises(PlanError, match="recompile the plan"):
        Decisions.from_json(doc)


def test_tuning_inputs_keep_the_layout_and_leave_the_users_random_stream_alone():
    # a plan compiled mid-run must not shift the run's dropout or sampling
    meta = torch.empty(6, 4, device="meta").t()  # a transposed weight: its strides matter for timing
    torch.manual_seed(1)
    want = torch.rand(5)
    torch.manual_seed(1)
    x = tuning_input(meta, torch.device("cpu"))
    ids = tuning_input(torch.empty(3, dtype=torch.long, device="meta"), torch.device("cpu"))
    assert torch.equal(torch.rand(5), want)
    assert x.shape == (4, 6) and x.stride() == meta.stride() and x.std() > 0.3
    assert ids.dtype == torch.long and not ids.any()
    wide = tuning_input(torch.empty(3, 1, device="meta").expand(3, 5), torch.device("cpu"))  # an expanded value
    assert wide.stride() == (1, 0) and torch.equal(wide[:, 0], wide[:, 4])
    assert tuning_input(torch.empty(0, 4, device="meta"), torch.device("cpu")).shape == (0, 4)


def test_a_choice_is_recalled_only_while_it_is_among_the_candidates():
    # a choice made for one candidate list (the CPU's launch configurations, say) is not handed to
    # a caller offering others (a GPU's): it times its own
    t = Tuner("t", bench=lambda fn: (fn(), 1.0)[1])
    assert t.choose("k", [{"a": 1}, {"a": 2}], lambda c: None) == {"a": 1}
    assert t.recall("k", [{"a": 1}, {"a": 3}]) == {"a": 1}
    assert t.recall("k", [{"a": 3}, {"a": 4}]) is None
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:  # fp8 has no normal_ of its own
        x = tuning_input(torch.empty(4, 3, dtype=fp8, device="meta"), torch.device("cpu"))
        assert x.dtype == fp8 and x.float().abs().sum() > 0
