"""A GPT-2-style decoder: learned positions, LayerNorm, fused-QKV attention with biases, GELU MLP,
LM head tied to the token embedding. A plain `nn.Module`, traced like any user model."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from mtc.errors import ConfigError

__all__ = ["GPT2", "GPT2_PRESETS", "GPT2Config"]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class GPT2Config:
    """Shapes of a GPT-2-style model."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = True  # the LM head shares the token embedding's weight (GPT-2's own checkpoints do)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ConfigError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")


GPT2_PRESETS = {
    "gpt2-tiny": GPT2Config(vocab_size=256, dim=96, n_layers=3, n_heads=4, max_seq_len=256),
    "gpt2-124m": GPT2Config(vocab_size=50257, dim=768, n_layers=12, n_heads=12),
}


class GPT2Block(nn.Module):
    """x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.c_fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.mlp_proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """``forward(ids) -> logits``; the LM head shares the token embedding's weight unless ``tie_embeddings`` is off."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.ndim >= 2:
                    scale = 1 / math.sqrt(2 * cfg.n_layers) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 1.0
                    nn.init.normal_(p, 0.0, cfg.init_std * scale)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        if T > self.cfg.max_seq_len:
            raise ConfigError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        pos = torch.arange(T, device=ids.device)
        x = self.wte(ids) + self.wpe(pos)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))
