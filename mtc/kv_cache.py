"""A key/value cache for decoding, attached to a model's own attention without changing its code.

The model families mtc ships call ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` once
per block. While `KVCache.attending(layer, pos)` is active, that call is intercepted (a
`TorchFunctionMode`): the new keys and values are written into the layer's preallocated buffers at
positions ``pos ..``, and the queries attend over everything cached so far, with the causal mask
shifted by ``pos``. Everything else in the block (projections, RoPE, norms) runs as written, so
cached decoding computes what the full forward computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mtc.errors import ConfigError

__all__ = ["KVCache"]


class KVCache(TorchFunctionMode):
    """Per-layer K and V buffers of ``max_len`` positions, filled as decoding goes."""

    def __init__(self, n_layers: int, max_len: int) -> None:
        super().__init__()
        self.n_layers, self.max_len = n_layers, max_len
        self._k: list[torch.Tensor | None] = [None] * n_layers
        self._v: list[torch.Tensor | None] = [None] * n_layers
        self._layer: int | None = None
        self._pos = 0
        self._calls = 0

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds now."""
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v) if t is not None)

    @contextlib.contextmanager
    def attending(self, layer: int, pos: int) -> Iterator[None]:
        """Route ``layer``'s attention through the cache for tokens at positions ``pos ..``."""
        self._layer, self._pos, self._calls = layer, pos, 0
        try:
            with self:
                yield
        finally:
            self._layer = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self._layer is None:
            return func(*args, **kwargs)
        self._calls += 1
        if self._calls > 1:
            raise ConfigError("this model's block calls scaled_dot_product_attention more than once; the KV cache "
                              "supports one self-attention per block (generate with --no-kv-cache)")
        q, k, v = args[:3]
        rest = dict(kwargs)
        if len(args) > 3 or rest.pop("attn_mask", None) is not None or not rest.pop("is_causal", False):
            raise ConfigError("the KV cache supports causal self-attention without an explicit mask "
                              "(generate with --no-kv-cache)")
        if float(rest.pop("dropout_p", 0.0)):
            raise ConfigError("attention dropout is on while generating; build the model without dropout")
        j, pos, t = self._layer, self._pos, q.shape[-2]
        end = pos + t
        if end > self.max_len:
            raise ConfigError(f"the KV cache holds {self.max_len} positions, decoding reached {end}")
        if self._k[j] is None:
            self._k[j] = k.new_empty((*k.shape[:-2], self.max_len, k.shape[-1]))
            self._v[j] = v.new_empty((*v.shape[:-2], self.max_len, v.shape[-1]))
        kc, vc = self._k[j], self._v[j]
        kc[..., pos:end, :] = k
        vc[..., pos:end, :] = v
        keys, values = kc[..., :end, :], vc[..., :end, :]
        if q.device.type == "cpu":  # torch's CPU kernel runs 25-1000x slower on strided views than on copies
            q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
        if t == 1:  # one new token sees every cached position
            return func(q, keys, values, **rest)
        if pos == 0:
            return func(q, keys, values, is_causal=True, **rest)
        allowed = torch.arange(pos, end, device=q.device)[:, None] >= torch.arange(end, device=q.device)[None, :]
        return func(q, keys, values, attn_mask=allowed, **rest)
