"""Compiled plans with embed outputs that depend on parameters (learned positions times a learned
gain, fed to every block): the gradient flows back through each block's joint graph into the
embed stage's, and compiled training matches torch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtc.compiler import aux_param_dependence, compile_program
from mtc.config import OptimConfig, TrainConfig
from mtc.data import write_token_file
from mtc.runtime.state import read_params
from mtc.tracer import trace
from mtc.train import train
from tests.reference import reference_train


class PosBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = x + pos
        h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-5)
        return x + self.down(F.silu(self.up(h)))


class LearnedPositions(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, seq: int = 8, n: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.1 * torch.randn(seq, dim))
        self.gain = nn.Parameter(torch.ones(dim))
        self.blocks = nn.ModuleList(PosBlock(dim) for _ in range(n))
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        pos = self.pos[: ids.shape[1]] * self.gain  # an aux value of the embed stage, with parameters
        for b in self.blocks:
            x = b(x, pos)
        return self.out(x)


def test_compiled_templates_take_aux_gradients(tmp_path):
    torch.manual_seed(0)
    m = LearnedPositions()
    prog = trace(m, 2, 8)
    assert aux_param_dependence(prog) == (True,)
    compiled = compile_program(prog, tmp_path, log=None)
    params = {k: v.detach() for k, v in m.named_parameters()}
    ids = torch.randint(0, 64, (2, 8))
    # block: the joint graph returns the aux gradient, equal to autograd's through the ATen template
    call = prog.layers[1]
    t, ct = prog.templates[call.template], compiled[call.template]
    aux_k = [k for k, i in enumerate(t.inputs) if i.kind == "aux"]
    assert aux_k and set(aux_k) <= set(ct.diff)
    args = [params[call.bindings[i.name].key] if i.kind == "param" else torch.randn(i.spec.shape) for i in t.inputs]
    g = torch.randn(prog.carry.shape)
    xs = [a.clone().requires_grad_(k in ct.diff) for k, a in enumerate(args)]
    want = torch.autograd.grad(t.module("cpu")(*xs)[0], [xs[k] for k in ct.diff], g)
    got = ct.module("joint", "cpu")(*args, g)[1:]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # embed: two grad outputs (hidden state, positions) -> gradients of its parameters
    call = prog.layers[0]
    t, ct = prog.templates[call.template], compiled[call.template]
    args = [params[call.bindings[i.name].key] if i.kind == "param" else ids for i in t.inputs]
    gx, gp = torch.randn(prog.carry.shape), torch.randn(prog.aux[0].shape)
    xs = [a.clone().requires_grad_(k in ct.diff) for k, a in enumerate(args)]
    out = t.module("cpu")(*xs)
    want = torch.autograd.grad([out[0], out[1]], [xs[k] for k in ct.diff], [gx, gp])
    got = ct.module("joint", "cpu")(*args, gx, gp)[2:]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("save", ["auto", "all"])  # all: the blocks keep their activations and return the aux gradient from them
def test_compiled_training_with_aux_parameters_matches_torch(tmp_path, save):
    torch.manual_seed(0)
    m = LearnedPositions()
    toks = np.random.default_rng(3).integers(0, 64, 4_000).astype(np.uint16)
    tf = write_token_file(tmp_path / "t.bin", toks, vocab_size=64, tokenizer="byte")
    cfg = TrainConfig(steps=3, micro_batch_size=2, seq_len=8, grad_accum=2, kernels="fused", save_activations=save,
                      optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=1, weight_decay=0.1, clip_norm=1.0))
    ref_losses, ref_weights = reference_train(cfg, tf, model=copy.deepcopy(m))
    res = train(cfg, None, tf, model=m)
    try:
        assert bool(res.saves) == (save == "all")
        for a, b in zip(res.losses, ref_losses, strict=True):
            assert abs(a - b) <= 1e-5 * b
        got = read_params(res.program, res.store, res.generation)
        for k, v in ref_weights.items():
            assert ((got[k] - v).norm() / v.norm()).item() < 1e-5, k
    finally:
        res.store.close()
