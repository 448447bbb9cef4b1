"""mtc: train language models far larger than GPU memory on one GPU, at full precision.

A model is traced once into a Program of per-layer templates (`trace`), its fp32 state lives in a
zarr tensor store (`open_store`), and a streaming executor runs it layer by layer (`train`).
Names are imported on first use, so ``import mtc.errors`` stays light.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = ["MTCError", "OptimConfig", "TrainConfig", "compile", "export_hf", "import_hf", "load_config", "load_plan",
           "load_state_dict", "open_store", "save_plan", "trace", "train"]

_WHERE = {
    "trace": "mtc.tracer",
    "train": "mtc.api",
    "compile": "mtc.api",
    "load_plan": "mtc.plan",
    "save_plan": "mtc.api",
    "TrainConfig": "mtc.config",
    "OptimConfig": "mtc.config",
    "load_config": "mtc.config",
    "MTCError": "mtc.errors",
    "import_hf": "mtc.hf",
    "export_hf": "mtc.hf",
    "load_state_dict": "mtc.warmstart",
}


def open_store(path: Any, **kwargs: Any) -> Any:
    """Open an existing tensor store directory (see `mtc.store.TensorStore.open`)."""
    from mtc.store import TensorStore

    return TensorStore.open(path, **kwargs)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'mtc' has no attribute {name!r}")


class _Package(types.ModuleType):
    """``mtc.train`` is the API function although ``mtc/train.py`` is also a submodule: importing a
    submodule sets the package attribute of its name, which would replace the function with the
    module. Module attribute access customised as the Python data model describes (``__class__``)."""

    @property
    def train(self) -> Any:
        from mtc.api import train

        return train

    @train.setter
    def train(self, value: Any) -> None:
        pass  # the import system binding the submodule mtc.train; it stays in sys.modules["mtc.train"]


sys.modules[__name__].__class__ = _Package
