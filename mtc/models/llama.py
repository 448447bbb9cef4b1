"""A Llama-style decoder family (RMSNorm, RoPE, grouped-query attention, SwiGLU).

These are plain `nn.Module`s with no mtc-specific hooks: they go through the same tracer as a
user's model, so they double as the reference for what the tracer must handle. Shape comments
use B = batch, T = sequence, C = model dim, nh / nkv = query / key-value heads, hs = head size.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from mtc.errors import ConfigError

__all__ = ["PRESETS", "ROPE_SCALINGS", "Block", "Llama", "LlamaConfig", "preset"]

ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class LlamaConfig:
    """Shapes of a Llama-style model."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2-style blocks add a bias to the q, k and v projections
    init_std: float = 0.02
    out_bias: bool = False  # a bias on the attention output projection (with qkv_bias: HF Llama's attention_bias)
    mlp_bias: bool = False  # biases on the three MLP projections (HF Llama's mlp_bias)
    # RoPE frequency scaling (HF `rope_scaling`): "none", "linear" (every frequency / rope_factor) or
    # "llama3" (Llama 3.1: low frequencies / rope_factor, high ones kept, a smooth blend between)
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ConfigError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}; pick heads that divide dim")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}; "
                "grouped-query attention shares each KV head among n_heads // n_kv_heads query heads"
            )
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(f"head size {self.dim // self.n_heads} is odd; RoPE rotates pairs, use an even head size")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ConfigError(f"rope_scaling {self.rope_scaling!r} is not supported; use one of {', '.join(ROPE_SCALINGS)}")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(
                f"llama3 rope scaling needs rope_high_freq_factor ({self.rope_high_freq_factor}) > "
                f"rope_low_freq_factor ({self.rope_low_freq_factor})"
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.dim // self.n_heads

    def n_params(self) -> int:
        """Number of trainable parameters, counting tied embeddings once."""
        hs = self.head_dim
        attn = self.dim * hs * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * hs * self.dim
        attn += hs * (self.n_heads + 2 * self.n_kv_heads) * self.qkv_bias + self.dim * self.out_bias
        mlp = 3 * self.dim * self.ffn_dim + (2 * self.ffn_dim + self.dim) * self.mlp_bias
        block = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        return self.n_layers * block + emb + self.dim + (0 if self.tie_embeddings else emb)


# Real shapes (public model cards) are for planning and tracing on the meta device; `tiny` is for
# tests and the demo. 125m follows GPT-3 Small's width/depth with a Llama block.
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352, max_seq_len=256),
    "qwen2-tiny": LlamaConfig(
        vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352, max_seq_len=256,
        qkv_bias=True, rope_theta=1000000.0, norm_eps=1e-6,
    ),
    "125m": LlamaConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    "1b": LlamaConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        rope_theta=500000.0, tie_embeddings=True, max_seq_len=8192,
    ),
    "8b": LlamaConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        rope_theta=500000.0, max_seq_len=8192,
    ),
    "13b": LlamaConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, max_seq_len=4096),
    "70b": LlamaConfig(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
        rope_theta=500000.0, max_seq_len=8192,
    ),
}


def preset(name: str, **overrides: object) -> LlamaConfig:
    """Return a preset's config, optionally with fields replaced (e.g. ``n_layers=2``)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    try:
        return dataclasses.replace(PRESETS[name], **overrides)
    except TypeError as e:
        fields = ", ".join(f.name for f in dataclasses.fields(LlamaConfig))
        raise ConfigError(f"bad override for preset {name!r}: {e}; fields are: {fields}") from None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                scaling: LlamaConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (T, hs/2), in fp32.

    Computed from arange rather than held in a buffer, so that a traced model has no constants
    and the tables are recomputed (cheaply) by the embedding stage. ``scaling``: a config whose
    ``rope_scaling`` is not "none" rescales the frequencies as Hugging Face's rope types do.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None and scaling.rope_scaling != "none":
        inv_freq = _scale_frequencies(inv_freq, scaling)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, hs/2)
    return freqs.cos(), freqs.sin()


def _scale_frequencies(inv_freq: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    """Rescaled RoPE frequencies, op for op as transformers computes them (so logits agree exactly)."""
    factor = cfg.rope_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    old, low, high = cfg.rope_original_max_seq_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # long wavelengths: / factor
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)  # in between: blend the two
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, h, T, hs) by the angles in cos/sin (T, hs/2); interleaved-halves convention."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.out_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # expand KV heads so every query head has its group's K and V
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Token embedding, N blocks, final norm and LM head; ``forward(ids) -> logits (B, T, V)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; output projections scaled by 1/sqrt(2 * n_layers) (GPT-2)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.ndim < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue  # norm scales stay at one
            scale = 1 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w_down.weight")) else 1.0
            nn.init.normal_(p, mean=0.0, std=std * scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        if T > self.cfg.max_seq_len:
            raise ConfigError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.embed(ids)  # (B, T, C)
        cos, sin = rope_tables(T, self.cfg.head_dim, self.cfg.rope_theta, ids.device, self.cfg)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))  # (B, T, V)
