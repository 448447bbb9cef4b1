"""Names and double-buffered generations of the per-layer training state."""

from __future__ import annotations

import pytest
import torch
from mtc.store import KINDS, TensorStore, create_layer_state, layer_state_nbytes, other_generation, state_array_name

from mtc.errors import StoreError


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path):
    st = TensorStore.create(None if request.param == "memory" else tmp_path / "s", io_threads=2)
    yield st
    st.close()


def test_names():
    assert state_array_name(3, "master", 1) == "layers/0003/master/g1"
    assert state_array_name(12, "compute", 0) == "layers/0012/compute/g0"
    assert len({state_array_name(0, k, g) for k in KINDS for g in (0, 1)}) == 8
    assert other_generation(0) == 1 and other_generation(1) == 0
    with pytest.raises(StoreError, match="unknown state kind 'grad'; kinds are master, m, v, compute"):
        state_array_name(0, "grad", 0)
    with pytest.raises(StoreError, match="generation must be 0 or 1"):
        state_array_name(0, "m", 2)
    with pytest.raises(StoreError, match="layer index"):
        state_array_name(-1, "m", 0)
    with pytest.raises(StoreError, match="generation"):
        other_generation(2)


def test_create_layer_state_both_generations(store):
    numels = [10, 0, 7]
    create_layer_state(store, numels, compute_dtype=torch.bfloat16)
    for g in (0, 1):
        for kind in ("master", "m", "v"):
            info = store.array_info(state_array_name(2, kind, g))
            assert info.shape == (7,) and info.dtype == torch.float32
        assert store.array_info(state_array_name(0, "compute", g)).dtype == torch.bfloat16
    assert not any(n.startswith("layers/0001") for n in store.array_names()), "a layer with no parameters has no state"
    assert len(store.array_names()) == 2 * 2 * 4
    assert store.total_nbytes() == layer_state_nbytes(numels, compute_dtype=torch.bfloat16) == 2 * 17 * (3 * 4 + 2)
    create_layer_state(store, numels, compute_dtype=torch.bfloat16)  # again: a no-op
    with pytest.raises(StoreError, match="already exists"):
        create_layer_state(store, [11], compute_dtype=None)  # a different model in the same store


def test_generations_are_independent(store):
    create_layer_state(store, [6], compute_dtype=None)
    assert not store.has_array(state_array_name(0, "compute", 0))
    store.write(state_array_name(0, "master", 0), torch.ones(6))
    store.write(state_array_name(0, "master", 1), torch.full((6,), 2.0))
    assert torch.equal(store.read(state_array_name(0, "master", 0)), torch.ones(6))


def test_bad_numels():
    with pytest.raises(StoreError, match="parameter counts"):
        layer_state_nbytes([3, -1])
