"""Matmul prologue / epilogue fusion: which sites the pass finds in real blocks, that forced fusion
keeps compiled blocks equal to ATen (fp32, interpreter), and the per-shape timing choice."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from mtc.graphs.lower import forward_graph, joint_graph
from mtc.kernels.matmul_fusion import CHOICES, Choices, find_sites, fuse_matmuls

from mtc import compiler
from mtc.compiler import compile_template, launches
from mtc.models import build
from mtc.tracer import trace
from tests.graphs.compiled import check_compiled

FUSED = "mtc.fused_mm.default"


def _block(name):
    torch.manual_seed(0)
    model = build(name, n_layers=1)
    prog = trace(model, 2, 8)
    return model, prog, prog.templates[prog.layers[1].template]


@functools.cache
def _gpt2_forward():
    """The gpt2-tiny block's lowered forward graph, lowered once for this module (lowering is slow)."""
    return forward_graph(_block("gpt2-tiny")[2])


def _gpt2_fwd_graph():
    """A fresh copy of it (the passes rewrite graphs in place)."""
    return copy.deepcopy(_gpt2_forward()).graph


def _fused_calls(graph):
    return [n for n in graph.nodes if str(n.target) == FUSED]


def test_sites_in_gpt2_and_llama_blocks():
    sites = {s.mm.name: s for s in find_sites(_gpt2_fwd_graph())}
    # ln_1 -> c_attn (prologue, bias); c_proj + residual; ln_2 -> c_fc + gelu(tanh); mlp c_proj + residual
    described = sorted((s.prologue is not None, s.bias is not None, s.act, s.residual is not None) for s in sites.values())
    assert described == [(False, True, "none", True), (False, True, "none", True),
                         (True, True, "gelu_tanh", False), (True, True, "none", False)]
    _, _, t = _block("tiny")
    fwd = find_sites(forward_graph(t).graph)
    # RMSNorm feeds q, k, v (all three take the prologue) and gate, up; o and down take the residual
    assert sum(s.prologue is not None for s in fwd) == 5
    assert sum(s.residual is not None for s in fwd) == 2
    # in the joint graph the normalised input also feeds the weight gradients dy^T @ xn: they take
    # it as a B-operand prologue, so the normalised tensor is never written there either
    jg = joint_graph(t)[0].graph
    joint = find_sites(jg)
    assert sorted(s.prologue_on for s in joint if s.prologue) == ["a"] * 5 + ["b"] * 5
    normalised = {s.prologue.xn for s in joint if s.prologue}
    assert len(fuse_matmuls(jg, "on")) == sum(1 for s in joint if s.prologue or s.act != "none" or s.residual)
    assert not normalised & set(jg.nodes)  # fused away: nothing computes the normalised tensors any more
    # o and down take the block's residual; backward matmuls take the add that sums two gradient parts
    assert sum(s.residual is not None for s in joint) >= 2


@pytest.mark.parametrize("name", ["gpt2-tiny", pytest.param("tiny", marks=pytest.mark.slow)])
def test_forced_fusion_matches_aten_and_cuts_launches(name, tmp_path):
    model, prog, t = _block(name)
    ct = check_compiled(prog, dict(model.named_parameters()), prog.layers[1], tmp_path / "on", matmul_fusion="on")
    assert _fused_calls(ct.forward_graph) and _fused_calls(ct.joint_graph)
    if name == "tiny":  # the launch proxy needs a second compile: only in the slow case
        off = compile_template(t, tmp_path / "off", matmul_fusion="off")
        assert not _fused_calls(off.forward_graph)
        assert launches(ct.forward_graph) < launches(off.forward_graph)
        assert launches(ct.joint_graph) < launches(off.joint_graph)
    # a stored plan keeps the fused matmuls (op name, None and string arguments round-trip)
    loaded = compiler._load_record(json.loads(json.dumps(compiler._record(ct, {}))), tmp_path / "on" / compiler.cache_key())
    assert len(_fused_calls(loaded.forward_graph)) == len(_fused_calls(ct.forward_graph))


def test_auto_fuses_nothing_on_the_cpu(tmp_path):
    g = _gpt2_fwd_graph()
    assert fuse_matmuls(g, "auto", tmp_path, device=torch.device("cpu")) == []
    assert not _fused_calls(g)
    with pytest.raises(ValueError, match="mode"):
        fuse_matmuls(g, "always")


def test_timing_choice_per_shape_is_kept_in_the_cache(tmp_path):
    sites = [s for s in find_sites(_gpt2_fwd_graph()) if s.act != "none" or s.residual is not None or s.prologue]
    cpu = torch.device("cpu")

    def clock(winner):
        def bench(fn):
            fn()  # both launches run (the fused one in the interpreter)
            return 1.0 if fn.__name__ == winner else 2.0
        return bench

    fast = Choices(tmp_path / "a", bench=clock("fused"))
    assert all(fast.fused(s, cpu) for s in sites)
    slow = Choices(tmp_path / "b", bench=clock("unfused"))
    assert not any(slow.fused(s, cpu) for s in sites)
    stored = json.loads((tmp_path / "a" / CHOICES).read_text())
    assert set(stored) == {s.key() for s in sites}
    assert all(r["fused_ms"] == 1.0 and r["unfused_ms"] == 2.0 and r["fused"] and r["rel_err"] < 1e-5 for r in stored.values())

    def never(fn):
        raise AssertionError("a cached choice was timed again")

    assert all(Choices(tmp_path / "a", bench=never).fused(s, cpu) for s in sites)
    # the pass follows the choices: cuBLAS wins everywhere -> the graph keeps its matmuls
    g = _gpt2_fwd_graph()
    assert fuse_matmuls(g, "auto", device=cpu, choices=Choices(tmp_path / "b", bench=clock("unfused"))) == []
    assert not _fused_calls(g)
    # ... and where the fused kernel wins, it takes the site
    assert len(fuse_matmuls(g, "auto", device=cpu, choices=Choices(tmp_path / "a", bench=never))) == len(sites)
    assert len(_fused_calls(g)) == len(sites)


def test_half_precision_norms_match_with_their_casts():
    # bf16 (meta: nothing runs): LayerNorm computes in fp32 and casts its result; the prologue reads
    # the bf16 input itself and RMSNorm's cast before the weight becomes round_norm
    for name, norm in (("gpt2-tiny", "layer"), ("tiny", "rms+round")):
        with torch.device("meta"):
            model = build(name, n_layers=1).to(torch.bfloat16)
        prog = trace(model, 2, 8)
        t = prog.templates[prog.layers[1].template]
        pro = [s for s in find_sites(forward_graph(t).graph) if s.prologue is not None]
        assert pro and all(f"norm={norm} " in s.key() for s in pro)
        assert all(s.prologue.x.meta["val"].dtype == torch.bfloat16 for s in pro)


def test_a_fused_kernel_that_disagrees_keeps_cublas(tmp_path, monkeypatch):
    from mtc.kernels import matmul_fusion

    site = next(s for s in find_sites(_gpt2_fwd_graph()) if s.act != "none")
    fused, unfused, reference = matmul_fusion._site_runs(site, torch.device("cpu"))
    monkeypatch.setattr(matmul_fusion, "_site_runs", lambda s, d: (lambda: fused() + 1.0, unfused, reference))
    choices = Choices(tmp_path, bench=lambda fn: 1.0 if fn.__name__ == "<lambda>" else 2.0)
    with pytest.warns(UserWarning, match="disagrees with its reference"):
        assert not choices.fused(site, torch.device("cpu"))
    assert choices.known[site.key()]["fused_ms"] is None and choices.known[site.key()]["rel_err"] > 1e-2
