"""Last-dim cats and column reductions are fused: compiled Llama and GPT-2 blocks keep neither on
ATen, and their outputs and gradients still match the unfused ATen template."""

from __future__ import annotations

import pytest
import torch

from mtc.models import build
from mtc.tracer import trace
from tests.graphs.compiled import check_compiled


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny"])
def test_block_fuses_cat_and_column_sums_and_matches_aten(name, tmp_path):
    torch.manual_seed(0)
    model = build(name, n_layers=1)
    prog = trace(model, 2, 8)
    ct = check_compiled(prog, dict(model.named_parameters()), prog.layers[1], tmp_path)
    for rep in (ct.forward_report, ct.backward_report):
        assert not any("cat" in op for op in rep.fallbacks), rep.fallbacks
        assert not rep.not_generated, rep.not_generated
    # weight and bias gradients are column sums; Llama's grouped-KV sums happen inside flash attention
    assert "aten.sum.dim_IntList" not in ct.backward_report.fallbacks, ct.backward_report.fallbacks
