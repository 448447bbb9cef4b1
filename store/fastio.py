"""Fast chunk I/O for the tensor store: direct I/O around zarr's page cache, and a priority pool.

zarr's LocalStore reads a chunk file into fresh bytes, decodes it into a second buffer and copies
it into the caller's; every byte also passes through the page cache. For the disk tier, which
moves ~24 bytes per parameter every step, that costs CPU time the optimizer needs and fills host
RAM with cached state (the very thing the tier exists to avoid). This module reads and writes the
chunk files of the store's own arrays directly, in the same on-disk format zarr writes and reads
(``bytes`` codec, little-endian, followed by the ``crc32c`` codec's 4-byte checksum), so the store
stays a plain zarr v3 store and every chunk is still checksummed:

* reads use ``O_DIRECT`` into the caller's buffer when it is page-aligned (pinned memory and the
  disk tier's buffers are), its whole pages at least; the rest goes through a per-thread aligned
  bounce buffer of at most ``BOUNCE_MAX`` bytes, a piece at a time; the CRC32C is checked before
  the data counts as read;
* writes go to a temporary file with ``O_DIRECT``, are fsynced and renamed over the chunk (atomic,
  as zarr's own writes), or, where the caller allows it (``in_place``: the disk tier's uncommitted
  generation), overwrite the existing chunk file directly: no allocation, no rename;
* where ``O_DIRECT`` is refused (tmpfs, some network file systems) the same calls run buffered
  and drop the file's pages afterwards (``posix_fadvise(DONTNEED)``), so caches stay cold.

`PriorityPool` is the store's I/O thread pool: jobs carry a priority, so reads that gate the next
forward run ahead of read-ahead, which runs ahead of write-behind.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import mmap
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import crc32c
import numpy as np

__all__ = [
    "ALIGN",
    "PRIORITY_READ",
    "PRIORITY_READ_AHEAD",
    "PRIORITY_WRITE",
    "PriorityPool",
    "aligned_empty",
    "bounce_bytes",
    "is_aligned",
    "read_chunk_file",
    "write_chunk_file",
]

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses (the page size covers every disk)
PRIORITY_READ = 0  # a read the next layer visit waits for
PRIORITY_READ_AHEAD = 1  # a read for an update that comes later
PRIORITY_WRITE = 2  # write-behind: needed only by the next commit
_CRC = 4
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_direct_refused: set[int] = set()  # st_dev of file systems that refused O_DIRECT (EINVAL): buffered there
_tls = threading.local()
# what a thread's bounce buffer may grow to (a page multiple): every I/O thread keeps its own for the
# run, and host RAM counts none of them, so a chunk's unaligned part (the end of an odd-sized
# layer, an edge chunk's zero fill, a caller's unaligned memory) moves through it in pieces of this
# size, not all at once (a chunk-sized buffer each was up to io_threads x 16 MiB)
BOUNCE_MAX = 2**20


def _crc_zeros(n: int, crc: int) -> int:
    """``crc`` continued over ``n`` zero bytes (a shared buffer of at most BOUNCE_MAX zeros)."""
    z = getattr(_tls, "zeros", None)
    if z is None:
        z = _tls.zeros = np.zeros(BOUNCE_MAX, dtype=np.uint8)
    while n > 0:
        k = min(n, BOUNCE_MAX)
        crc = crc32c.crc32c(z[:k], value=crc)
        n -= k
    return crc


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array of ``nbytes`` (anonymous mmap: its pages are not touched yet)."""
    buf = mmap.mmap(-1, max(ALIGN, _round_up(nbytes)))
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes)


def is_aligned(a: np.ndarray) -> bool:
    """Whether ``a`` starts on an O_DIRECT boundary."""
    return a.ctypes.data % ALIGN == 0


def bounce_bytes(chunk_bytes: int) -> int:
    """The most an I/O thread's bounce buffer grows to for chunk files of ``chunk_bytes`` data bytes
    (plus the CRC32C): the whole file in pages, at most BOUNCE_MAX (`mtc plan` counts one per
    I/O thread; a thread keeps it for the run)."""
    return min(BOUNCE_MAX, _round_up(chunk_bytes + _CRC))


def _bounce(nbytes: int) -> np.ndarray:
    """This thread's aligned scratch buffer (kept for the next chunk): ``nbytes`` rounded up to
    whole pages, at most BOUNCE_MAX; callers move anything longer through it in pieces."""
    nbytes = min(_round_up(nbytes), BOUNCE_MAX)
    b = getattr(_tls, "bounce", None)
    if b is None or b.nbytes < nbytes:
        b = _tls.bounce = aligned_empty(nbytes)
    return b[:nbytes]


def _fill(buf: np.ndarray, pos: int, data: np.ndarray, chunk_bytes: int, crc_bytes: bytes) -> int:
    """Fill ``buf`` with bytes ``[pos, pos + len(buf))`` of a chunk file (``data``, its zero fill up
    to ``chunk_bytes``, then ``crc_bytes``), zeros past its end; how many of them are file bytes."""
    n, end = data.nbytes, pos + buf.nbytes
    buf[:] = 0
    if pos < n:
        buf[: min(end, n) - pos] = data[pos : min(end, n)]
    for i, b in enumerate(crc_bytes):
        if pos <= chunk_bytes + i < end:
            buf[chunk_bytes + i - pos] = b
    return max(0, min(end, chunk_bytes + len(crc_bytes)) - pos)


def _open(path: str | Path, flags: int) -> tuple[int, bool]:
    """Open with O_DIRECT where the file system allows it; (fd, direct)."""
    dev = _dev_of(path)
    if _O_DIRECT and dev not in _direct_refused:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno != 22:  # EINVAL: this file system has no direct I/O; anything else is real
                raise
            _direct_refused.add(dev)
    return os.open(path, flags, 0o644), False


def _dev_of(path: str | Path) -> int:
    p = Path(path)
    with contextlib.suppress(OSError):
        return os.stat(p if p.exists() else p.parent).st_dev
    return -1


def _drop_cache(fd: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # advisory: a system without it still works
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _as_bytes(v: memoryview) -> memoryview:
    """``v`` as flat bytes, so that lengths and slices count bytes whatever its item type."""
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


def _after(views: list[memoryview], skip: int) -> list[memoryview]:
    """What of ``views`` is left after their first ``skip`` bytes (a short read or write's rest)."""
    rest = []
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        rest.append(v[skip:])
        skip = 0
    return rest


def _readv_full(fd: int, views: list[memoryview], want: int, direct: bool, pos: int = 0) -> int:
    """Read into ``views`` from offset ``pos`` until ``want`` bytes or end of file; bytes read."""
    views = [_as_bytes(v) for v in views]  # (sliced by bytes below)
    got = os.preadv(fd, views, pos)
    while got < want:  # a short read (signals, some file systems): continue from where it stopped
        if direct and got % ALIGN:
            break  # cannot continue an O_DIRECT read mid-page: the file ended
        n = os.preadv(fd, _after(views, got), pos + got)
        if n == 0:
            break
        got += n
    return got


def _pwritev_full(fd: int, views: list[memoryview], path: str | Path, pos: int = 0) -> int:
    """Write ``views`` from offset ``pos`` of ``fd``, all of them; bytes written.

    A short write (the file system filled up part-way) is continued, so the call that cannot
    write raises its own OSError (ENOSPC, EDQUOT: a cause the caller can name and say how to fix)
    instead of a bare byte count.
    """
    views = [_as_bytes(v) for v in views]  # (sliced by bytes below)
    want = sum(len(v) for v in views)
    done = os.pwritev(fd, views, pos)
    while done < want:
        n = os.pwritev(fd, _after(views, done), pos + done)
        if n == 0:
            raise OSError(errno.EIO, f"short write to {path}: {done} of {want} bytes, and no progress")
        done += n
    return want


def read_chunk_file(path: str | Path, chunk_bytes: int, dst: np.ndarray, offset: int = 0) -> str | None:
    """Read a chunk file of ``chunk_bytes`` data bytes (plus its CRC32C) and copy bytes
    ``[offset, offset + dst.nbytes)`` of its data into ``dst`` (uint8, contiguous).

    Returns None, or what is wrong with the file ("failed its CRC32C checksum", "is N bytes ...").
    Raises OSError (FileNotFoundError when missing) for I/O failures.
    """
    total = chunk_bytes + _CRC
    fd, direct = _open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != total:
            return f"is {size} bytes, a chunk of this array is {total} (data + CRC32C): truncated or not mtc's"
        n = dst.nbytes
        # straight into the caller's memory when O_DIRECT allows it: the whole pages at its start
        head = n // ALIGN * ALIGN if offset == 0 and is_aligned(dst) and n <= chunk_bytes else 0
        got = _readv_full(fd, [memoryview(dst[:head])], head, direct) if head else 0
        if got < head:
            return f"ended after {got} of {total} bytes while being read"
        crc = crc32c.crc32c(dst[:head]) if head else 0
        # the rest (the end of dst, other data, the zero fill, the CRC) a bounce buffer's worth at a time
        stored, pos = bytearray(), head
        while pos < total:
            buf = _bounce(total - pos)
            got = _readv_full(fd, [memoryview(buf)], min(buf.nbytes, total - pos), direct, pos)
            if got < min(buf.nbytes, total - pos):
                return f"ended after {pos + got} of {total} bytes while being read"
            end = min(pos + buf.nbytes, total)
            if pos < chunk_bytes:
                crc = crc32c.crc32c(buf[: min(end, chunk_bytes) - pos], value=crc)
            stored += buf[max(0, chunk_bytes - pos) : end - pos].tobytes()
            lo, hi = max(pos, offset + head), min(end, offset + n)  # the part of dst in this piece
            if lo < hi:
                dst[lo - offset : hi - offset] = buf[lo - pos : hi - pos]
            pos = end
        if crc != int.from_bytes(stored, "little"):
            return f"failed its CRC32C checksum (stored {int.from_bytes(stored, 'little'):#010x}, computed {crc:#010x})"
        if not direct:
            _drop_cache(fd)
    finally:
        os.close(fd)
    return None


def write_chunk_file(path: str | Path, chunk_bytes: int, data: np.ndarray, *, in_place: bool = False) -> bool:
    """Write ``data`` (uint8, contiguous, at most ``chunk_bytes``; the rest is zero fill) as a
    chunk file with its CRC32C, durable on return.

    By default to a temporary file, fsynced, then renamed over ``path`` (atomic, as zarr's own
    writes). ``in_place``: overwrite ``path`` itself when it already is a chunk file of this size
    and has no other hard link
    (no block allocation, no new directory entry, no directory fsync: 1.4-2x the write rate of
    the rename path on the 2-core VM's ext4, `mtc.store.diskbench`), else fall back to the rename. Only for a caller that never needs the
    old contents again if the write is torn (the disk tier's uncommitted generation): a torn
    in-place chunk fails its CRC32C when read. Returns True when it wrote in place.
    """
    n = data.nbytes
    total = chunk_bytes + _CRC
    pad = chunk_bytes - n
    crc = crc32c.crc32c(data)
    if pad:
        crc = _crc_zeros(pad, crc)  # zarr pads an edge chunk with the fill value 0
    crc_bytes = crc.to_bytes(_CRC, "little")
    if in_place:
        try:
            fd, direct = _open(path, os.O_WRONLY)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            try:
                info = os.fstat(fd)
                # a hard-linked file (a user's `cp -al` snapshot) would change under the other name too
                if info.st_size == total and info.st_nlink == 1:
                    if direct and chunk_bytes % ALIGN == 0:
                        _overwrite_fd(fd, data, chunk_bytes, crc_bytes, path)
                    else:
                        _write_fd(fd, data, chunk_bytes, crc_bytes, direct, path)
                    return True
            finally:
                os.close(fd)
    tmp = Path(path).with_name(f"{Path(path).name}.{uuid.uuid4().hex}.partial")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd, direct = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        _write_fd(fd, data, chunk_bytes, crc_bytes, direct, tmp)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return False


def _overwrite_fd(fd: int, data: np.ndarray, chunk_bytes: int, crc_bytes: bytes, path: str | Path) -> None:
    """Overwrite a chunk file of the right size in place: the data with ``O_DIRECT`` through ``fd``,
    the 4-byte CRC32C through a buffered handle, then one ``fdatasync``.

    The file's size never changes, so no metadata needs journaling and ``fdatasync`` costs one
    device flush, which also covers the direct writes before it. Writing the CRC's page with
    ``O_DIRECT`` instead would extend the file to a page boundary and need a truncate, a size
    change the sync must journal (as fast or up to 15 % slower in trials on the VM's ext4).
    """
    n = data.nbytes
    head = n // ALIGN * ALIGN if is_aligned(data) else 0  # straight from the caller's memory
    if head:
        _pwritev_full(fd, [memoryview(data[:head])], path)
    pos = head
    while pos < chunk_bytes:  # the rest of the data and the zero fill through the bounce (page multiples)
        buf = _bounce(chunk_bytes - pos)
        _fill(buf, pos, data, chunk_bytes, b"")
        _pwritev_full(fd, [memoryview(buf)], path, pos)
        pos += buf.nbytes
    tail = os.open(path, os.O_WRONLY)
    try:
        if os.pwrite(tail, crc_bytes, chunk_bytes) != _CRC:
            raise OSError(f"short write of the CRC32C to {path}")
        os.fdatasync(tail)
        _drop_cache(tail)
    finally:
        os.close(tail)


def _write_fd(fd: int, data: np.ndarray, chunk_bytes: int, crc_bytes: bytes, direct: bool, path: str | Path) -> None:
    """Write data, zero fill and CRC from offset 0 of ``fd``, cut the file to its size, fsync."""
    n = data.nbytes
    total = chunk_bytes + _CRC
    head = n // ALIGN * ALIGN if is_aligned(data) else 0  # straight from the caller's memory
    if head:
        _pwritev_full(fd, [memoryview(data[:head])], path)
    pos = head
    while pos < total:  # the rest (data, zero fill, CRC) through the bounce, whole pages at a time
        buf = _bounce(total - pos)
        _fill(buf, pos, data, chunk_bytes, crc_bytes)
        _pwritev_full(fd, [memoryview(buf)], path, pos)
        pos += buf.nbytes
    if pos != total:
        os.ftruncate(fd, total)  # O_DIRECT wrote whole pages: cut the padding after the CRC
    os.fsync(fd)
    if not direct:
        _drop_cache(fd)


class PriorityPool:
    """A fixed set of worker threads taking jobs lowest priority value first (FIFO within one)."""

    def __init__(self, workers: int, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._heap: list[tuple[int, int, Callable[[], object], Future]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._stop = False
        self._initializer = initializer
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], object], priority: int = PRIORITY_READ) -> Future:
        """Queue ``fn``; its Future completes with its result or error."""
        fut: Future = Future()
        with self._cv:
            if self._stop:
                raise RuntimeError("cannot schedule new futures after shutdown")
            heapq.heappush(self._heap, (priority, next(self._seq), fn, fut))
            self._cv.notify()
        return fut

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            with self._cv:
                while not self._heap and not self._stop:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, fn, fut = heapq.heappop(self._heap)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- handed to the submitter through the Future
                fut.set_exception(e)

    def shutdown(self, wait: bool = True) -> None:
        """Finish the queued jobs, then stop the threads."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()
