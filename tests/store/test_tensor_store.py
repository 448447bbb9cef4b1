"""The tensor store on a local directory and in memory: round trips, checks, corruption, lock, commits."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from mtc.store import SUPPORTED_DTYPES, CommitRecord, TensorStore

from mtc.errors import StoreCorruptionError, StoreError, StoreLockedError


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path):
    st = TensorStore.create(None if request.param == "memory" else tmp_path / "s", io_threads=3)
    yield st
    st.close()


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=torch.int64).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _record(step: int, generation: int = 0) -> CommitRecord:
    return CommitRecord(
        step=step, generation=generation, data_cursor=2 * step, rng_state={"torch": "AA=="}, config={"steps": 9}, time_unix=1.5 + step
    )


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_round_trip_every_dtype_bit_exact(store, dtype):
    src = _random((37, 5), dtype)
    store.create_array("a", (37, 5), dtype, chunk_rows=8)  # 5 chunks, the last one ragged
    store.write("a", src)
    out = torch.full((37, 5), 7, dtype=dtype)
    store.read_into("a", out)
    assert torch.equal(_bits(out), _bits(src))
    info = store.array_info("a")
    assert (info.shape, info.dtype, info.chunk_rows, info.n_chunks) == ((37, 5), dtype, 8, 5)
    assert info.nbytes == src.numel() * src.element_size() == store.total_nbytes()


def test_bf16_is_stored_as_int16_bits(store):
    src = torch.tensor([1.0, -2.5, float("inf"), 3.0e38, 1e-40], dtype=torch.bfloat16)  # inf, huge, subnormal
    store.create_array("b", (5,), torch.bfloat16)
    store.write("b", src)
    got = store.read("b")
    assert got.dtype == torch.bfloat16 and torch.equal(_bits(got), _bits(src))


def test_odd_shapes(store):
    for name, shape, rows in [("one", (1,), None), ("wide", (5, 123), None), ("flat", (1001,), 64), ("empty", (0, 3), None)]:
        store.create_array(name, shape, torch.float32, chunk_rows=rows)
        t = torch.randn(shape)
        store.write(name, t)
        assert torch.equal(store.read(name), t), name
    assert store.array_info("flat").n_chunks == 16  # 15 full chunks of 64 and one of 41
    assert store.array_info("empty").n_chunks == 0
    assert store.array_names() == ["empty", "flat", "one", "wide"]


def test_default_chunks_are_about_16_mib(store):
    store.create_array("big", (2**23,), torch.float32)  # 32 MiB: metadata only, nothing written
    store.create_array("rows", (3000, 4096), torch.float32)  # 16 KiB rows
    store.create_array("bf", (2**23,), torch.bfloat16)
    assert store.array_info("big").chunk_rows * 4 == 16 * 2**20
    assert store.array_info("rows").chunk_rows == 1024
    assert store.array_info("bf").chunk_rows == 2**23  # 16 MiB of bf16 is the whole array
    assert store.array_info("big").n_chunks == 2


def test_parallel_read_of_many_chunks_into_preallocated_buffer(store):
    src = torch.randn(1000, 3)
    store.create_array("p", (1000, 3), torch.float32, chunk_rows=7)  # 143 chunks
    store.write("p", src)
    out = torch.full((1000, 3), float("nan"))
    store.read_into("p", out)
    assert torch.equal(out, src)
    io = [t for t in threading.enumerate() if t.name.startswith("mtc-store-io")]
    assert len(io) > 1, "the chunks should have been spread over several I/O threads"


def test_row_ranges(store):
    store.create_array("r", (100, 2), torch.int32, chunk_rows=16)
    base = _random((100, 2), torch.int32)
    store.write("r", base)
    part = _random((37, 2), torch.int32)
    store.write_rows("r", 10, part)  # starts and ends inside chunks 0 and 2
    expect = base.clone()
    expect[10:47] = part
    assert torch.equal(store.read("r"), expect)
    store.write_rows("r", 32, base[32:48])  # exactly chunk 2
    expect[32:48] = base[32:48]
    out = torch.empty(61, 2, dtype=torch.int32)
    store.read_rows_into("r", 39, out)  # to the last row
    assert torch.equal(out, expect[39:])
    store.read_rows_into("r", 5, out[:0])  # zero rows: nothing to do, no error


def test_writes_accept_non_contiguous_tensors(store):
    src = torch.randn(6, 4)
    store.create_array("t", (4, 6), torch.float32, chunk_rows=3)
    store.write("t", src.t())  # a transposed view: copied to contiguous first
    assert torch.equal(store.read("t"), src.t())


def test_async_write_and_read(store):
    store.create_array("a", (300,), torch.float32, chunk_rows=64)
    src = torch.randn(300)
    store.write_async("a", src).result()
    out = torch.empty(300)
    fut = store.read_into_async("a", out)
    assert fut.result() is None and torch.equal(out, src)
    with pytest.raises(StoreError, match="'a'.*shape"):
        store.write_async("a", torch.zeros(3))  # bad arguments raise at once, not in the Future


def test_close_waits_for_pending_writes(tmp_path):
    st = TensorStore.create(tmp_path / "s", io_threads=2)
    st.create_array("x", (4096,), torch.float32, chunk_rows=128)
    src = torch.randn(4096)
    fut = st.write_async("x", src)
    st.commit(_record(1))  # a store opens only once committed
    st.close()
    assert fut.done() and fut.exception() is None
    with TensorStore.open(tmp_path / "s") as st:
        assert torch.equal(st.read("x"), src)


# -- checks ------------------------------------------------------------------------------------


def test_write_checks_shape_and_dtype(store):
    store.create_array("w", (10, 4), torch.float32)
    with pytest.raises(StoreError, match=r"'w'.*shape \(11, 4\), expected \(10, 4\)"):
        store.write("w", torch.zeros(11, 4))  # zarr would silently drop the 11th row
    with pytest.raises(StoreError, match=r"'w'.*shape \(10, 5\)"):
        store.write("w", torch.zeros(10, 5))
    with pytest.raises(StoreError, match=r"'w'.*shape \(4,\)"):
        store.write("w", torch.zeros(4))  # zarr would broadcast it
    with pytest.raises(StoreError, match="'w'.*dtype torch.float64.*torch.float32"):
        store.write("w", torch.zeros(10, 4, dtype=torch.float64))  # zarr would silently cast
    with pytest.raises(StoreError, match=r"'w'.*rows \[8, 8\+3\) do not fit its 10 rows"):
        store.write_rows("w", 8, torch.zeros(3, 4))
    with pytest.raises(StoreError, match="'w'.*do not fit"):
        store.write_rows("w", -1, torch.zeros(1, 4))
    store.create_array("h", (4,), torch.bfloat16)
    with pytest.raises(StoreError, match="'h'.*dtype torch.int16"):
        store.write("h", torch.zeros(4, dtype=torch.int16))  # same bits on disk, still refused


def test_read_checks_out_buffer(store):
    store.create_array("w", (10, 4), torch.float32)
    store.write("w", torch.ones(10, 4))
    for bad in [torch.empty(10, 4, dtype=torch.float16), torch.empty(10, 5), torch.empty(40), torch.empty(4, 10).t()]:
        with pytest.raises(StoreError, match=r"'w'.*shape \(10, 4\) and dtype torch.float32"):
            store.read_into("w", bad)
    with pytest.raises(StoreError, match=r"'w'.*do not fit"):
        store.read_rows_into("w", 8, torch.empty(3, 4))
    with pytest.raises(StoreError, match=r"'w'.*shape \(2, 4\)"):
        store.read_rows_into("w", 0, torch.empty(2, 3))


def test_create_array_checks(store):
    store.create_array("w", (10, 4), torch.float32, chunk_rows=4)
    store.write("w", torch.ones(10, 4))
    store.create_array("w", (10, 4), torch.float32)  # same shape and dtype: a no-op ...
    assert torch.equal(store.read("w"), torch.ones(10, 4))  # ... that keeps the data
    with pytest.raises(StoreError, match=r"'w' already exists with shape \(10, 4\) and dtype torch.float32.*\(10, 5\)"):
        store.create_array("w", (10, 5), torch.float32)
    with pytest.raises(StoreError, match="'w' already exists.*torch.float16"):
        store.create_array("w", (10, 4), torch.float16)
    with pytest.raises(StoreError, match="chunk_rows 4, not 5"):
        store.create_array("w", (10, 4), torch.float32, chunk_rows=5)
    with pytest.raises(StoreError, match="float64 is not supported"):
        store.create_array("d", (3,), torch.float64)
    for bad in ["", "/a", "a//b", ".hidden", "commit.json", "a b"]:
        with pytest.raises(StoreError, match="bad array name"):
            store.create_array(bad, (3,), torch.float32)
    with pytest.raises(StoreError, match="shape"):
        store.create_array("z", (3, 0), torch.float32)
    with pytest.raises(StoreError, match="no array 'nope'"):
        store.read("nope")
    assert store.has_array("w") and not store.has_array("nope")


# -- durability and corruption ------------------------------------------------------------------


def test_zero_chunks_are_written_also_after_reopen(tmp_path):
    with TensorStore.create(tmp_path / "s") as st:
        st.create_array("z", (40,), torch.float32, chunk_rows=16)
        st.write("z", torch.zeros(40))
        assert all(st.chunk_path("z", c).is_file() for c in range(3))
        st.commit(_record(1))
    with TensorStore.open(tmp_path / "s") as st:
        # zarr ignores open_array(config=...) in 3.1 and would delete a chunk overwritten with zeros
        st.write("z", torch.ones(40))
        st.write("z", torch.zeros(40))
        assert all(st.chunk_path("z", c).is_file() for c in range(3))
        assert torch.equal(st.read("z"), torch.zeros(40))


def test_zero_chunks_are_written_in_memory(store):
    store.create_array("z", (40,), torch.float32, chunk_rows=16)
    store.write("z", torch.zeros(40))
    assert torch.equal(store.read("z"), torch.zeros(40))  # a skipped chunk would read as "missing"


def test_never_written_array_reads_as_missing_not_zeros(store):
    store.create_array("n", (20,), torch.float32, chunk_rows=8)
    with pytest.raises(StoreCorruptionError, match="'n' chunk 0 is missing"):
        store.read("n")


def _flip(path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


def test_corrupt_chunk_names_array_chunk_and_file(tmp_path):
    name = "layers/0001/master/g0"
    with TensorStore.create(tmp_path / "s") as st:
        st.create_array(name, (64,), torch.float32, chunk_rows=16)
        src = torch.randn(64)
        st.write(name, src)
        path = st.chunk_path(name, 2)
        assert path.is_file() and path.is_relative_to(tmp_path / "s")
        _flip(path, 5)
        with pytest.raises(StoreCorruptionError) as e:
            st.read(name)
        msg = str(e.value)
        assert name in msg and "chunk 2" in msg and str(path) in msg and "restore" in msg
        # a run's store may still hold a whole earlier commit: the message points at verify and repair
        assert f"`mtc repair {tmp_path / 's'}` rolls back" in msg and f"`mtc verify {tmp_path / 's'}`" in msg
        out = torch.empty(32)
        st.read_rows_into(name, 0, out)  # the intact chunks still read
        assert torch.equal(out, src[:32])
        with pytest.raises(StoreCorruptionError, match="chunk 2"):
            st.read_into_async(name, torch.empty(64)).result()  # through the Future too


def test_truncated_and_missing_chunks(tmp_path):
    with TensorStore.create(tmp_path / "s") as st:
        st.create_array("x", (64, 2), torch.bfloat16, chunk_rows=16)
        st.write("x", torch.randn(64, 2).bfloat16())
        p1 = st.chunk_path("x", 1)
        p1.write_bytes(p1.read_bytes()[:10])
        with pytest.raises(StoreCorruptionError, match="'x' chunk 1"):
            st.read("x")
        st.chunk_path("x", 3).unlink()
        with pytest.raises(StoreCorruptionError, match=r"'x' chunk 3 is missing \(.*c/3/0\)"):
            st.read_rows_into("x", 48, torch.empty(16, 2, dtype=torch.bfloat16))


def test_chunk_path(store):
    store.create_array("q", (30, 2), torch.float32, chunk_rows=10)
    if store.is_memory:
        assert store.chunk_path("q", 0) is None and store.path is None
    else:
        assert store.chunk_path("q", 2) == store.path / "q" / "c" / "2" / "0"
    with pytest.raises(StoreError, match="chunks 0..2, not 3"):
        store.chunk_path("q", 3)


# -- creating, opening, locking ------------------------------------------------------------------


def test_creating_a_store_another_run_just_committed_and_holds_names_the_holder(tmp_path):
    # `mtc train` started twice: the second decided "new run" before the first committed step 0;
    # "resume it with the same command" would be wrong while the first still runs
    held = TensorStore.create(tmp_path / "s")
    held.commit(_record(0))
    code = "import sys\nfrom mtc.store import TensorStore\ntry:\n TensorStore.create(sys.argv[1])\nexcept Exception as e:\n print(type(e).__name__, e)"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.startswith("StoreLockedError") and f"locked by pid {os.getpid()}" in out.stdout, out.stdout + out.stderr
    held.close()
    with pytest.raises(StoreError, match="already holds a committed mtc store; resume it") as e:  # no holder: resume
        TensorStore.create(tmp_path / "s")
    assert not isinstance(e.value, StoreLockedError)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x").write_text("x")
    with pytest.raises(StoreError, match="not empty"):
        TensorStore.create(tmp_path / "foreign")
    assert not (tmp_path / "foreign" / ".lock").exists()  # no lock file left in a directory that is not ours


def test_second_handle_and_second_process_are_refused(tmp_path):
    st = TensorStore.create(tmp_path / "s")
    with pytest.raises(StoreLockedError, match=f"{tmp_path / 's'} is locked by this process \\(pid {os.getpid()}\\)"):
        TensorStore.open(tmp_path / "s")
    with pytest.raises(StoreLockedError):
        TensorStore.create(tmp_path / "s", overwrite=True)  # must not wipe a store in use
    code = "import sys\nfrom mtc.store import TensorStore\ntry:\n TensorStore.open(sys.argv[1])\nexcept Exception as e:\n print(type(e).__name__, e)"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.startswith("StoreLockedError"), out.stdout + out.stderr
    assert f"pid {os.getpid()}" in out.stdout and "another store directory" in out.stdout
    st.commit(_record(1))
    st.close()
    st.close()  # idempotent
    with TensorStore.open(tmp_path / "s") as again:  # the lock is released
        assert again.path == tmp_path / "s"
    with pytest.raises(StoreError, match="closed"):
        st.read("x")


def test_create_and_open_refusals(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "precious.txt").write_text("x")
    with pytest.raises(StoreError, match="not empty.*precious.txt.*overwrite"):
        TensorStore.create(tmp_path / "s")
    with pytest.raises(StoreError, match="refusing to overwrite"):
        TensorStore.create(tmp_path / "s", overwrite=True)
    assert (tmp_path / "s" / "precious.txt").read_text() == "x"
    with pytest.raises(StoreError, match="not an mtc store.*TensorStore.create"):
        TensorStore.open(tmp_path / "s")
    with pytest.raises(StoreError, match="does not exist.*TensorStore.create"):
        TensorStore.open(tmp_path / "nowhere")
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        TensorStore.create(tmp_path / "f")
    with pytest.raises(StoreError, match="io_threads"):
        TensorStore.create(None, io_threads=0)


def test_overwrite_replaces_a_store(tmp_path):
    with TensorStore.create(tmp_path / "s") as st:
        st.create_array("old", (3,), torch.float32)
        st.commit(_record(1))
    with TensorStore.create(tmp_path / "s", overwrite=True) as st:
        assert st.array_names() == [] and st.last_commit() is None
        assert (tmp_path / "s" / ".lock").read_text().strip() == str(os.getpid())
        st.commit(_record(2))
    with TensorStore.open(tmp_path / "s") as st:
        assert st.array_names() == []


def test_reopen_keeps_arrays_and_ignores_other_files(tmp_path):
    with TensorStore.create(tmp_path / "s") as st:
        st.create_array("layers/0000/master/g0", (5,), torch.float32)
        st.write("layers/0000/master/g0", torch.arange(5.0))
        st.commit(_record(1))
    (tmp_path / "s" / "plan").mkdir()  # the runtime keeps its plan and logs beside the arrays
    (tmp_path / "s" / "plan" / "manifest.json").write_text("{}")
    with TensorStore.open(tmp_path / "s") as st:
        assert st.array_names() == ["layers/0000/master/g0"]
        assert torch.equal(st.read("layers/0000/master/g0"), torch.arange(5.0))


# -- commits -----------------------------------------------------------------------------------


def test_commits_are_atomic_and_resume(tmp_path):
    with TensorStore.create(tmp_path / "s") as st:
        assert st.last_commit() is None and st.commit_history() == []
        st.commit(_record(3, 1))
        assert CommitRecord.from_json((tmp_path / "s" / "commit.json").read_text()) == dataclasses.replace(_record(3, 1), rng_state={})
        st.commit(_record(4, 0))
        assert not (tmp_path / "s" / "commit.json.tmp").exists()
        assert st.last_commit() == _record(4, 0)
    with TensorStore.open(tmp_path / "s") as st:
        assert st.last_commit() == _record(4, 0)
        assert [c.step for c in st.commit_history()] == [3, 4]
        st.commit(dataclasses.replace(_record(5, 1), extra={"loss": 2.5}))
        assert [c.step for c in st.commit_history()] == [3, 4, 5]
        assert st.commit_history()[-1].extra == {"loss": 2.5}


def test_torn_history_line_is_skipped(tmp_path):
    with TensorStore.create(tmp_path / "s") as st:
        st.commit(_record(1))
        with open(tmp_path / "s" / "commits.jsonl", "a") as f:
            f.write('{"step": 2, "gener')  # a crash mid-append
        st.commit(_record(3))
        assert [c.step for c in st.commit_history()] == [1, 3]


def test_malformed_commit_json_is_corruption(tmp_path):
    with TensorStore.create(tmp_path / "s") as st:
        st.commit(_record(1))
    for text in ["{not json", json.dumps({**json.loads(_record(1).to_json()), "step": "one"}), "[]"]:
        (tmp_path / "s" / "commit.json").write_text(text)
        # the store still opens (to inspect or repair it), but its last commit is refused
        with TensorStore.open(tmp_path / "s") as st, pytest.raises(StoreCorruptionError, match="commit.json"):
            st.last_commit()


def test_memory_store_commits(store):
    store.commit(_record(1))
    store.commit(_record(2, 1))
    assert store.last_commit() == _record(2, 1)
    assert [c.step for c in store.commit_history()] == [1, 2]


def test_commit_record_json_round_trip_and_checks():
    rec = dataclasses.replace(_record(7, 1), extra={"note": [1, 2]})
    assert CommitRecord.from_json(rec.to_json()) == rec
    assert "\n" not in rec.to_json()
    d = json.loads(rec.to_json())
    for bad in [
        {**d, "generation": True},
        {**d, "rng_state": {"torch": 3}},
        {k: v for k, v in d.items() if k != "step"},
        {**d, "surprise": 1},
    ]:
        with pytest.raises((ValueError, TypeError)):
            CommitRecord.from_json(json.dumps(bad))


def test_opening_a_directory_that_is_no_store_says_what_to_give(tmp_path):
    """To write: how to create one; read-only (inspect, eval, export): the directory a run wrote."""
    (tmp_path / "txt").mkdir()
    with pytest.raises(StoreError, match=r"txt is not an mtc store .*create one with TensorStore.create"):
        TensorStore.open(tmp_path / "txt")
    with pytest.raises(StoreError, match=r"txt is not an mtc store .*give the directory a training run wrote") as e:
        TensorStore.open(tmp_path / "txt", read_only=True)
    assert "create" not in str(e.value)
