"""A model split into the units generation streams: embed, one unit per block, head.

The model is built on the meta device (no memory) and each unit runs its own submodules' forward
through `torch.func.functional_call`, with weights handed in by parameter name: the same code as
training's model, with weights that are loaded one unit at a time. What differs per family is only
how positions enter (rotary tables passed to the blocks for Llama, learned positions added by the
embedding for GPT-2), so decoding can start at any position (a KV cache holds the earlier ones).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from mtc.errors import ConfigError
from mtc.models.gpt2 import GPT2
from mtc.models.llama import Llama, rope_tables

__all__ = ["Decoder"]


class Decoder:
    """``embed(w, ids, pos)``, ``block(j, w, x, pos)``, ``head(w, x)`` over a meta-device model."""

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, (Llama, GPT2)):
            raise ConfigError(f"generation supports the Llama and GPT-2 model families, not {type(model).__name__}")
        self.model = model
        self.cfg: Any = model.cfg
        self.n_blocks = len(model.layers)
        # canonical parameter names (what the plan and the store use); tied weights have one name
        self._canon = {id(p): n for n, p in model.named_parameters()}
        if isinstance(model, Llama):
            self.embed_mods, self.head_mods = [model.embed], [model.norm, model.lm_head]
        else:
            self.embed_mods, self.head_mods = [model.wte, model.wpe], [model.ln_f, model.lm_head]

    def _keys(self, mods: list[nn.Module]) -> list[str]:
        return list(dict.fromkeys(self._canon[id(p)] for m in mods for _, p in m.named_parameters(remove_duplicate=False)))

    def embed_keys(self) -> list[str]:
        """Parameter names the embed unit reads."""
        return self._keys(self.embed_mods)

    def block_keys(self, j: int) -> list[str]:
        """Parameter names block ``j`` reads."""
        return self._keys([self.model.layers[j]])

    def head_keys(self) -> list[str]:
        """Parameter names the head reads (a tied embedding under its canonical name)."""
        return self._keys(self.head_mods)

    def _call(self, mod: nn.Module, w: dict[str, torch.Tensor], *args: Any) -> Any:
        local = {n: w[self._canon[id(p)]] for n, p in mod.named_parameters(remove_duplicate=False)}
        return functional_call(mod, local, args)

    def embed(self, w: dict[str, torch.Tensor], ids: torch.Tensor, pos: int) -> torch.Tensor:
        """Hidden states (B, T, C) of tokens ``ids`` at positions ``pos .. pos + T - 1``."""
        self._check_len(pos + ids.shape[1])
        if isinstance(self.model, Llama):
            return self._call(self.model.embed, w, ids)
        at = torch.arange(pos, pos + ids.shape[1], device=ids.device)
        return self._call(self.model.wte, w, ids) + self._call(self.model.wpe, w, at)

    def block(self, j: int, w: dict[str, torch.Tensor], x: torch.Tensor, pos: int) -> torch.Tensor:
        """Block ``j`` on ``x`` whose first token is at position ``pos``."""
        if isinstance(self.model, Llama):
            end = pos + x.shape[1]
            cos, sin = rope_tables(end, self.cfg.head_dim, self.cfg.rope_theta, x.device, self.cfg)  # scaled as training ran
            return self._call(self.model.layers[j], w, x, cos[pos:end], sin[pos:end])
        return self._call(self.model.layers[j], w, x)

    def head(self, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) in fp32."""
        for m in self.head_mods:
            x = self._call(m, w, x)
        return x.float()

    def _check_len(self, end: int) -> None:
        if end > self.cfg.max_seq_len:
            raise ConfigError(f"position {end - 1} is beyond the model's max_seq_len {self.cfg.max_seq_len}; "
                              "use a shorter prompt, fewer new tokens or a smaller --context")
