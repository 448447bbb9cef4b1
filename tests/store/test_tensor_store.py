"""The tensor store on a local directory and in memory: round trips, checks, corruption, lock, commits."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from mtc.errors import StoreCorruptionError, StoreError, StoreLockedError
from mtc.store import CommitRecord, TensorStore, create_layer_state, state_array_name


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path):
    st = TensorStore.create(None if request.param == "memory" else tmp_path / "s", io_threads=3)
    yield st
    st.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.uint8])
def test_round_trip_every_dtype_bit_exact(store, dtype):
    src = (torch.randn(37, 5) * 100).to(dtype)
    store.create_array("a", (37, 5), dtype, chunk_rows=8)  # 5 chunks, the last ragged
    store.write("a", src)
    out = torch.empty(37, 5, dtype=dtype)
    store.read_into("a", out)
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8)) if dtype != torch.uint8 else torch.equal(out, src)
    assert store.array_info("a").dtype == dtype and store.array_info("a").n_chunks == 5


def test_odd_shapes_and_row_ranges(store):
    for name, shape in [("one", (1,)), ("wide", (5, 123)), ("flat", (1001,))]:
        store.create_array(name, shape, torch.float32, chunk_rows=64)
        t = torch.randn(shape)
        store.write(name, t)
        assert torch.equal(store.read(name), t)
    part = torch.randn(100)
    store.write_rows("flat", 60, part)  # straddles chunks 0 and 1
    out = torch.empty(130)
    store.read_rows_into("flat", 40, out)
    assert torch.equal(out[20:120], part)


def test_write_checks_shape_and_dtype(store):
    store.create_array("w", (10, 4), torch.float32)
    with pytest.raises(StoreError, match="'w'.*shape"):
        store.write("w", torch.zeros(11, 4))  # zarr would silently truncate
    with pytest.raises(StoreError, match="'w'.*shape"):
        store.write("w", torch.zeros(10, 5))
    with pytest.raises(StoreError, match="'w'.*dtype"):
        store.write("w", torch.zeros(10, 4, dtype=torch.float64))  # zarr would silently cast
    with pytest.raises(StoreError, match="do not fit"):
        store.write_rows("w", 8, torch.zeros(3, 4))
    with pytest.raises(StoreError, match="out buffer"):
        store.read_into("w", torch.empty(10, 4, dtype=torch.float16))
    with pytest.raises(StoreError, match="out buffer"):
        store.read_into("w", torch.empty(4, 10).t())  # not contiguous
    with pytest.raises(StoreError, match="already exists"):
        store.create_array("w", (10, 5), torch.float32)
    store.create_array("w", (10, 4), torch.float32)  # same shape and dtype: fine
    with pytest.raises(StoreError, match="no array 'nope'"):
        store.read("nope")


def test_zero_arrays_are_written_not_implied(tmp_path):
    with TensorStore.create(tmp_path / "s") as st:
        st.create_array("z", (40,), torch.float32, chunk_rows=16)
        st.write("z", torch.zeros(40))
        assert all(st.chunk_path("z", c).is_file() for c in range(3))


def test_corrupt_chunk_names_array_and_chunk(tmp_path):
    with TensorStore.create(tmp_path / "s") as st:
        st.create_array("layers/0001/master/g0", (64,), torch.float32, chunk_rows=16)
        st.write("layers/0001/master/g0", torch.randn(64))
        path = st.chunk_path("layers/0001/master/g0", 2)
        raw = bytearray(path.read_bytes())
        raw[5] ^= 0x40
        path.write_bytes(bytes(raw))
        with pytest.raises(StoreCorruptionError) as e:
            st.read("layers/0001/master/g0")
        assert "layers/0001/master/g0" in str(e.value) and "chunk 2" in str(e.value)
        st.chunk_path("layers/0001/master/g0", 1).unlink()
        with pytest.raises(StoreCorruptionError, match="chunk 1 is missing"):
            st.read_into("layers/0001/master/g0", torch.empty(64))


def test_second_writer_refused(tmp_path):
    st = TensorStore.create(tmp_path / "s")
    with pytest.raises(StoreLockedError, match="in use"):
        TensorStore.open(tmp_path / "s")
    code = "import sys\nfrom mtc.store import TensorStore\ntry:\n TensorStore.open(sys.argv[1])\nexcept Exception as e:\n print(type(e).__name__, e)"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("StoreLockedError") and "pid" in out.stdout
    st.close()
    st.close()  # idempotent
    TensorStore.open(tmp_path / "s").close()  # the lock is released


def test_create_refuses_non_empty_dir(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "precious.txt").write_text("x")
    with pytest.raises(StoreError, match="not empty"):
        TensorStore.create(tmp_path / "s")
    with pytest.raises(StoreError, match="not an mtc store"):
        TensorStore.open(tmp_path / "s")


def test_commits_are_atomic_and_resume(tmp_path):
    rec = CommitRecord(step=3, generation=1, data_cursor=6, rng_state={"torch": "AA=="}, config={"steps": 9}, time_unix=1.5)
    with TensorStore.create(tmp_path / "s") as st:
        assert st.last_commit() is None
        st.commit(rec)
        st.commit(dataclasses.replace(rec, step=4, generation=0, data_cursor=8, time_unix=2.0))
        assert not (tmp_path / "s" / "commit.json.tmp").exists()
    with TensorStore.open(tmp_path / "s") as st:
        assert st.last_commit().step == 4 and st.last_commit().generation == 0
        assert [c.step for c in st.commit_history()] == [3, 4]
    (tmp_path / "s" / "commit.json").write_text("{not json")
    with pytest.raises(StoreCorruptionError, match="commit.json"):
        TensorStore.open(tmp_path / "s")


def test_layer_state_layout(store):
    create_layer_state(store, [10, 0, 7], compute_dtype=torch.bfloat16)
    names = store.array_names()
    assert state_array_name(0, "master", 1) == "layers/0000/master/g1"
    for g in (0, 1):
        for kind in ("master", "m", "v"):
            assert store.array_info(state_array_name(2, kind, g)).shape == (7,)
        assert store.array_info(state_array_name(0, "compute", g)).dtype == torch.bfloat16
    assert not any(n.startswith("layers/0001") for n in names), "a layer with no parameters has no state"
    with pytest.raises(StoreError, match="unknown state kind"):
        state_array_name(0, "grad", 0)


def test_async_write_and_read(store):
    store.create_array("a", (300,), torch.float32, chunk_rows=64)
    src = torch.randn(300)
    store.write_async("a", src).result()
    out = torch.empty(300)
    store.read_into_async("a", out).result()
    assert torch.equal(out, src)
    with pytest.raises(StoreError, match="shape"):
        store.write_async("a", torch.zeros(3)).result()
