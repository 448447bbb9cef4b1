"""mtc.store: the zarr v3 tensor store (the only package that imports zarr)."""

from mtc.store.directory import DURABILITY_MODES, CommitRecord
from mtc.store.layout import (
    GENERATIONS,
    KINDS,
    LAYOUT_ATTR,
    STATE_DTYPE,
    create_layer_state,
    layer_state_nbytes,
    other_generation,
    state_array_name,
)
from mtc.store.tensor_store import SUPPORTED_DTYPES, ArrayInfo, TensorStore
from mtc.store.verify import REQUIRED_KINDS, Problem, RepairReport, VerifyReport, repair, verify

__all__ = [
    "DURABILITY_MODES",
    "GENERATIONS",
    "KINDS",
    "LAYOUT_ATTR",
    "REQUIRED_KINDS",
    "STATE_DTYPE",
    "SUPPORTED_DTYPES",
    "ArrayInfo",
    "CommitRecord",
    "Problem",
    "RepairReport",
    "TensorStore",
    "VerifyReport",
    "create_layer_state",
    "layer_state_nbytes",
    "other_generation",
    "repair",
    "state_array_name",
    "verify",
]
