"""mtc.store: the zarr v3 tensor store (the only package that imports zarr)."""

from mtc.store.layout import GENERATIONS, KINDS, create_layer_state, state_array_name
from mtc.store.tensor_store import ArrayInfo, CommitRecord, TensorStore

__all__ = ["TensorStore", "ArrayInfo", "CommitRecord", "state_array_name", "create_layer_state", "KINDS", "GENERATIONS"]
