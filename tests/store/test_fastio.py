"""The store's direct chunk I/O: in-place overwrites round-trip, stay zarr-readable, fail their CRC when torn,
and fall back to temp + rename where in-place does not apply."""

from __future__ import annotations

import errno
import os
import subprocess

import crc32c
import numpy as np
import pytest
import torch
import zarr
from mtc.store import TensorStore, fastio
from mtc.store.fastio import aligned_empty, read_chunk_file, write_chunk_file

from mtc.errors import StoreCorruptionError, StoreError

CH = 64 * 1024  # a small page-multiple chunk: fast, and the O_DIRECT path still applies


def _aligned(n: int, seed: int) -> np.ndarray:
    a = aligned_empty(n)
    a[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return a


@pytest.mark.parametrize("n", [CH, CH - 4096, CH - 100])  # whole chunk, page-multiple edge, unaligned edge
@pytest.mark.parametrize("aligned", [True, False])
def test_in_place_overwrite_round_trips_and_keeps_the_file(tmp_path, n, aligned):
    path = tmp_path / "c" / "0"
    assert write_chunk_file(path, CH, _aligned(CH, 1), in_place=True) is False  # no file yet: temp + rename
    ino = os.stat(path).st_ino
    data = _aligned(n, 2) if aligned else np.random.default_rng(2).integers(0, 256, n + 1, dtype=np.uint8)[1:]
    assert write_chunk_file(path, CH, data, in_place=True) is True
    assert os.stat(path).st_ino == ino and os.path.getsize(path) == CH + 4
    out = aligned_empty(CH)
    assert read_chunk_file(path, CH, out) is None
    assert np.array_equal(out[:n], data) and not out[n:].any()  # the edge's fill is zeros, as zarr pads
    assert list((tmp_path / "c").iterdir()) == [path]  # no temporary file left behind


def test_in_place_falls_back_to_rename_for_a_file_of_the_wrong_size(tmp_path):
    path = tmp_path / "0"
    path.write_bytes(b"x" * 100)
    ino = os.stat(path).st_ino
    data = _aligned(CH, 3)
    assert write_chunk_file(path, CH, data, in_place=True) is False
    assert os.stat(path).st_ino != ino
    out = aligned_empty(CH)
    assert read_chunk_file(path, CH, out) is None and np.array_equal(out, data)


def test_in_place_never_writes_through_a_hard_link(tmp_path):
    path, snapshot = tmp_path / "0", tmp_path / "snapshot"
    old = _aligned(CH, 6)
    write_chunk_file(path, CH, old)
    os.link(path, snapshot)
    assert write_chunk_file(path, CH, _aligned(CH, 7), in_place=True) is False  # replaced, not overwritten
    out = aligned_empty(CH)
    assert read_chunk_file(snapshot, CH, out) is None and np.array_equal(out, old)


def test_a_torn_in_place_write_fails_its_crc(tmp_path):
    path = tmp_path / "0"
    write_chunk_file(path, CH, _aligned(CH, 4))
    write_chunk_file(path, CH, _aligned(CH, 5), in_place=True)
    with open(path, "r+b") as f:  # as if the write had stopped after its first page: old bytes after it
        f.seek(8192)
        f.write(_aligned(4096, 4).tobytes())
    assert "CRC32C" in read_chunk_file(path, CH, aligned_empty(CH))


@pytest.fixture(params=["direct", "buffered"])
def local_store(request, tmp_path, monkeypatch):
    if request.param == "buffered":  # a file system that refuses O_DIRECT (tmpfs): the buffered fallback
        monkeypatch.setattr(fastio, "_direct_refused", {os.stat(tmp_path).st_dev})
    st = TensorStore.create(tmp_path / "s", io_threads=3)
    yield st
    st.close()


def test_store_in_place_writes_are_zarr_readable_and_checked(local_store):
    st = local_store
    numel = 3 * 2**20 // 4 + 100  # 16 MiB chunks would make one edge chunk; force three chunks of 1 MiB
    st.create_array("layers/0000/master/g1", (numel,), torch.float32, chunk_rows=2**18)
    name = "layers/0000/master/g1"
    paths = [st.chunk_path(name, c) for c in range(st.array_info(name).n_chunks)]
    first = torch.randn(numel)
    st.write_async(name, first, in_place=True).result()  # the first write creates the files
    inodes = [os.stat(p).st_ino for p in paths]
    second = torch.from_numpy(aligned_empty(numel * 4).view(np.float32))
    second.copy_(torch.randn(numel))
    st.write_async(name, second, in_place=True).result()
    assert [os.stat(p).st_ino for p in paths] == inodes  # overwritten, not replaced
    assert torch.equal(st.read(name), second)
    z = zarr.open_array(store=str(st.path), path=name, mode="r")  # zarr's own reader, its own CRC32C check
    assert np.array_equal(z[:], second.numpy())
    with open(paths[1], "r+b") as f:  # one flipped byte in the middle chunk
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(StoreCorruptionError, match=r"chunk 1 failed its CRC32C"):
        st.read(name)


def test_default_writes_still_replace_the_chunk_file(local_store):
    st = local_store
    st.create_array("w", (2**16,), torch.float32)
    st.write("w", torch.ones(2**16))
    ino = os.stat(st.chunk_path("w", 0)).st_ino
    st.write("w", torch.zeros(2**16))
    assert os.stat(st.chunk_path("w", 0)).st_ino != ino  # atomic replacement unless the caller asks for in place
    assert not st.read("w").any()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_chunk_write_that_fills_the_disk_part_way_says_no_space_left(tmp_path):
    # a few blocks free: the first write is short, not refused; the error must still say why
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        st = TensorStore.create(mnt / "s")
        st.create_array("layers/0000/master/g0", (CH // 4,), torch.float32)
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        (mnt / "filler").write_bytes(b"\0" * (free - 16384))  # leave 4 pages: less than the 64 KiB chunk
        with pytest.raises(OSError) as e:
            write_chunk_file(mnt / "raw", CH, _aligned(CH, 8))
        assert e.value.errno == errno.ENOSPC, e.value
        with pytest.raises(StoreError, match=r"writing chunk 0 of array 'layers/0000/master/g0' .* no space left on device; free space"):
            st.write("layers/0000/master/g0", torch.randn(CH // 4))
        assert [p.name for p in (mnt / "s/layers/0000/master/g0").rglob("*.partial")] == []  # the temp file is gone
        st.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _at_most_100_bytes(real):
    """``real`` (os.preadv or os.pwritev) on a file system that moves at most 100 bytes a call."""
    def short(fd, views, offset):
        head, left = [], 100
        for v in views:
            b = memoryview(v).cast("B")[:left]
            head.append(b)
            left -= len(b)
            if not left:
                break
        return real(fd, head, offset)

    return short


def test_short_writes_are_continued_byte_for_byte_whatever_the_views_item_size(tmp_path, monkeypatch):
    monkeypatch.setattr(fastio.os, "pwritev", _at_most_100_bytes(os.pwritev))
    data = np.arange(300, dtype=np.float32)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert fastio._pwritev_full(fd, [memoryview(data), memoryview(np.full(7, 9, np.uint8))], tmp_path / "f") == 1207
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data.tobytes() + bytes([9] * 7)


def test_short_reads_are_continued_byte_for_byte_whatever_the_views_item_size(tmp_path, monkeypatch):
    want = np.arange(300, dtype=np.float32)
    (tmp_path / "f").write_bytes(want.tobytes() + bytes([9] * 7))
    monkeypatch.setattr(fastio.os, "preadv", _at_most_100_bytes(os.preadv))
    got, tail = np.zeros(300, dtype=np.float32), np.zeros(7, np.uint8)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert fastio._readv_full(fd, [memoryview(got), memoryview(tail)], 1207, direct=False) == 1207
        # past the end of the file: what is there, no more
        assert fastio._readv_full(fd, [memoryview(np.zeros(400, np.float32))], 1600, direct=False, pos=0) == 1207
    finally:
        os.close(fd)
    assert np.array_equal(got, want) and tail.tolist() == [9] * 7


@pytest.mark.parametrize("chunk", [CH, CH - 100])  # a page-multiple chunk (edge chunks padded), an odd-sized one
@pytest.mark.parametrize("in_place", [False, True])
def test_unaligned_parts_go_through_a_bounce_of_bounded_size(tmp_path, monkeypatch, chunk, in_place):
    """A chunk's part that is not whole pages of page-aligned memory goes through the I/O thread's
    bounce buffer, which each thread keeps for the run and host RAM does not count: it moves in
    pieces of at most BOUNCE_MAX, and the whole pages of aligned memory not at all (a layer of an
    odd vocabulary size took a chunk-sized buffer per thread, up to 16 MiB each)."""
    cap = 3 * 4096  # a few pages, so every path below takes several pieces
    monkeypatch.setattr(fastio, "BOUNCE_MAX", cap, raising=False)
    monkeypatch.setattr(fastio, "_tls", type(fastio._tls)())  # no buffer left from an earlier test
    asked: list[int] = []
    real = fastio._bounce
    monkeypatch.setattr(fastio, "_bounce", lambda n: (asked.append(real(n).nbytes), real(n))[1])
    path = tmp_path / "0"
    rng = np.random.default_rng(11)
    for n in sorted({chunk, chunk - 4096, chunk - 100, 5000, 100}):
        for aligned in (True, False):
            data = _aligned(n, n) if aligned else rng.integers(0, 256, n + 1, dtype=np.uint8)[1:]
            write_chunk_file(path, chunk, data, in_place=in_place)
            whole = np.concatenate([data, np.zeros(chunk - n, np.uint8)])  # zarr's edge chunk: zero-filled
            assert path.read_bytes() == whole.tobytes() + crc32c.crc32c(whole).to_bytes(4, "little"), (n, aligned)
            for offset, m in ((0, chunk), (0, n - n % 4096), (100, n - 100), (0, 0)):
                out = aligned_empty(m) if aligned else np.zeros(m + 1, np.uint8)[1:]
                assert read_chunk_file(path, chunk, out, offset) is None
                assert np.array_equal(out, whole[offset : offset + m]), (n, aligned, offset, m)
    assert max(asked) <= cap
    if chunk % 4096 == 0:  # whole pages of aligned memory never touch the bounce: only the tails did
        asked.clear()
        write_chunk_file(path, chunk, _aligned(chunk, 1), in_place=in_place)
        assert read_chunk_file(path, chunk, aligned_empty(chunk)) is None
        assert max(asked) <= 4096  # the CRC's page


def test_a_bounced_chunk_that_fails_its_crc_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(fastio, "BOUNCE_MAX", 4096, raising=False)
    path = tmp_path / "0"
    write_chunk_file(path, CH - 100, np.zeros(CH - 99, np.uint8)[1:] + 7)
    raw = bytearray(path.read_bytes())
    raw[CH // 2] ^= 1
    path.write_bytes(bytes(raw))
    assert "failed its CRC32C" in read_chunk_file(path, CH - 100, np.zeros(CH - 100, np.uint8))

