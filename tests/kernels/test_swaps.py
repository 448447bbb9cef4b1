"""kernels/swaps.py: which linear + cross-entropy chains become the fused kernel, and which stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mtc.kernels.swaps import use_linear_cross_entropy
from torch import nn


class Head(nn.Module):
    """linear -> logits -> cross-entropy, with the variations the rewrite must tell apart."""

    def __init__(self, upcast=True, bias=False, **ce) -> None:
        super().__init__()
        self.upcast, self.bias, self.ce = upcast, bias, ce

    def forward(self, x, w, b, t):
        logits = F.linear(x, w, b if self.bias else None)
        if self.upcast:
            logits = logits.float()
        return F.cross_entropy(logits.reshape(-1, w.shape[0]), t.reshape(-1), **self.ce)


def _graph(head, dtype=torch.float32):
    x = torch.randn(2, 5, 8, dtype=dtype)
    w = torch.randn(11, 8, dtype=dtype)
    b = torch.randn(11, dtype=dtype)
    t = torch.randint(0, 11, (2, 5))
    t[0, 1] = -100
    gm = torch.export.export(head, (x, w, b, t)).module()
    return gm, (x, w, b, t)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_when_the_loss_is_a_plain_mean(bias):
    head = Head(bias=bias)
    gm, args = _graph(head)
    want = head(*args)
    assert use_linear_cross_entropy(gm) == 1
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("cross_entropy_loss" in s or "linear.default" in s for s in targets), targets
    torch.testing.assert_close(gm(*args), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [{"label_smoothing": 0.1}, {"reduction": "sum"}, {"weight": torch.ones(11)}],
    ids=["smoothing", "sum", "weight"],
)
def test_other_losses_stay_unfused(kwargs):
    gm, args = _graph(Head(**kwargs))
    assert use_linear_cross_entropy(gm) == 0


def test_half_logits_without_upcast_stay_unfused():
    """The fused loss computes in fp32; a model whose loss runs in half precision keeps its own."""
    gm, _ = _graph(Head(upcast=False), dtype=torch.float16)
    assert use_linear_cross_entropy(gm) == 0


def test_float64_head_downcast_to_fp32_logits_stays_unfused():
    """The fused loss takes fp16/bf16/fp32 inputs: a float64 head whose logits are cast to fp32
    was swapped anyway, and the compiled head died in the kernel's input check."""
    gm, args = _graph(Head(), dtype=torch.float64)
    assert use_linear_cross_entropy(gm) == 0
    torch.testing.assert_close(gm(*args), Head()(*args))

def test_logits_used_elsewhere_stay_unfused():
    class TwoUses(Head):
        def forward(self, x, w, b, t):
            logits = F.linear(x, w)
            return F.cross_entropy(logits.float().reshape(-1, 11), t.reshape(-1)) + logits.mean()

    gm, args = _graph(TwoUses())
    assert use_linear_cross_entropy(gm) == 0


class GQABlock(nn.Module):
    """Grouped-query attention whose K/V heads are repeated the Hugging Face way (``repeat_kv``:
    ``x[:, :, None]`` expanded and reshaped) or with ``repeat_interleave``."""

    def __init__(self, dim=32, heads=4, kv_heads=2, hf_style=True) -> None:
        super().__init__()
        self.h, self.kv, self.hd, self.hf_style = heads, kv_heads, dim // heads, hf_style
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def _repeat(self, x):
        rep = self.h // self.kv
        if not self.hf_style:
            return x.repeat_interleave(rep, dim=1)
        B, kv, T, D = x.shape
        return x[:, :, None, :, :].expand(B, kv, rep, T, D).reshape(B, kv * rep, T, D)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self._repeat(self.k(x).view(B, T, self.kv, self.hd).transpose(1, 2))
        v = self._repeat(self.v(x).view(B, T, self.kv, self.hd).transpose(1, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, C))


class GQAModel(nn.Module):
    def __init__(self, hf_style: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.blocks = nn.ModuleList(GQABlock(hf_style=hf_style) for _ in range(2))
        self.out = nn.Linear(32, 256, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@pytest.mark.parametrize("hf_style", [True, False], ids=["expand_reshape", "repeat_interleave"])
def test_repeated_kv_heads_reach_attention_unrepeated(hf_style, tmp_path):
    """Flash attention gets the 2 KV heads themselves (no repeated copies, no group sums in the
    backward), and the compiled block still matches the ATen template."""
    from mtc.tracer import trace
    from tests.graphs.compiled import check_compiled

    torch.manual_seed(0)
    model = GQAModel(hf_style)
    prog = trace(model, 2, 8)
    ct = check_compiled(prog, dict(model.named_parameters()), prog.layers[1], tmp_path)
    for graph in (ct.forward_graph, ct.joint_graph):
        calls = [n for n in graph.nodes if str(n.target).startswith("mtc.flash_attention")]
        assert calls
        for n in calls:
            k = n.args[2] if "bwd" in str(n.target) else n.args[1]
            assert k.meta["val"].shape[1] == 2, n.format_node()
    assert "aten.sum.dim_IntList" not in ct.backward_report.fallbacks
    assert not any("repeat_interleave" in op or "expand" in op for op in ct.forward_report.fallbacks)


def _head_joint():
    from mtc.graphs.lower import joint_graph

    from mtc.compiler import TEMPLATE_SWAPS
    from mtc.models import build
    from mtc.tracer import trace

    with torch.device("meta"):
        model = build("tiny", n_layers=1)
    prog = trace(model, 1, 16)
    call = prog.layers[-1]
    t = prog.templates[call.template]
    g, _ = joint_graph(t, TEMPLATE_SWAPS)
    args = []
    for inp in t.inputs:
        if call.bindings[inp.name].kind == "batch":
            targets = torch.randint(0, 256, inp.spec.shape)
            targets.view(-1)[3] = -100
            args.append(targets)
        else:
            args.append(torch.randn(inp.spec.shape) * (0.1 if len(inp.spec.shape) == 2 else 1.0))
    return g, args


@pytest.mark.parametrize("grad", [2.5, 0.0], ids=["scaled", "zero"])
def test_ce_grad_scale_folds_into_the_fused_op(grad):
    from mtc.graphs.program import instantiate
    from mtc.kernels.swaps import fold_ce_grad_scale

    g, args = _head_joint()
    g.graph.eliminate_dead_code()
    gout = torch.tensor(grad)
    want = instantiate(g.graph, "cpu")(*args, gout)
    assert fold_ce_grad_scale(g.graph) == 1
    targets = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
    assert "mtc.linear_cross_entropy_fwd_bwd_scaled.default" in targets
    assert "mtc.linear_cross_entropy_fwd_bwd.default" not in targets
    # no pass over the (V, H) weight gradient is left
    assert not any(n.target is torch.ops.aten.mul.Tensor and tuple(n.meta["val"].shape) == (256, 128) for n in g.graph.nodes)
    got = instantiate(g.graph, "cpu")(*args, gout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ce_grad_used_unscaled_is_not_folded():
    from mtc.kernels.swaps import fold_ce_grad_scale

    g, _ = _head_joint()
    op = next(n for n in g.graph.nodes if str(n.target) == "mtc.linear_cross_entropy_fwd_bwd.default")
    dw = next(u for u in op.users if u.args[1] == 2)
    out = next(n for n in g.graph.nodes if n.op == "output")
    out.args = ((*out.args[0], dw),)  # the raw dW escapes: folding the scale would change it
    assert fold_ce_grad_scale(g.graph) == 0


def _rope_attention_projection(x, cos, sin, wo):
    """A decoder's attention as it lowers: q (and k, v) viewed (B, H, T, D) from the projection's
    (B, T, H * D) output, rotated in fp32 (split in halves), attention, then back to (B, T, H * D)
    for the output projection (a transpose, and a copy where the layout needs one)."""
    B, T, _ = x.shape
    q = x.view(B, T, 2, 8).transpose(1, 2)
    a, b = q.float().split(4, dim=-1)
    r = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)
    o, _ = torch.ops.mtc.flash_attention_fwd(r, r, q, True, 0.25)
    return o.transpose(1, 2).reshape(B, T, 16) @ wo


def test_rotary_values_feed_attention_in_the_projection_layout_and_its_output_needs_no_copy():
    import copy

    import mtc.kernels.flash_attention  # noqa: F401  (the op)
    from mtc.graphs.partition import partition
    from mtc.graphs.program import instantiate
    from mtc.graphs.views import compute_in_source_layout, drop_contiguous_clones, refresh_view_meta
    from mtc.kernels.codegen import FUSIBLE
    from mtc.kernels.swaps import attention_output_layout_known, reads_any_layout, refresh_attention_meta
    from torch.fx.experimental.proxy_tensor import make_fx

    args = (torch.randn(2, 6, 16), torch.randn(6, 4), torch.randn(6, 4), torch.randn(16, 5))
    graph = make_fx(_rope_attention_projection, tracing_mode="fake")(*args).graph
    before = instantiate(copy.deepcopy(graph), "cpu")
    assert aten.clone.default in {n.target for n in graph.nodes}
    assert compute_in_source_layout(graph, FUSIBLE, reads_any_layout) == 1
    refresh_view_meta(graph)
    assert refresh_attention_meta(graph) == 1
    refresh_view_meta(graph)
    assert drop_contiguous_clones(graph, attention_output_layout_known) == 1
    fwd = next(n for n in graph.nodes if n.target is torch.ops.mtc.flash_attention_fwd.default)
    q, o = fwd.args[0].meta["val"], fwd.meta["val"][0]
    assert q.transpose(1, 2).is_contiguous() and o.transpose(1, 2).is_contiguous()  # (B, T, H, D) buffers
    # the rotation reads the projection's view as it is, in one kernel; nothing copies the output
    groups = partition(graph, FUSIBLE).groups
    assert len(groups) == 1 and groups[0].shape == (2, 6, 2, 8)
    torch.testing.assert_close(instantiate(graph, "cpu")(*args), before(*args), rtol=0, atol=0)


aten = torch.ops.aten
