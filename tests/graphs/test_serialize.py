"""Plan directories: a Program survives JSON and runs identically after loading."""

from __future__ import annotations

import json

import pytest
import torch

from mtc.errors import PlanError
from mtc.models.llama import Llama, preset
from mtc.plan import load_plan, save_plan
from mtc.tracer import trace
from tests.graphs.test_trace import run_program


def test_plan_round_trip(tmp_path):
    torch.manual_seed(0)
    model = Llama(preset("tiny", n_layers=2))
    prog = trace(model, 2, 8)
    save_plan(prog, tmp_path / "plan")
    back = load_plan(tmp_path / "plan")
    assert [c.template for c in back.layers] == [c.template for c in prog.layers]
    assert back.params == prog.params
    assert back.batch == prog.batch and back.carry == prog.carry and back.aux == prog.aux
    for tid, t in prog.templates.items():
        assert back.templates[tid].count_ops() == t.count_ops()
    ids = torch.randint(0, 256, (2, 8))
    params = dict(model.named_parameters())
    assert torch.equal(run_program(back, params, ids, ids), run_program(prog, params, ids, ids))


def test_plan_errors(tmp_path):
    with pytest.raises(PlanError, match="not a plan directory"):
        load_plan(tmp_path)
    (tmp_path / "program.json").write_text(json.dumps({"format": "mtc-program", "version": 99}))
    with pytest.raises(PlanError, match="version"):
        load_plan(tmp_path)


def test_unknown_op_is_reported(tmp_path):
    torch.manual_seed(0)
    prog = trace(Llama(preset("tiny", n_layers=1)), 1, 4)
    save_plan(prog, tmp_path)
    doc = json.loads((tmp_path / "program.json").read_text())
    doc["templates"][0]["nodes"][0]["target"] = "aten.no_such_op.default"
    (tmp_path / "program.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="no_such_op"):
        load_plan(tmp_path)
