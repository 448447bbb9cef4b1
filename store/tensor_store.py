"""The tensor store: zarr v3 arrays of training state, checked writes, parallel reads, commits, a lock.

zarr does not check writes (it truncates, broadcasts and casts silently), keeps no checksum on
data chunks unless asked, never fsyncs, and has no bfloat16. This class closes those gaps:

* every write is checked against the array's shape and dtype and fans out one writer per chunk
  over a pool of I/O threads, then fsyncs the chunk files (local stores) before returning;
* every chunk carries a CRC32C (``Crc32cCodec``); a mismatch, an undecodable or a missing chunk
  raises `StoreCorruptionError` naming the array, the chunk and its file;
* bf16 (and other dtypes numpy lacks) are stored as int16 views with the real dtype in the
  array's attributes;
* reads go straight into a caller's preallocated (e.g. pinned) buffer, one task per chunk;
* a commit record is written atomically (temp file, fsync, rename, fsync dir) and an exclusive
  ``flock`` stops a second run from opening the same store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import LocalStore, MemoryStore

from mtc.errors import StoreCorruptionError, StoreError, StoreLockedError

__all__ = ["ArrayInfo", "CommitRecord", "TensorStore"]

_MARKER = "mtc_store"
_FORMAT = 1
_CHUNK_BYTES = 16 * 2**20  # 16 MiB chunks read faster than 4 MiB ones (NOTES.md)

# torch dtype -> (numpy storage dtype, name recorded in attributes)
_DTYPES: dict[torch.dtype, tuple[np.dtype, str]] = {
    torch.float32: (np.dtype("float32"), "float32"),
    torch.float16: (np.dtype("float16"), "float16"),
    torch.bfloat16: (np.dtype("int16"), "bfloat16"),
    torch.int64: (np.dtype("int64"), "int64"),
    torch.int32: (np.dtype("int32"), "int32"),
    torch.int16: (np.dtype("int16"), "int16"),
    torch.uint8: (np.dtype("uint8"), "uint8"),
}
_BY_NAME = {name: dt for dt, (_np, name) in _DTYPES.items()}
_VIEW_AS = {torch.bfloat16: torch.int16}


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayInfo:
    """Shape, dtype and chunking of one stored array."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunk_rows: int
    nbytes: int

    @property
    def n_chunks(self) -> int:
        """Number of chunks along dim 0."""
        return max(1, -(-self.shape[0] // self.chunk_rows)) if self.shape else 1


@dataclasses.dataclass(frozen=True, slots=True)
class CommitRecord:
    """What a step commit records: enough to resume exactly."""

    step: int
    generation: int
    data_cursor: int
    rng_state: dict[str, str]
    config: dict[str, Any]
    time_unix: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        """One-line JSON."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "CommitRecord":
        """Parse; raises ValueError/KeyError/TypeError on malformed input."""
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("commit record is not a JSON object")
        return cls(**d)


class TensorStore:
    """A directory (or in-memory) zarr v3 store of named tensors plus step commits."""

    def __init__(self, zstore: Any, path: Path | None, io_threads: int, lock_fd: int | None) -> None:
        self._zstore = zstore
        self._root = zarr.open_group(store=zstore, mode="a")
        self._path = path
        self._lock_fd = lock_fd
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="mtc-io")
        self._arrays: dict[str, zarr.Array] = {}
        self._meta_lock = threading.Lock()
        self._commit: CommitRecord | None = None
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | Path | None, *, io_threads: int = 4, overwrite: bool = False) -> "TensorStore":
        """Create a new store at ``path`` (None: in memory). Refuses a non-empty dir unless overwrite."""
        if path is None:
            zs = MemoryStore()
            zarr.open_group(store=zs, mode="w").attrs[_MARKER] = _FORMAT
            return cls(zs, None, io_threads, None)
        p = Path(path)
        if p.exists() and not p.is_dir():
            raise StoreError(f"cannot create a store at {p}: it is a file")
        if p.exists() and any(p.iterdir()):
            if not overwrite:
                raise StoreError(f"cannot create a store at {p}: the directory is not empty; pick a new directory or overwrite it")
            fd = _lock(p)  # never wipe a store another run is using
            try:
                for child in p.iterdir():
                    if child.name != ".lock":
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
            except BaseException:
                os.close(fd)
                raise
        else:
            p.mkdir(parents=True, exist_ok=True)
            fd = _lock(p)
        zs = LocalStore(str(p))
        # mode "a", not "w": "w" clears the directory, which would delete the lock file we hold
        zarr.open_group(store=zs, mode="a").attrs[_MARKER] = _FORMAT
        return cls(zs, p, io_threads, fd)

    @classmethod
    def open(cls, path: str | Path, *, io_threads: int = 4) -> "TensorStore":
        """Open an existing store directory (taking its lock)."""
        p = Path(path)
        if not (p / "zarr.json").is_file():
            raise StoreError(f"{p} is not an mtc store (no zarr.json); create one with `mtc train --store {p} ...`")
        fd = _lock(p)
        try:
            zs = LocalStore(str(p))
            attrs = zarr.open_group(store=zs, mode="r").attrs
            if attrs.get(_MARKER) != _FORMAT:
                raise StoreError(f"{p} is a zarr group but not an mtc store (format {attrs.get(_MARKER)!r})")
            st = cls(zs, p, io_threads, fd)
        except BaseException:
            os.close(fd)
            raise
        st._commit = st._read_commit()
        return st

    def close(self) -> None:
        """Finish pending I/O and release the lock (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "TensorStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Path | None:
        """The store directory, or None for an in-memory store."""
        return self._path

    @property
    def is_memory(self) -> bool:
        """True for an in-memory store."""
        return self._path is None

    # -- arrays ---------------------------------------------------------------------------------

    def create_array(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, *, chunk_rows: int | None = None) -> None:
        """Create array ``name``; chunked along dim 0 (~16 MiB chunks by default), CRC32C per chunk."""
        self._check_open()
        if dtype not in _DTYPES:
            raise StoreError(f"array {name!r}: dtype {dtype} is not supported; use one of {', '.join(n for _d, n in _DTYPES.values())}")
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 0 for s in shape):
            raise StoreError(f"array {name!r}: shape {shape} must have at least one non-negative dimension")
        if self.has_array(name):
            info = self.array_info(name)
            if info.shape != shape or info.dtype != dtype:
                raise StoreError(
                    f"array {name!r} already exists with shape {info.shape} and dtype {info.dtype}, not {shape} / {dtype}"
                )
            return
        np_dt, dt_name = _DTYPES[dtype]
        row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * np_dt.itemsize)
        rows = chunk_rows or max(1, _CHUNK_BYTES // row_bytes)
        rows = max(1, min(rows, max(1, shape[0])))
        with self._meta_lock:
            arr = self._root.create_array(
                name,
                shape=shape,
                chunks=(rows, *shape[1:]),
                dtype=np_dt,
                serializer=BytesCodec(),
                compressors=[Crc32cCodec()],  # a checksum codec, not compression: weights barely compress
                fill_value=0,
                attributes={"mtc_dtype": dt_name},
                config={"write_empty_chunks": True},  # fresh all-zero Adam state must exist on disk
            )
            self._arrays[name] = arr

    def has_array(self, name: str) -> bool:
        """Whether array ``name`` exists."""
        if name in self._arrays:
            return True
        try:
            self._array(name)
            return True
        except StoreError:
            return False

    def array_names(self) -> list[str]:
        """All array names (paths), sorted."""
        with warnings.catch_warnings():
            # the lock, commit records, plan/ and logs/ live beside the arrays; zarr warns about them
            warnings.simplefilter("ignore")
            return sorted(k for k, v in self._root.members(max_depth=None) if isinstance(v, zarr.Array))

    def array_info(self, name: str) -> ArrayInfo:
        """Shape, dtype and chunking of ``name``."""
        arr = self._array(name)
        dtype = _BY_NAME[arr.attrs.get("mtc_dtype", "float32")]
        shape = tuple(arr.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype][0].itemsize
        return ArrayInfo(name, shape, dtype, int(arr.chunks[0]), nbytes)

    def total_nbytes(self) -> int:
        """Bytes of all arrays (uncompressed)."""
        return sum(self.array_info(n).nbytes for n in self.array_names())

    def chunk_path(self, name: str, chunk_index: int) -> Path | None:
        """File holding chunk ``chunk_index`` of ``name`` (None for in-memory stores)."""
        if self._path is None:
            return None
        info = self.array_info(name)
        return self._path.joinpath(*name.split("/"), "c", str(chunk_index), *(["0"] * (len(info.shape) - 1)))

    def _array(self, name: str) -> zarr.Array:
        arr = self._arrays.get(name)
        if arr is None:
            with self._meta_lock:
                try:
                    arr = zarr.open_array(store=self._zstore, path=name, mode="r+")
                except (FileNotFoundError, KeyError, ValueError, zarr.errors.NodeTypeValidationError) as e:
                    raise StoreError(f"no array {name!r} in store {self._path or '<memory>'} ({type(e).__name__})") from None
                self._arrays[name] = arr
        return arr

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store {self._path or '<memory>'} is closed")

    # -- writing --------------------------------------------------------------------------------

    def _as_numpy(self, name: str, tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> np.ndarray:
        info = self.array_info(name)
        if tensor.dtype != info.dtype:
            raise StoreError(f"{what} array {name!r}: dtype {tensor.dtype}, the array holds {info.dtype}; convert it first")
        if tuple(tensor.shape) != shape:
            raise StoreError(f"{what} array {name!r}: shape {tuple(tensor.shape)}, expected {shape}")
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype in _VIEW_AS:
            t = t.view(_VIEW_AS[t.dtype])
        return t.numpy()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the whole array (shape and dtype must match exactly); durable on return."""
        self.write_rows(name, 0, tensor, _whole=True)

    def write_async(self, name: str, tensor: torch.Tensor) -> Future[None]:
        """`write` on a helper thread (not an I/O worker, so chunk tasks never wait on themselves)."""
        t = tensor.detach().to("cpu").clone() if tensor.device.type != "cpu" else tensor.detach()
        return _in_thread(self.write, name, t)

    def write_rows(self, name: str, start_row: int, tensor: torch.Tensor, *, _whole: bool = False) -> None:
        """Write rows [start_row, start_row + len(tensor)) of ``name``; durable on return."""
        self._check_open()
        info = self.array_info(name)
        n = info.shape[0] if _whole else int(tensor.shape[0]) if tensor.dim() else -1
        if n < 0 or start_row < 0 or start_row + n > info.shape[0]:
            raise StoreError(f"write to array {name!r}: rows [{start_row}, {start_row + max(n, 0)}) do not fit its {info.shape[0]} rows")
        data = self._as_numpy(name, tensor, (n, *info.shape[1:]), "write to")
        arr = self._array(name)
        rows = info.chunk_rows
        tasks = []
        for c in range(start_row // rows, -(-(start_row + n) // rows)):
            lo, hi = max(start_row, c * rows), min(start_row + n, (c + 1) * rows)
            tasks.append(self._pool.submit(self._write_chunk, arr, name, c, lo, hi, data[lo - start_row : hi - start_row]))
        for t in tasks:
            t.result()

    def _write_chunk(self, arr: zarr.Array, name: str, c: int, lo: int, hi: int, block: np.ndarray) -> None:
        try:
            arr[lo:hi] = block
        except Exception as e:
            raise StoreError(f"writing chunk {c} of array {name!r} failed: {e}") from e
        path = self.chunk_path(name, c)
        if path is not None:
            # zarr writes a chunk as temp file + rename: the data and the rename must both be durable
            _fsync(path)
            _fsync_dir(path.parent)

    # -- reading --------------------------------------------------------------------------------

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read the whole array into ``out`` (CPU, contiguous, exact shape and dtype)."""
        info = self.array_info(name)
        self.read_rows_into(name, 0, out, _expect=info.shape)

    def read_into_async(self, name: str, out: torch.Tensor) -> Future[None]:
        """`read_into` on a helper thread."""
        return _in_thread(self.read_into, name, out)

    def read(self, name: str) -> torch.Tensor:
        """The whole array as a fresh CPU tensor."""
        info = self.array_info(name)
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(name, out)
        return out

    def read_rows_into(self, name: str, start_row: int, out: torch.Tensor, *, _expect: tuple[int, ...] | None = None) -> None:
        """Read rows [start_row, start_row + len(out)) of ``name`` into ``out``, one task per chunk."""
        self._check_open()
        info = self.array_info(name)
        n = int(out.shape[0]) if out.dim() else -1
        expect = _expect or (n, *info.shape[1:])
        if out.device.type != "cpu" or not out.is_contiguous() or out.dtype != info.dtype or tuple(out.shape) != expect:
            raise StoreError(
                f"read of array {name!r}: the out buffer must be a contiguous CPU tensor of shape {expect} and dtype "
                f"{info.dtype}; got shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}, contiguous={out.is_contiguous()}"
            )
        if start_row < 0 or start_row + n > info.shape[0]:
            raise StoreError(f"read of array {name!r}: rows [{start_row}, {start_row + n}) exceed its {info.shape[0]} rows")
        view = (out.view(_VIEW_AS[out.dtype]) if out.dtype in _VIEW_AS else out).numpy()
        arr = self._array(name)
        rows = info.chunk_rows
        tasks = []
        for c in range(start_row // rows, -(-(start_row + n) // rows)):
            lo, hi = max(start_row, c * rows), min(start_row + n, (c + 1) * rows)
            tasks.append(self._pool.submit(self._read_chunk, arr, name, c, lo, hi, view[lo - start_row : hi - start_row]))
        errors = []
        for t in tasks:
            try:
                t.result()
            except StoreError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _read_chunk(self, arr: zarr.Array, name: str, c: int, lo: int, hi: int, dst: np.ndarray) -> None:
        path = self.chunk_path(name, c)
        if path is not None and not path.is_file():
            # zarr would return the fill value (zeros) for a missing chunk: silent loss of state
            raise StoreCorruptionError(
                f"array {name!r} chunk {c} is missing ({path}); the store is damaged: restore it from a copy or re-import the weights"
            )
        try:
            arr.get_basic_selection(slice(lo, hi), out=default_buffer_prototype().nd_buffer.from_numpy_array(dst))
        except Exception as e:
            where = f" ({path})" if path is not None else ""
            raise StoreCorruptionError(
                f"array {name!r} chunk {c}{where} failed to decode or failed its CRC32C checksum ({e}); the store is damaged: "
                "restore it from a copy or re-import the weights"
            ) from e

    # -- commits --------------------------------------------------------------------------------

    def commit(self, record: CommitRecord) -> None:
        """Make ``record`` the store's last commit, atomically, and append it to the history."""
        self._check_open()
        if self._path is not None:
            text = record.to_json()
            tmp = self._path / "commit.json.tmp"
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path / "commit.json")
            with open(self._path / "commits.jsonl", "a") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(self._path)
        self._commit = record

    def last_commit(self) -> CommitRecord | None:
        """The last committed record, or None before the first commit."""
        return self._commit

    def commit_history(self) -> list[CommitRecord]:
        """Every commit so far (local stores; an in-memory store remembers only the last)."""
        if self._path is None:
            return [self._commit] if self._commit else []
        f = self._path / "commits.jsonl"
        if not f.is_file():
            return []
        out = []
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                out.append(CommitRecord.from_json(line))  # a torn last line (crash mid-append) is skipped
        return out

    def _read_commit(self) -> CommitRecord | None:
        assert self._path is not None
        f = self._path / "commit.json"
        if not f.is_file():
            return None
        try:
            return CommitRecord.from_json(f.read_text())
        except (ValueError, KeyError, TypeError) as e:
            raise StoreCorruptionError(f"commit record {f} is malformed ({e}); the store's last commit cannot be read") from None


def _in_thread(fn: Any, *args: Any) -> Future[None]:
    """Run ``fn(*args)`` on a fresh thread (not an I/O worker, so its chunk tasks never wait on
    themselves) and return a Future for it."""
    fut: Future[None] = Future()

    def run() -> None:
        try:
            fn(*args)
            fut.set_result(None)
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, name="mtc-store-async", daemon=True).start()
    return fut


def _lock(path: Path) -> int:
    fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise StoreLockedError(
            f"store {path} is in use by another run (pid {holder}); stop that run or use another store directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
