"""Built-in reference models, by preset name: the Llama family (incl. a Qwen2-style variant) and GPT-2."""

from __future__ import annotations

import dataclasses

from torch import nn

from mtc.errors import ConfigError
from mtc.models.gpt2 import GPT2, GPT2_PRESETS
from mtc.models.llama import PRESETS as LLAMA_PRESETS
from mtc.models.llama import Llama

__all__ = ["build", "model_config", "preset_names"]


def preset_names() -> list[str]:
    """Every built-in preset."""
    return [*LLAMA_PRESETS, *GPT2_PRESETS]


def model_config(name: str, **overrides: object) -> object:
    """The config dataclass of preset ``name`` with fields replaced by ``overrides``."""
    table = LLAMA_PRESETS if name in LLAMA_PRESETS else GPT2_PRESETS if name in GPT2_PRESETS else None
    if table is None:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    try:
        return dataclasses.replace(table[name], **overrides)
    except TypeError as e:
        fields = ", ".join(f.name for f in dataclasses.fields(table[name]))
        raise ConfigError(f"bad override for preset {name!r}: {e}; fields are: {fields}") from None


def build(name: str, **overrides: object) -> nn.Module:
    """A fresh model of preset ``name`` (initialised from torch's current RNG state)."""
    cfg = model_config(name, **overrides)
    return GPT2(cfg) if name in GPT2_PRESETS else Llama(cfg)
