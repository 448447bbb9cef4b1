"""Other architectures through the same tracer, executor and compiler: Qwen2-style, GPT-2-style,
and a custom block defined only here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtc.config import OptimConfig, TrainConfig
from mtc.data import write_token_file
from mtc.models import build
from mtc.runtime.state import read_params
from mtc.train import train
from mtc.tracer import LossModel, trace
from tests.graphs.compiled import check_compiled, graph_targets
from tests.graphs.test_trace import run_program
from tests.reference import reference_train


class SquaredReLUBlock(nn.Module):
    """A block no preset has: scaled residual, squared-ReLU MLP, RMS-style norm written by hand."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.up = nn.Linear(dim, 3 * dim)
        self.down = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * self.scale
        return x + 0.5 * self.down(F.relu(self.up(h)) ** 2)


class Custom(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 32, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(SquaredReLUBlock(dim) for _ in range(n))
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _models():
    torch.manual_seed(0)
    return {"qwen2-tiny": build("qwen2-tiny", n_layers=2), "gpt2-tiny": build("gpt2-tiny", n_layers=2), "custom": Custom()}


@pytest.mark.parametrize("name", ["qwen2-tiny", "gpt2-tiny", "custom"])
def test_trace_and_compile_each_architecture(name, tmp_path):
    model = _models()[name]
    prog = trace(model, 2, 8)
    assert sum(1 for c in prog.layers if prog.templates[c.template].kind == "block") == 2 if name != "custom" else 3
    assert len({c.template for c in prog.iter_blocks()}) == 1
    ids = torch.randint(0, 256, (2, 8))
    assert torch.equal(run_program(prog, dict(model.named_parameters()), ids, ids), LossModel(model)(ids, ids))
    # one compiled block, and the head: forward and every gradient against the ATen template
    params = dict(model.named_parameters())
    block = check_compiled(prog, params, prog.layers[1], tmp_path)
    assert block.forward_report.generated > 0 and block.forward_report.kernels < block.forward_report.aten_ops
    if name != "custom":  # causal attention runs the flash kernel, forward and backward
        assert {"mtc.flash_attention_fwd.default", "mtc.flash_attention_bwd.default"} <= graph_targets(block.joint_graph)
    head = check_compiled(prog, params, prog.layers[-1], tmp_path)
    # the loss is the fused linear + cross-entropy: no full-vocabulary softmax anywhere
    # the fused linear + cross-entropy, with the backward's grad scale folded into it
    assert "mtc.linear_cross_entropy_fwd_bwd_scaled.default" in graph_targets(head.joint_graph)
    assert "mtc.linear_cross_entropy_loss.default" in graph_targets(head.forward_graph)
    assert not any("log_softmax" in t for t in graph_targets(head.joint_graph) | graph_targets(head.forward_graph))


def test_gpt2_parity_with_tied_embeddings(tmp_path):
    # The head reads the embedding's weight (owned by layer 0): fetched as a foreign range, its
    # gradient summed from two layers, updated only after the embed backward.
    toks = np.random.default_rng(1).integers(0, 256, 20_000).astype(np.uint16)
    tf = write_token_file(tmp_path / "t.bin", toks, vocab_size=256, tokenizer="byte")
    cfg = TrainConfig(model="gpt2-tiny", model_overrides={"n_layers": 2}, steps=6, micro_batch_size=2, seq_len=16,
                      grad_accum=2, optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, clip_norm=1.0))
    ref_losses, ref_weights = reference_train(cfg, tf)
    res = train(cfg, None, tf)
    try:
        assert "lm_head.weight" not in res.program.params
        for a, b in zip(res.losses, ref_losses, strict=True):
            assert abs(a - b) <= 1e-5 * b
        got = read_params(res.program, res.store, res.generation)
        got["lm_head.weight"] = got["wte.weight"]
        C = res.program.carry.shape[-1]
        for k, v in ref_weights.items():
            a, b = got[k], v
            if k.endswith("c_attn.bias"):
                # The key bias has zero true gradient (it shifts every logit of a query equally,
                # softmax ignores that), so both runs update it by Adam-normalised rounding noise:
                # compare the query and value parts only.
                a, b = torch.cat([a[:C], a[2 * C:]]), torch.cat([b[:C], b[2 * C:]])
            assert ((a - b).norm() / b.norm()).item() < 1e-5, k
    finally:
        res.store.close()


def _qk_normed_after_transpose(self, x):
    """GPT-2's block with an RMS norm of q per head applied after q is viewed (B, H, T, D), as some
    decoders place it: the norm's output is recorded in the projection's (B, T, H, D) layout."""
    B, T, C = x.shape
    q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
    q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
    x = x + self.c_proj(y)
    return x + self.mlp_proj(F.gelu(self.c_fc(self.ln2(x)), approximate="tanh"))


def test_a_value_recorded_in_a_transposed_layout_keeps_it_in_its_kernel(tmp_path, monkeypatch):
    # The generated kernel of the normed q writes the layout the trace recorded for it: attention's
    # output and gradients follow q's layout, and the graph's views of them were traced against it
    # (a kernel writing q contiguous made the joint graph's view of dq fail at run time)
    from mtc.kernels.codegen import FusedKernel
    from mtc.models import gpt2

    monkeypatch.setattr(gpt2.GPT2Block, "forward", _qk_normed_after_transpose)
    torch.manual_seed(0)
    model = build("gpt2-tiny", n_layers=1)
    prog = trace(model, 2, 8)
    block = check_compiled(prog, dict(model.named_parameters()), prog.layers[1], tmp_path)
    strided = [k for g in (block.forward_graph, block.joint_graph) for n in g.nodes
               if isinstance(k := n.target, FusedKernel) and any(k.out_strides)]
    assert strided, "the normed q is written in its recorded (B, T, H, D) layout"


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x: torch.Tensor, rot: int) -> torch.Tensor:
    """Rotary embedding of the first ``rot`` dims of (B, H, T, D), the rest passed through, as
    GPT-NeoX's partial rotary writes it (its tail is empty where ``rot`` is the head dim)."""
    T = x.shape[-2]
    f = torch.outer(torch.arange(T, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([f.sin(), f.sin()], -1)
    xr, tail = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, tail], -1)


class QKNormRopeBlock(nn.Module):
    """Per-head RMS norms of q and k before rotary embeddings (as in Qwen3), RMS norms, a GELU MLP."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads, hd = heads, dim // heads
        self.norm1, self.norm2 = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.q_norm, self.k_norm = nn.Parameter(torch.ones(hd)), nn.Parameter(torch.ones(hd))
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = _rms(x, self.norm1)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        rot = C // self.heads  # rotary over the whole head
        q, k = _rope(_rms(q, self.q_norm), rot), _rope(_rms(k, self.k_norm), rot)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.o(y)
        return x + self.down(F.gelu(self.up(_rms(x, self.norm2))))


class ParallelGatedBlock(nn.Module):
    """GPT-J / NeoX parallel attention and MLP from one LayerNorm, their sum scaled by a learned scalar."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        q, k, v = (t.unsqueeze(1) for t in self.qkv(h).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)
        return x + self.gate * (self.o(y) + self.down(F.gelu(self.up(h))))


class _BlocksLM(nn.Module):
    def __init__(self, block: type[nn.Module], vocab: int = 256, dim: int = 16, n: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(block(dim) for _ in range(n))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@pytest.mark.parametrize("block", [QKNormRopeBlock, ParallelGatedBlock], ids=["qk-norm-rope", "parallel-gated"])
def test_a_group_that_reaches_itself_through_another_group_is_not_formed(block, tmp_path):
    # Groups merged as siblings (or through one edge) hold nodes with no path between them: a
    # norm's forward rstd beside its backward's row sums, the gated sum beside the gate's
    # gradient. Two such groups, each feeding the other through matmuls, passed the cycle check
    # (it followed the graph's own edges only), and compiling the block failed with 'splicing
    # fused kernels left nodes unplaced': `mtc.train(kernels='fused')` could not train them.
    torch.manual_seed(0)
    model = _BlocksLM(block)
    prog = trace(model, 2, 8)
    check_compiled(prog, dict(model.named_parameters()), prog.layers[1], tmp_path)


class SliceWriteBlock(nn.Module):
    """Writes into slices of its activations in place, as researchers do to pin or shift a column."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h[..., 0] = 0.0
        h[:, 1] += 1.0
        return x + torch.sigmoid(h) * h


class ReadThenScaleInPlaceBlock(nn.Module):
    """Reads an activation, then scales it in place: the read must see the value before the write."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        a = torch.tanh(h) * 2.0
        h.mul_(0.5).add_(1.0)
        return x + a * h


@pytest.mark.parametrize("block", [SliceWriteBlock, ReadThenScaleInPlaceBlock], ids=["slice-write", "read-then-scale"])
def test_in_place_writes_into_activations_compile_to_the_same_function(block, tmp_path):
    # export keeps `h[..., 0] = 0.0` as a fill_ of a select that no node reads, and `h.mul_(0.5)`
    # as a node that tanh(h), reading h before it, does not depend on: fusing and reordering by
    # data dependence dropped the first write and moved the read after the second, and the
    # compiled layer silently computed another function, forward and backward
    torch.manual_seed(0)
    model = _BlocksLM(block, dim=12)
    prog = trace(model, 2, 7)
    check_compiled(prog, dict(model.named_parameters()), prog.layers[1], tmp_path)


def test_a_head_that_scales_in_place_compiles_to_the_same_function(tmp_path):
    # functionalising runs before the template rewrites: functorch cannot trace the fused
    # cross-entropy's autograd.Function, so a head with an in-place op keeps torch's loss
    class ScaledHead(_BlocksLM):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            h = x + 1.0
            h.mul_(0.5)
            return self.out(h)

    torch.manual_seed(0)
    model = ScaledHead(ReadThenScaleInPlaceBlock, dim=12)
    prog = trace(model, 2, 7)
    check_compiled(prog, dict(model.named_parameters()), prog.layers[-1], tmp_path)


class NanoGPTAttention(nn.Module):
    """nanoGPT's attention: `.contiguous().view()` after the transpose of SDPA's output."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def test_a_view_of_attention_output_traced_in_sdpa_layout_compiles(tmp_path):
    # torch's SDPA returns its output in (B, T, H, D) layout, so export drops the .contiguous()
    # before .view(B, T, C) as a no-op; lowering swaps SDPA for mtc::attention, whose output is
    # (B, H, T, D)-contiguous, and the view then failed ('view size is not compatible with input
    # tensor's size and stride'): nanoGPT's attention could not be compiled
    torch.manual_seed(0)
    model = _BlocksLM(NanoGPTAttention, dim=20)
    prog = trace(model, 2, 7)
    check_compiled(prog, dict(model.named_parameters()), prog.layers[1], tmp_path)
