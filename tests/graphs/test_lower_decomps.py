"""Lowering's decomposition table: built once per process, again when an operator is registered."""

from __future__ import annotations

import torch

from mtc.graphs import lower


def test_the_table_is_built_once_and_again_after_a_new_operator(monkeypatch):
    builds = []
    real = lower._build_decomps

    def counting():  # noqa: ANN202
        builds.append(1)
        return real()

    monkeypatch.setattr(lower, "_build_decomps", counting)
    monkeypatch.setattr(lower, "_DECOMPS", None)
    first = lower._decomps()
    second = lower._decomps()
    assert len(builds) == 1, "torch's core ATen table was built again for the second lowering"
    assert first == second and first is not second  # each caller owns its copy
    first.clear()
    assert lower._decomps() == second
    # a library imported between traces may register a composite op the table must see
    lib = torch.library.Library("mtc_test_decomps", "DEF")  # noqa: TOR901 (kept alive below)
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
    third = lower._decomps()
    assert len(builds) == 2
    assert torch.ops.mtc_test_decomps.twice.default in third
    del lib
