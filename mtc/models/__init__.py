"""Built-in reference models, by preset name: the Llama family (incl. a Qwen2-style variant) and GPT-2.

Besides the presets, the two families themselves ("llama", "gpt2") are model names: they have no
default shape, so every field of their config comes from ``model_overrides``. Imported Hugging
Face checkpoints are recorded that way (see `mtc.hf`), and so can any shape a user writes down.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from mtc.errors import ConfigError
from mtc.models.gpt2 import GPT2, GPT2_PRESETS, GPT2Config
from mtc.models.llama import PRESETS as LLAMA_PRESETS
from mtc.models.llama import Llama, LlamaConfig

__all__ = ["FAMILIES", "build", "family_of", "model_class", "model_config", "model_names", "preset_names"]

# family name -> config class; a family name is a model name whose shape is all in model_overrides
FAMILIES: dict[str, type] = {"llama": LlamaConfig, "gpt2": GPT2Config}


def preset_names() -> list[str]:
    """Every built-in preset."""
    return [*LLAMA_PRESETS, *GPT2_PRESETS]


def model_names() -> list[str]:
    """Every accepted model name: the presets, then the families."""
    return [*preset_names(), *FAMILIES]


def family_of(name: str) -> str:
    """"llama" or "gpt2": the family of a preset or family name."""
    if name in FAMILIES:
        return name
    if name in LLAMA_PRESETS:
        return "llama"
    if name in GPT2_PRESETS:
        return "gpt2"
    raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}; families: {', '.join(FAMILIES)}")


def model_class(name: str) -> type:
    """The config dataclass of a preset or family name."""
    return FAMILIES[family_of(name)]


def model_config(name: str, **overrides: object) -> object:
    """The config dataclass of preset ``name`` with fields replaced by ``overrides``.

    For a family name every required field must be in ``overrides``.
    """
    cls = model_class(name)
    if name in FAMILIES:
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [f for f in required if f not in overrides]
        if missing:
            raise ConfigError(f"model family {name!r} has no default shape: give model_overrides {', '.join(missing)} "
                              "(or pick a preset)")
        try:
            return cls(**overrides)
        except TypeError as e:
            fields = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ConfigError(f"bad model_overrides for family {name!r}: {e}; fields are: {fields}") from None
    table = LLAMA_PRESETS if name in LLAMA_PRESETS else GPT2_PRESETS
    try:
        return dataclasses.replace(table[name], **overrides)
    except TypeError as e:
        fields = ", ".join(f.name for f in dataclasses.fields(table[name]))
        raise ConfigError(f"bad override for preset {name!r}: {e}; fields are: {fields}") from None


def build(name: str, **overrides: object) -> nn.Module:
    """A fresh model of preset (or family) ``name`` (initialised from torch's current RNG state)."""
    cfg = model_config(name, **overrides)
    return GPT2(cfg) if family_of(name) == "gpt2" else Llama(cfg)
