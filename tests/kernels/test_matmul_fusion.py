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
FUSED_PRE = "mtc.fused_mm_pre.default"


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


@functools.cache
def _gpt2_joint():
    return joint_graph(_block("gpt2-tiny")[2])[0]


def _fused_calls(graph, *which):
    return [n for n in graph.nodes if str(n.target) in (which or (FUSED, FUSED_PRE))]


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
    # the gated SiLU is read only by the gating multiply's generated kernel, which computes it on
    # the fly: the gate matmul keeps it out (absorbing it would only add a write)
    assert not any(s.act != "none" or s.pre is not None for s in fwd + joint)
    normalised = {s.prologue.xn for s in joint if s.prologue}
    assert len(fuse_matmuls(jg, "on")) == sum(1 for s in joint if s.prologue or s.act != "none" or s.residual)
    assert not normalised & set(jg.nodes)  # fused away: nothing computes the normalised tensors any more
    # o and down take the block's residual; backward matmuls take the add that sums two gradient parts
    assert sum(s.residual is not None for s in joint) >= 2


@pytest.mark.parametrize("name", ["gpt2-tiny", pytest.param("tiny", marks=pytest.mark.slow)])
def test_forced_fusion_matches_aten_and_cuts_launches(name, tmp_path):
    model, prog, t = _block(name)
    # the joint graph with the block's output, whose last matmul has a residual-add epilogue site
    ct = check_compiled(prog, dict(model.named_parameters()), prog.layers[1], tmp_path / "on", matmul_fusion="on",
                        joint_outputs=True)
    assert _fused_calls(ct.forward_graph) and _fused_calls(ct.joint_graph)
    # GPT-2's c_fc + GELU in the joint graph: one kernel writes the pre-activation (the backward
    # reads it) and the GELU (c_proj reads it); the gradients above match ATen through it
    assert len(_fused_calls(ct.joint_graph, FUSED_PRE)) == (name == "gpt2-tiny")
    if name == "tiny":  # the launch proxy needs a second compile: only in the slow case
        off = compile_template(t, tmp_path / "off", matmul_fusion="off", joint_outputs=True)
        assert not _fused_calls(off.forward_graph)
        assert launches(ct.forward_graph) < launches(off.forward_graph)
        # the joint: the residual add the epilogue takes is, without it, a pointwise kernel that
        # the RMSNorm weight-gradient kernel takes in (a sibling over a shared input): a tie
        assert launches(ct.joint_graph) <= launches(off.joint_graph)
    # a stored plan keeps the fused matmuls (op name, None and string arguments round-trip)
    loaded = compiler._load_record(json.loads(json.dumps(compiler._record(ct, {}))), tmp_path / "on" / compiler.cache_key())
    assert len(_fused_calls(loaded.forward_graph)) == len(_fused_calls(ct.forward_graph))
    def calls(g):  # every call with its arguments, fused kernels by name (running them is slow here)
        return [(getattr(n.target, "__name__", str(n.target)), [str(a) for a in n.args]) for n in g.nodes]

    assert calls(loaded.joint_graph) == calls(ct.joint_graph)  # mtc::fused_mm_pre and its outputs included


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
    stored = json.loads((tmp_path / "a" / CHOICES).read_text())["choices"]
    assert set(stored) == {s.key() for s in sites}
    assert all(r["fused_ms"] == 1.0 and r["unfused_ms"] == 2.0 and r["fused"] and r["rel_err"] < 1e-5 for r in stored.values())

    def never(fn):
        raise AssertionError("a cached choice was timed again")

    assert all(Choices(tmp_path / "a", bench=never).fused(s, cpu) for s in sites)
    # the stamp (the compiler's toolchain key: kernel-source hash, torch, triton, device) keeps
    # stale timings out: another stamp times every site again (the unfused side wins this time)
    site = sites[0]
    stamped = Choices(tmp_path / "c", bench=clock("fused"), stamp={"kernel sources": "0123"})
    assert stamped.fused(site, cpu) and stamped.seconds > 0
    assert not Choices(tmp_path / "c", bench=clock("unfused"), stamp={"kernel sources": "4567"}).fused(site, cpu)
    assert json.loads((tmp_path / "c" / CHOICES).read_text())["stamp"] == {"kernel sources": "4567"}
    again = Choices(tmp_path / "c", bench=never, stamp={"kernel sources": "4567"})
    assert not again.fused(site, cpu) and again.seconds == 0 and again.asked == {site.key()}
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


def test_pre_activation_site_in_the_gpt2_joint_graph(tmp_path):
    g = copy.deepcopy(_gpt2_joint()).graph
    sites = [s for s in find_sites(g) if s.pre is not None]
    # c_fc + tanh-GELU; its product also feeds the GELU's derivative in the backward
    assert [(s.act, s.bias is not None, s.residual is None) for s in sites] == [("gelu_tanh", True, True)]
    assert sites[0].key().endswith(" pre=True") and len(sites[0].pre.users) > 1
    # the timing choice runs both sides for such a site: the fused kernel (both outputs checked
    # against the reference) and cuBLAS + the separate activation; cuBLAS winning keeps the GELU
    cpu = torch.device("cpu")
    slow = Choices(tmp_path, bench=lambda fn: 1.0 if fn.__name__ == "unfused" else 2.0)
    assert not slow.fused(sites[0], cpu)
    assert slow.known[sites[0].key()]["rel_err"] < 1e-5 and slow.known[sites[0].key()]["fused_ms"] == 2.0
    assert all(s.pre is None for s in find_sites(_gpt2_fwd_graph()))  # inference forward: nothing else reads it
    fuse_matmuls(g, "on")
    (call,) = _fused_calls(g, FUSED_PRE)
    assert not any(str(n.target) == "aten.gelu.default" for n in g.nodes)
    pre, post = sorted(call.users, key=lambda n: n.args[1])

    def readers(n):  # the ops reading n, seen through views
        return {r for u in n.users for r in (readers(u) if str(u.target).startswith("aten.view") else [u])}

    # c_proj (fused with its residual) and its weight gradient
    assert {str(r.target) for r in readers(post)} == {FUSED, "aten.mm.default"}
    assert {str(r.target) for r in readers(pre)} <= {"aten.mul.Tensor", "aten.add.Tensor"}  # GELU's derivative


def _traced(fn, *shapes):
    from torch.fx.experimental.proxy_tensor import make_fx

    xs = [torch.randn(*s) for s in shapes]
    return make_fx(fn, tracing_mode="fake")(*xs), xs


def _sig_mlp(x, w1, w2, r):
    h = torch.mm(x, w1)
    a = h * torch.sigmoid(h)  # SiLU as lowering writes it
    return torch.mm(a, w2), h * 2.0


def _res_before(x, w1, w2, r):
    r2 = r * 3.0  # computed before the product: the fused op can take it
    h = torch.mm(x, w1)
    y = torch.nn.functional.gelu(h) + r2
    return torch.mm(y, w2), h.sum(0)


def _res_after(x, w1, w2, r):
    h = torch.mm(x, w1)
    # the "residual" depends on the product itself: not taken (the fused op would need its own
    # output), and then the GELU, read only by the add's generated kernel, stays out too
    y = torch.nn.functional.gelu(h) + h * r
    return torch.mm(y, w2), h - 1.0


def _pointwise_only(x, w1, w2, r):
    h = torch.mm(x, w1)
    return torch.nn.functional.gelu(h) * r, h + 1.0  # the GELU feeds only a generated kernel


@pytest.mark.parametrize("fn,act,residual", [(_sig_mlp, "silu", False), (_res_before, "gelu", True),
                                             (_res_after, "none", False), (_pointwise_only, "none", False)])
def test_pre_sites_in_small_graphs_keep_their_values(fn, act, residual):
    gm, xs = _traced(fn, (6, 5), (5, 7), (7, 3), (6, 7))
    want = gm(*xs)
    site = find_sites(gm.graph)[0]  # the first matmul (a second one reads its activation)
    assert (site.act, site.residual is not None, site.pre is not None) == (act, residual, act != "none")
    fuse_matmuls(gm.graph, "on")
    gm.recompile()
    assert len(_fused_calls(gm.graph, FUSED_PRE)) == (act != "none")
    for a, b in zip(gm(*xs), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_baseline_that_fails_to_time_keeps_cublas_and_the_compile_going(tmp_path):
    # cuBLAS's own run at a site may fail (out of memory at a large site): the site keeps its
    # matmul, says so, and the pass goes on (it used to abort the whole compile)
    site = find_sites(_gpt2_fwd_graph())[0]

    def bench(fn):
        if fn.__name__ == "unfused":
            raise torch.OutOfMemoryError("no room for the baseline")
        return 1.0

    choices = Choices(tmp_path, bench=bench)
    with pytest.warns(UserWarning, match="failed to time"):
        assert not choices.fused(site, torch.device("cpu"))
    assert choices.known[site.key()]["unfused_ms"] is None and choices.known[site.key()]["fused_ms"] == 1.0
