"""mtc.store: the zarr v3 tensor store (the only package that imports zarr)."""

from mtc.store.layout import (
    GENERATIONS,
    KINDS,
    STATE_DTYPE,
    create_layer_state,
    layer_state_nbytes,
    other_generation,
    state_array_name,
)
from mtc.store.tensor_store import SUPPORTED_DTYPES, ArrayInfo, CommitRecord, TensorStore

__all__ = [
    "GENERATIONS",
    "KINDS",
    "STATE_DTYPE",
    "SUPPORTED_DTYPES",
    "ArrayInfo",
    "CommitRecord",
    "TensorStore",
    "create_layer_state",
    "layer_state_nbytes",
    "other_generation",
    "state_array_name",
]
