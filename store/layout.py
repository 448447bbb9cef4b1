"""Names and creation of the per-layer training state.

Each layer call of a Program owns one flat 1-D array per kind:

* ``master``  fp32 master weights (authoritative),
* ``m``, ``v`` fp32 Adam moments,
* ``compute`` an optional low-precision copy (bf16) written by the optimizer for streaming.

Everything exists in two generations (``g0``, ``g1``): step k reads generation g and writes 1 - g,
so the state the last commit points to is never overwritten by a step that may not finish.
"""

from __future__ import annotations

import torch

from mtc.errors import StoreError
from mtc.store.tensor_store import TensorStore

__all__ = ["KINDS", "GENERATIONS", "state_array_name", "create_layer_state"]

KINDS = ("master", "m", "v", "compute")
GENERATIONS = (0, 1)


def state_array_name(layer: int, kind: str, generation: int) -> str:
    """``layers/0003/master/g1`` for layer 3's master weights in generation 1."""
    if kind not in KINDS:
        raise StoreError(f"unknown state kind {kind!r}; kinds are {', '.join(KINDS)}")
    if generation not in GENERATIONS:
        raise StoreError(f"generation must be 0 or 1, got {generation}")
    if layer < 0:
        raise StoreError(f"layer index must be >= 0, got {layer}")
    return f"layers/{layer:04d}/{kind}/g{generation}"


def create_layer_state(store: TensorStore, layer_numels: list[int], *, compute_dtype: torch.dtype | None = None) -> None:
    """Create both generations of master, m, v (and compute, if a dtype is given) for every layer."""
    for layer, n in enumerate(layer_numels):
        if n <= 0:
            continue  # a layer that owns no parameter (e.g. only tied weights) has no state
        for g in GENERATIONS:
            for kind in ("master", "m", "v"):
                store.create_array(state_array_name(layer, kind, g), (n,), torch.float32)
            if compute_dtype is not None:
                store.create_array(state_array_name(layer, "compute", g), (n,), compute_dtype)
