"""Names and creation of the per-layer training state, so the runtime never builds names by hand.

Each layer of a Program owns one flat 1-D array per kind, as long as the layer's parameter count:

* ``master``  fp32 master weights (authoritative),
* ``m``, ``v`` fp32 Adam moments,
* ``compute`` an optional low-precision copy (e.g. bf16) written by the optimizer for streaming.

Everything exists in two generations (``g0``, ``g1``): the step after a commit of generation g
reads g and writes 1 - g, so a crash in the middle of a step's writes never touches the state the
last commit points to.
"""

from __future__ import annotations

import torch
from mtc.store.tensor_store import TensorStore

from mtc.errors import StoreError

__all__ = [
    "GENERATIONS",
    "KINDS",
    "LAYOUT_ATTR",
    "STATE_DTYPE",
    "create_layer_state",
    "layer_state_nbytes",
    "other_generation",
    "state_array_name",
]

KINDS: tuple[str, ...] = ("master", "m", "v", "compute")
GENERATIONS: tuple[int, ...] = (0, 1)
STATE_DTYPE = torch.float32  # master, m and v: authoritative state is never stored below fp32
_FP32_KINDS = ("master", "m", "v")
LAYOUT_ATTR = "mtc_layers"  # root attribute: {"numels": [per layer], "compute_dtype": name or None}


def state_array_name(layer: int, kind: str, generation: int) -> str:
    """Array name of one layer's state, e.g. ``layers/0003/master/g1``."""
    if kind not in KINDS:
        raise StoreError(f"unknown state kind {kind!r}; kinds are {', '.join(KINDS)}")
    if generation not in GENERATIONS or isinstance(generation, bool):
        raise StoreError(f"generation must be 0 or 1, got {generation!r}")
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise StoreError(f"layer index must be an int >= 0, got {layer!r}")
    return f"layers/{layer:04d}/{kind}/g{generation}"


def other_generation(generation: int) -> int:
    """The generation a step writes when it reads ``generation``."""
    if generation not in GENERATIONS or isinstance(generation, bool):
        raise StoreError(f"generation must be 0 or 1, got {generation!r}")
    return 1 - generation


def create_layer_state(store: TensorStore, layer_numels: list[int], *, compute_dtype: torch.dtype | None = None) -> None:
    """Create both generations of master, m, v (and compute, if ``compute_dtype``) for every layer.

    ``layer_numels[i]`` is layer i's total parameter count; a layer with 0 (it owns no parameter,
    e.g. only tied weights) gets no arrays. Safe to call again on a store that has them.
    The layout is recorded in the store's ``mtc_layers`` attribute, so `mtc.store.verify` can
    tell a missing array from one that never existed.
    """
    _check_numels(layer_numels)
    cdt = str(compute_dtype).removeprefix("torch.") if compute_dtype is not None else None
    store.set_attribute(LAYOUT_ATTR, {"numels": list(layer_numels), "compute_dtype": cdt})
    for layer, n in enumerate(layer_numels):
        if n == 0:
            continue
        for g in GENERATIONS:
            for kind in _FP32_KINDS:
                store.create_array(state_array_name(layer, kind, g), (n,), STATE_DTYPE)
            if compute_dtype is not None:
                store.create_array(state_array_name(layer, "compute", g), (n,), compute_dtype)


def layer_state_nbytes(layer_numels: list[int], *, compute_dtype: torch.dtype | None = None) -> int:
    """Bytes `create_layer_state` allocates on disk (both generations), to check free space first."""
    _check_numels(layer_numels)
    per_param = len(_FP32_KINDS) * STATE_DTYPE.itemsize + (compute_dtype.itemsize if compute_dtype is not None else 0)
    return len(GENERATIONS) * per_param * sum(layer_numels)


def _check_numels(layer_numels: list[int]) -> None:
    bad = [(i, n) for i, n in enumerate(layer_numels) if not isinstance(n, int) or isinstance(n, bool) or n < 0]
    if bad:
        raise StoreError(f"layer parameter counts must be ints >= 0; got {bad[:3]} (layer, count)")
