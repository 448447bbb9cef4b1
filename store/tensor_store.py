"""The tensor store: zarr v3 arrays of training state, checked writes, parallel reads, commits, a lock.

zarr does not check writes (it truncates, broadcasts and casts silently), keeps no checksum on
data chunks unless asked, skips (and even deletes) all-zero chunks by default, never fsyncs, and
has no bfloat16. This class closes those gaps:

* every write is checked against the array's shape and dtype and fans out one writer per chunk
  over the store's I/O threads; on a local store the chunk files and their directories are
  fsynced before the write counts as done; a chunk file is replaced atomically (temp + rename)
  unless the caller asks for ``in_place`` (the disk tier's uncommitted generation), which
  overwrites it and needs no directory fsync;
* every chunk carries a CRC32C (``Crc32cCodec``) and every chunk is written, zeros included; a
  checksum mismatch, an undecodable chunk or a missing chunk raises `StoreCorruptionError`
  naming the array, the chunk and its file, instead of returning garbage or zeros;
* bf16 (and other dtypes numpy lacks) are stored as int16 views with the real dtype recorded in
  the array's attributes (``mtc_dtype``);
* reads go straight into a caller's preallocated (e.g. pinned) buffer, one task per chunk;
* a commit record is written atomically (temp file, fsync, rename, fsync dir), and an exclusive
  ``flock`` keeps a second run (or a second handle) off the same store directory; a read-only
  handle takes no lock, so `mtc inspect` works beside a running trainer;
* a directory becomes a store only at its first commit (the set-up marker, see
  `mtc.store.directory`): a run killed during set-up leaves a directory that ``create``
  re-initialises, never a store that looks resumable.

Layout of a store directory: ``zarr.json`` (root group, attribute ``mtc_store: 1``), the arrays,
``.lock``, ``commit.json`` (the last commit), ``commits.jsonl`` (their history) and
``resume-g0.json`` / ``resume-g1.json`` (the RNG states of each generation's commit),
``contexts/`` (the runs' configs and data identities the history's lines name), and before
the first commit ``setup.json`` (the marker). Other directories (the runtime's ``plan/`` and
``logs/``) may live beside them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import re
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.errors import NodeNotFoundError, NodeTypeValidationError  # public in zarr 3.1 through 3.4
from zarr.storage import LocalStore, MemoryStore

try:  # public since zarr 3.1; the private path is the fallback for older 3.x
    from zarr.buffer import default_buffer_prototype
except ImportError:  # pragma: no cover
    from zarr.core.buffer import default_buffer_prototype

from mtc.store.directory import (
    COMMIT_FILE,
    COMMIT_TMP,
    CONTEXT_DIR,
    DURABILITY_MODES,
    HISTORY_FILE,
    LOCK_FILE,
    MARKER_FILE,
    RESUME_FILES,
    CommitRecord,
    append_history,
    check_creatable,
    commit_path,
    dir_state,
    fsync_path,
    lock_store,
    os_error_message,
    parse_node,
    read_commit_file,
    read_history,
    read_resume,
    replace_commit_file,
    scan_nodes,
    split_resume,
    unlock_store,
    write_commit,
    write_marker,
)
from mtc.store.fastio import PRIORITY_READ, PRIORITY_WRITE, PriorityPool, bounce_bytes, read_chunk_file, write_chunk_file

from mtc.errors import StoreCorruptionError, StoreError, StoreLockedError

__all__ = ["SUPPORTED_DTYPES", "ArrayInfo", "CommitRecord", "TensorStore", "io_bounce_bytes"]  # CommitRecord: from mtc.store.directory

_MARKER = "mtc_store"
_FORMAT = 1
# 16 MiB chunks: read faster than 4 MiB ones (NOTES.md); measured again with the direct path (2-core
# VM, 384 MB in 4 arrays, 4 trials alternating with raw, medians GB/s write/read/mix): 4 MiB
# 0.29/0.51/0.34, 16 MiB 0.31/0.54/0.37, 64 MiB 0.26/0.38/0.29 (an array's last chunk is stored
# at full size, and fewer chunks than 2 x the I/O threads leave threads idle)
_CHUNK_BYTES = 16 * 2**20
_RESERVED = {LOCK_FILE, COMMIT_FILE, HISTORY_FILE, COMMIT_TMP, MARKER_FILE, CONTEXT_DIR, "zarr.json", *RESUME_FILES}
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")

# torch dtype -> (numpy storage dtype, name recorded in the array's attributes)
_DTYPES: dict[torch.dtype, tuple[np.dtype, str]] = {
    torch.float32: (np.dtype("float32"), "float32"),
    torch.float16: (np.dtype("float16"), "float16"),
    torch.bfloat16: (np.dtype("int16"), "bfloat16"),  # numpy has no bfloat16: store the bits
    torch.int64: (np.dtype("int64"), "int64"),
    torch.int32: (np.dtype("int32"), "int32"),
    torch.int16: (np.dtype("int16"), "int16"),
    torch.uint8: (np.dtype("uint8"), "uint8"),
}
_BY_NAME = {name: dt for dt, (_np, name) in _DTYPES.items()}
_VIEW_AS = {torch.bfloat16: torch.int16}  # dtypes moved through numpy as a same-size integer view
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_DTYPES)

# Runtime array config (zarr does not persist it, so it is applied on every open):
# write_empty_chunks: all-zero chunks (fresh Adam moments) must exist on disk, or a missing chunk
#   could not be told from a lost one; with the default False zarr even DELETES a chunk file when
#   it is overwritten with zeros.
# read_missing_chunks (zarr >= 3.2): make zarr itself refuse to invent zeros for a missing chunk;
#   older zarr has no such switch, so `_read_chunk` also checks the chunk exists.
_ARRAY_CONFIG: dict[str, Any] = {"write_empty_chunks": True}
if "read_missing_chunks" in zarr.config.get("array", {}):
    _ARRAY_CONFIG["read_missing_chunks"] = False


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
        """Number of chunks along dim 0 (0 for an array with no rows)."""
        return -(-self.shape[0] // self.chunk_rows)


class TensorStore:
    """A directory (or in-memory) zarr v3 store of named tensors plus step commits.

    Use `TensorStore.create` or `TensorStore.open`, and `close` (or ``with``) when done: closing
    waits for pending asynchronous I/O and releases the directory's lock.
    """

    def __init__(
        self, zstore: Any, path: Path | None, io_threads: int, lock_fd: int | None, mem: dict[str, Any] | None,
        *, read_only: bool = False, uncommitted: bool = False,
    ) -> None:
        """Internal: use `create` or `open`."""
        self._zstore = zstore
        self._path = path
        self._lock_fd = lock_fd
        self._mem = mem  # the MemoryStore's dict, to tell a missing chunk from a written one
        self._read_only = read_only
        self._uncommitted = uncommitted  # the set-up marker is there: the first commit renames it
        self._root = zarr.open_group(store=zstore, mode="r" if read_only else "a")
        self._tls = threading.local()
        self._pool = PriorityPool(io_threads, "mtc-store-io", initializer=self._mark_worker)
        self._fast: dict[str, bool] = {}  # array name -> its chunks are plain bytes + CRC32C (the direct path applies)
        self._arrays: dict[str, zarr.Array] = {}
        self._meta_lock = threading.RLock()
        self._unsynced: set[Path] = set()  # metadata files/dirs created since the last fsync
        self._commit: CommitRecord | None = None
        self._commit_loaded = path is None
        self._history: list[CommitRecord] = []  # in-memory stores only
        self._closed = False
        self.direct_io = True  # chunk files of plain arrays bypass zarr and the page cache (mtc.store.fastio)

    # -- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | Path | None, *, io_threads: int = 4, overwrite: bool = False) -> TensorStore:
        """Create a new, uncommitted store in directory ``path`` (None: in memory, for tests).

        The directory becomes a store at its first `commit`. A directory holding an uncommitted
        mtc store (a run that stopped during set-up) is re-initialised; any other non-empty
        directory is refused unless ``overwrite``, and even then only an mtc store is emptied, so
        a mistyped path cannot wipe unrelated files.
        """
        _check_threads(io_threads)
        if path is None:
            mem: dict[str, Any] = {}
            zs = MemoryStore(store_dict=mem)
            zarr.open_group(store=zs, mode="w").attrs[_MARKER] = _FORMAT
            return cls(zs, None, io_threads, None, mem)
        p = Path(path)
        if p.exists() and not p.is_dir():
            raise StoreError(f"cannot create a store at {p}: it is a file, not a directory; pick a directory path")
        try:
            check_creatable(p, overwrite)
        except StoreError:
            _raise_if_held(p)  # a run holding the store (the same command started twice) is the real answer
            raise
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create store directory {p}: {os_error_message(e)} (or pick another directory)") from e
        fd = lock_store(p)  # before deleting anything: never wipe a store another run is using
        try:
            check_creatable(p, overwrite)  # again, under the lock: another run may have committed meanwhile
            try:
                # the marker first: from here on an interruption leaves an uncommitted store, which
                # the next `create` re-initialises, never a store that looks committed but is half gone
                write_marker(p)
                for f in (COMMIT_FILE, HISTORY_FILE):
                    (p / f).unlink(missing_ok=True)
                fsync_path(p, directory=True)
                for child in p.iterdir():
                    # the lock file stays: unlinking it would let a third process lock a new inode
                    if child.name not in (LOCK_FILE, MARKER_FILE):
                        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
                zs = LocalStore(str(p))
                # mode "a", not "w": "w" clears the directory, which would delete the lock file we hold
                zarr.open_group(store=zs, mode="a").attrs[_MARKER] = _FORMAT
            except OSError as e:
                raise StoreError(f"cannot set up a store in {p}: {os_error_message(e)}") from e
            st = cls(zs, p, io_threads, fd, None, uncommitted=True)
        except BaseException:
            unlock_store(fd)
            raise
        st._unsynced.update({p / "zarr.json", p})
        st._sync_metadata()
        return st

    @classmethod
    def open(cls, path: str | Path, *, io_threads: int = 4, read_only: bool = False) -> TensorStore:
        """Open a committed store directory, taking its lock (``read_only``: no lock, no writes).

        A read-only handle creates and changes nothing on disk, so it works on a read-only
        directory and beside a run that holds the store.
        """
        _check_threads(io_threads)
        p = Path(path)
        # read-only use (mtc inspect, eval, generate, export) wants a run's store, not a new one
        how = ("give the directory a training run wrote (`mtc train --store DIR ...`)" if read_only
               else f"create one with TensorStore.create({str(p)!r}) (or `mtc train --store {p} ...`)")
        if not p.is_dir():
            raise StoreError(f"no store at {p}: the directory does not exist; {how}")
        if not (p / "zarr.json").is_file() and not (p / MARKER_FILE).is_file():
            raise StoreError(f"{p} is not an mtc store (it has no zarr.json); {how}")
        fd = None if read_only else lock_store(p)
        try:
            state = dir_state(p)
            if state == "uncommitted":
                raise StoreError(f"store {p} has no commit yet: {_why_uncommitted(p)}")
            if state != "committed":
                raise StoreError(
                    f"store {p} has no commit record (no {COMMIT_FILE}, no {HISTORY_FILE}, no set-up marker): an older mtc "
                    "stopped during its set-up, or its commit files were deleted; start over with `mtc train ... --overwrite`, "
                    "or restore the store from a copy"
                )
            zs = LocalStore(str(p), read_only=read_only)
            try:
                fmt = zarr.open_group(store=zs, mode="r").attrs.get(_MARKER)
            except Exception as e:  # unreadable root metadata
                raise StoreCorruptionError(
                    f"{p / 'zarr.json'} cannot be read as zarr v3 group metadata ({e}); restore the store from a copy"
                ) from e
            if fmt is None:
                raise StoreError(f"{p} is a zarr group but not an mtc store (no '{_MARKER}' attribute); {how}")
            if fmt != _FORMAT:
                raise StoreError(f"{p} is an mtc store of format {fmt!r}; this mtc reads format {_FORMAT}: use a matching mtc version")
            if not read_only and (p / MARKER_FILE).exists():
                (p / MARKER_FILE).unlink()  # left by an overwrite that stopped before it removed commit.json
            return cls(zs, p, io_threads, fd, None, read_only=read_only)
        except BaseException:
            if fd is not None:
                unlock_store(fd)
            raise

    def close(self) -> None:
        """Wait for pending I/O, make new metadata durable and release the lock (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._pool.shutdown(wait=True)
            self._sync_metadata()
        finally:
            if self._lock_fd is not None:
                unlock_store(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TensorStore({self._where()}{', closed' if self._closed else ''})"

    @property
    def path(self) -> Path | None:
        """The store directory, or None for an in-memory store."""
        return self._path

    @property
    def read_only(self) -> bool:
        """True for a handle opened with ``read_only=True`` (no lock, no writes)."""
        return self._read_only

    @property
    def is_memory(self) -> bool:
        """True for an in-memory store."""
        return self._path is None

    # -- arrays ---------------------------------------------------------------------------------

    def create_array(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, *, chunk_rows: int | None = None) -> None:
        """Create array ``name``, chunked along dim 0 only (~16 MiB chunks unless ``chunk_rows``).

        Creating an existing name again is a no-op when shape and dtype (and ``chunk_rows``, if
        given) match, and an error otherwise.
        """
        self._check_writable()
        _check_name(name)
        if dtype not in _DTYPES:
            raise StoreError(f"array {name!r}: dtype {dtype} is not supported; use one of {', '.join(n for _d, n in _DTYPES.values())}")
        shape = _as_shape(name, shape)
        if not shape:
            raise StoreError(f"array {name!r}: shape must have at least one dimension (store a scalar as shape (1,))")
        if shape[0] < 0 or any(s <= 0 for s in shape[1:]):
            raise StoreError(f"array {name!r}: shape {shape} needs rows >= 0 and every other dimension >= 1")
        if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
            raise StoreError(f"array {name!r}: chunk_rows must be a positive int, got {chunk_rows!r}")
        np_dt, dt_name = _DTYPES[dtype]
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np_dt.itemsize
        rows = chunk_rows or max(1, _CHUNK_BYTES // row_bytes)
        rows = max(1, min(rows, shape[0]))  # a chunk larger than the array would only waste header
        with self._meta_lock:
            existing = self._open_array(name)
            if existing is not None:
                info = self._info(name, existing)
                if info.shape != shape or info.dtype != dtype:
                    raise StoreError(
                        f"array {name!r} already exists with shape {info.shape} and dtype {info.dtype}; "
                        f"cannot re-create it as shape {shape}, dtype {dtype}: use another name or a new store"
                    )
                if chunk_rows is not None and info.chunk_rows != rows:
                    raise StoreError(f"array {name!r} already exists with chunk_rows {info.chunk_rows}, not {rows}")
                return
            try:
                arr = self._root.create_array(
                    name,
                    shape=shape,
                    chunks=(rows, *shape[1:]),
                    dtype=np_dt,
                    serializer=BytesCodec(),
                    compressors=[Crc32cCodec()],  # a checksum, not compression: weights barely compress
                    fill_value=0,
                    attributes={"mtc_dtype": dt_name},
                    # spelled out so `chunk_path` knows where chunk i lives: <name>/c/<i>/0/...
                    chunk_key_encoding={"name": "default", "separator": "/"},
                    config=_ARRAY_CONFIG,
                )
            except Exception as e:  # e.g. a parent of `name` is an array, or `name` is a group
                raise StoreError(f"cannot create array {name!r} in store {self._where()}: {e}") from e
            self._arrays[name] = arr.with_config(_ARRAY_CONFIG)
            if self._path is not None:
                # the new metadata files and every directory entry up to the root; fsynced in bulk
                # at the next commit or close (one fsync per directory, not per array)
                d = self._path.joinpath(*name.split("/"))
                while True:
                    self._unsynced.update({d, d / "zarr.json"})
                    if d == self._path:
                        break
                    d = d.parent

    def has_array(self, name: str) -> bool:
        """Whether array ``name`` exists."""
        self._check_open()
        return self._open_array(name) is not None

    def array_names(self) -> list[str]:
        """All array names (paths such as ``layers/0003/master/g1``), sorted.

        Found from the metadata files themselves, not through zarr, so a node whose ``zarr.json``
        is garbled is left out here (and reported by `metadata_problems`) instead of failing.
        """
        self._check_open()
        return sorted(name for name, doc in self._scan_nodes().items() if isinstance(doc, dict) and doc.get("node_type") == "array")

    def metadata_problems(self) -> list[tuple[str, str]]:
        """``(node name, what is wrong)`` for each node whose metadata does not parse or is not an mtc array's."""
        self._check_open()
        out = []
        for name, doc in sorted(self._scan_nodes().items()):
            label = name or "<root group>"
            if isinstance(doc, str):
                out.append((label, f"metadata {self._meta_file(name)} does not parse ({doc})"))
            elif doc.get("node_type") not in ("array", "group"):
                out.append((label, f"metadata {self._meta_file(name)} has node_type {doc.get('node_type')!r}, not 'array' or 'group'"))
            elif doc.get("node_type") == "array":
                try:
                    arr = self._load_array(name)  # as on disk now: a long-lived handle caches what it opened
                    if arr is None:
                        raise StoreCorruptionError("zarr does not open it as an array")
                    self._info(name, arr)
                except StoreCorruptionError as e:
                    out.append((label, f"metadata {self._meta_file(name)} is damaged: {e}"))
        return out

    def attributes(self) -> dict[str, Any]:
        """The store's root attributes (e.g. ``mtc_layers``, written by `create_layer_state`)."""
        self._check_open()
        return dict(self._root.attrs)

    def set_attribute(self, key: str, value: Any) -> None:
        """Set one JSON-serialisable root attribute; durable at the next commit or close."""
        self._check_writable()
        if key == _MARKER:
            raise StoreError(f"root attribute {_MARKER!r} is mtc's format marker; pick another key")
        try:
            json.dumps(value)
        except TypeError as e:
            raise StoreError(f"root attribute {key!r} is not JSON-serialisable: {e}") from e
        with self._meta_lock:
            try:
                self._root.attrs[key] = value
            except OSError as e:  # a read-only directory, a full disk: one clear line, not zarr's traceback
                raise StoreError(f"cannot write root attribute {key!r} of store {self._where()}: {os_error_message(e)}") from e
            if self._path is not None:
                self._unsynced.update({self._path / "zarr.json", self._path})

    def array_info(self, name: str) -> ArrayInfo:
        """Shape, dtype, chunk rows and byte size of array ``name``."""
        return self._info(name, self._array(name))

    def total_nbytes(self) -> int:
        """Bytes of all arrays, uncompressed (what they take in memory)."""
        return sum(self.array_info(n).nbytes for n in self.array_names())

    def chunk_path(self, name: str, chunk_index: int) -> Path | None:
        """File that holds chunk ``chunk_index`` of ``name``; None for an in-memory store."""
        info = self.array_info(name)
        if not 0 <= chunk_index < info.n_chunks:
            raise StoreError(f"array {name!r} has chunks 0..{info.n_chunks - 1}, not {chunk_index}")
        if self._path is None:
            return None
        return self._local_chunk_path(name, chunk_index, len(info.shape))

    def check_array(self, name: str) -> list[tuple[int, str]]:
        """``(chunk, what is wrong)`` for every chunk of ``name`` that is missing or fails its CRC32C.

        Reads and decodes every chunk on the I/O threads (one chunk-sized scratch buffer per
        thread at a time), exactly as a read would, and collects the failures instead of raising.
        """
        info = self.array_info(name)
        arr = self._array(name)
        bad: list[tuple[int, str]] = []
        lock = threading.Lock()
        np_dt = _DTYPES[info.dtype][0]

        def one(c: int, lo: int, hi: int) -> None:
            fault = self._decode_chunk(arr, info, c, lo, hi, np.empty((hi - lo, *info.shape[1:]), dtype=np_dt))
            if fault is not None:
                with lock:
                    bad.append((c, fault[1].strip()))

        jobs = [functools.partial(one, c, lo, hi) for c, lo, hi in _chunk_spans(0, info.shape[0], info.chunk_rows)]
        self._wait(self._run(jobs))
        return sorted(bad)

    # -- writing --------------------------------------------------------------------------------

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the whole array; shape and dtype must match it exactly. Durable on return."""
        self._wait(self.write_async(name, tensor))

    def write_async(self, name: str, tensor: torch.Tensor, *, priority: int = PRIORITY_WRITE,
                    in_place: bool = False) -> Future[None]:
        """Start `write` on the I/O threads; the Future completes once the data is durable.

        Bad arguments raise at once; I/O errors arrive through the Future. A CPU tensor is not
        copied: do not modify it before the Future is done. ``priority``: lower runs first
        (`mtc.store.fastio`: reads that gate compute go ahead of write-behind). ``in_place``:
        overwrite existing chunk files instead of replacing them (about twice the write rate;
        `mtc.store.fastio.write_chunk_file`), for an array whose old contents nothing needs if the
        write is torn, such as the generation the last commit does not name; a torn chunk then
        fails its CRC32C when read.
        """
        info = self.array_info(name)
        return self._write_rows(info, 0, tensor, whole=True, priority=priority, in_place=in_place)

    def write_rows(self, name: str, start_row: int, tensor: torch.Tensor) -> None:
        """Write ``tensor`` into rows [start_row, start_row + len(tensor)) of ``name``.

        The range need not be chunk-aligned: a partly covered chunk is read, patched and rewritten,
        so two concurrent partial writes into one chunk would race (don't).
        """
        info = self.array_info(name)
        self._wait(self._write_rows(info, start_row, tensor, whole=False))

    def write_rows_async(self, name: str, start_row: int, tensor: torch.Tensor, *, priority: int = PRIORITY_WRITE,
                         in_place: bool = False) -> Future[None]:
        """Start `write_rows` on the I/O threads; the Future completes once the rows are durable.
        Chunk-aligned ranges (or ones ending at the array's end) take the direct path; keep one
        writer per chunk. ``in_place`` as in `write_async` (only for a generation no commit names)."""
        info = self.array_info(name)
        return self._write_rows(info, start_row, tensor, whole=False, priority=priority, in_place=in_place)

    def _write_rows(self, info: ArrayInfo, start_row: int, tensor: torch.Tensor, *, whole: bool,
                    priority: int = PRIORITY_WRITE, in_place: bool = False) -> Future[None]:
        self._check_writable()
        name = info.name
        if not isinstance(tensor, torch.Tensor):
            raise StoreError(f"write to array {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != info.dtype:
            raise StoreError(f"write to array {name!r}: got dtype {tensor.dtype}, the array holds {info.dtype}; convert the tensor first")
        n = int(tensor.shape[0]) if tensor.dim() else 0
        expect = info.shape if whole else (n, *info.shape[1:])
        if tuple(tensor.shape) != expect:
            raise StoreError(f"write to array {name!r}: got shape {tuple(tensor.shape)}, expected {expect}")
        _check_rows(name, "write to", start_row, n, info.shape[0])
        t = tensor.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()
        data = (t.view(_VIEW_AS[t.dtype]) if t.dtype in _VIEW_AS else t).numpy()
        arr = self._array(name)
        renamed: list[bool] = []  # a chunk file replaced by rename: its directory entry needs an fsync
        jobs = [
            functools.partial(self._write_chunk, arr, name, c, lo, hi, data[lo - start_row : hi - start_row],
                              in_place=in_place, renamed=renamed)
            for c, lo, hi in _chunk_spans(start_row, n, info.chunk_rows)
        ]
        dirs: set[Path] = set()
        if self._path is not None and jobs:
            # the chunk files were renamed into these directories (zarr writes temp + rename),
            # and `c/...` may be new: their entries are only durable once the directories are fsynced
            d = self._path.joinpath(*name.split("/"))
            for c, _lo, _hi in _chunk_spans(start_row, n, info.chunk_rows):
                parent = self._local_chunk_path(name, c, len(info.shape)).parent
                while parent != d:
                    dirs.add(parent)
                    parent = parent.parent
            dirs.add(d)

        def sync_dirs() -> None:  # only in-place overwrites: no directory changed
            if renamed:
                for p in sorted(dirs, reverse=True):
                    _fsync(p, directory=True)

        return self._run(jobs, then=sync_dirs, priority=priority)

    def _write_chunk(self, arr: zarr.Array, name: str, c: int, lo: int, hi: int, block: np.ndarray, *,
                     in_place: bool = False, renamed: list[bool] | None = None) -> None:
        rows = int(arr.chunks[0])
        if self._path is not None and self._is_fast(name, arr) and lo == c * rows and hi == min((c + 1) * rows, arr.shape[0]):
            path = self._local_chunk_path(name, c, arr.ndim)
            try:  # the whole chunk: written directly (same bytes + CRC32C as zarr's), fsynced, renamed or in place
                done_in_place = write_chunk_file(path, _chunk_nbytes(arr), np.ascontiguousarray(block).reshape(-1).view(np.uint8),
                                                 in_place=in_place)
            except OSError as e:
                raise StoreError(f"writing chunk {c} of array {name!r} ({path}) in store {self._where()} failed: "
                                 f"{os_error_message(e)}") from e
            if not done_in_place and renamed is not None:
                renamed.append(True)
            return
        if renamed is not None:
            renamed.append(True)  # zarr writes temp + rename
        try:
            arr[lo:hi] = block
        except Exception as e:
            raise StoreError(f"writing chunk {c} of array {name!r} in store {self._where()} failed: {e}") from e
        if self._path is not None:
            path = self._local_chunk_path(name, c, arr.ndim)
            try:
                _fsync(path)
            except OSError as e:
                raise StoreError(f"fsync of chunk {c} of array {name!r} ({path}) failed: {e}") from e

    # -- reading --------------------------------------------------------------------------------

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read the whole array into ``out``: a contiguous CPU tensor (pinned is fine) of its exact shape and dtype."""
        self._wait(self.read_into_async(name, out))

    def read_into_async(self, name: str, out: torch.Tensor, *, priority: int = PRIORITY_READ) -> Future[None]:
        """Start `read_into` on the I/O threads; ``out`` is complete when the Future is done."""
        info = self.array_info(name)
        return self._read_rows(info, 0, out, whole=True, priority=priority)

    def read_rows_into_async(self, name: str, start_row: int, out: torch.Tensor, *, priority: int = PRIORITY_READ) -> Future[None]:
        """Start `read_rows_into` on the I/O threads."""
        info = self.array_info(name)
        return self._read_rows(info, start_row, out, whole=False, priority=priority)

    def read_rows_into(self, name: str, start_row: int, out: torch.Tensor) -> None:
        """Read rows [start_row, start_row + len(out)) of ``name`` into ``out``."""
        info = self.array_info(name)
        self._wait(self._read_rows(info, start_row, out, whole=False))

    def read(self, name: str) -> torch.Tensor:
        """The whole array as a fresh CPU tensor."""
        info = self.array_info(name)
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(name, out)
        return out

    def _read_rows(self, info: ArrayInfo, start_row: int, out: torch.Tensor, *, whole: bool,
                   priority: int = PRIORITY_READ) -> Future[None]:
        self._check_open()
        name = info.name
        if not isinstance(out, torch.Tensor):
            raise StoreError(f"read of array {name!r}: out must be a torch.Tensor, got {type(out).__name__}")
        n = int(out.shape[0]) if out.dim() else 0
        expect = info.shape if whole else (n, *info.shape[1:])
        if out.device.type != "cpu" or not out.is_contiguous() or out.dtype != info.dtype or tuple(out.shape) != expect:
            raise StoreError(
                f"read of array {name!r}: out must be a contiguous CPU tensor of shape {expect} and dtype {info.dtype}; "
                f"got shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}, contiguous={out.is_contiguous()}"
            )
        _check_rows(name, "read of", start_row, n, info.shape[0])
        view = (out.view(_VIEW_AS[out.dtype]) if out.dtype in _VIEW_AS else out).numpy()
        arr = self._array(name)
        jobs = [
            functools.partial(self._read_chunk, arr, info, c, lo, hi, view[lo - start_row : hi - start_row])
            for c, lo, hi in _chunk_spans(start_row, n, info.chunk_rows)
        ]
        return self._run(jobs, priority=priority)

    def _read_chunk(self, arr: zarr.Array, info: ArrayInfo, c: int, lo: int, hi: int, dst: np.ndarray) -> None:
        fault = self._decode_chunk(arr, info, c, lo, hi, dst)
        if fault is not None:
            kind, what = fault
            fix = "the store is damaged: restore it from a copy, or re-import the weights into a new store"
            if self._path is not None:  # a run's store: its previous commit may still be whole
                fix = (f"the store is damaged: `mtc verify {self._path}` lists the damage and `mtc repair {self._path}` "
                       "rolls back to the newest commit whose state is whole, if there is one; else restore the store "
                       "from a copy, or re-import the weights into a new store")
            raise kind(f"array {info.name!r} chunk {c} {what}" + (f"; {fix}" if kind is StoreCorruptionError else ""))

    def _decode_chunk(
        self, arr: zarr.Array, info: ArrayInfo, c: int, lo: int, hi: int, dst: np.ndarray
    ) -> tuple[type[StoreError], str] | None:
        """Decode chunk ``c`` (rows [lo, hi)) into ``dst``; on failure (error type, what went wrong)."""
        name = info.name
        ndim = len(info.shape)
        where = f" ({self._local_chunk_path(name, c, ndim)})" if self._path is not None else ""
        if self._path is not None and self._is_fast(name, arr):
            flat = dst.reshape(-1).view(np.uint8)  # dst is a contiguous row range: its bytes in C order
            try:
                fault = read_chunk_file(self._local_chunk_path(name, c, ndim), _chunk_nbytes(arr), flat,
                                        (lo - c * info.chunk_rows) * (flat.nbytes // max(1, hi - lo)))
            except FileNotFoundError:
                return StoreCorruptionError, f"is missing{where}"
            except OSError as e:  # the disk failed us, not (necessarily) the data
                return StoreError, f"could not be read{where}: {e}"
            return None if fault is None else (StoreCorruptionError, f"{fault}{where}")
        if not self._chunk_exists(name, c, ndim):
            # zarr < 3.2 would quietly return the fill value (zeros): silent loss of state
            return StoreCorruptionError, f"is missing{where}"
        try:
            # decode straight into the caller's memory (no temporary array per chunk)
            arr.get_basic_selection(slice(lo, hi), out=default_buffer_prototype().nd_buffer.from_numpy_array(dst))
        except OSError as e:  # the disk failed us, not (necessarily) the data
            return StoreError, f"could not be read{where}: {e}"
        except Exception as e:  # noqa: BLE001 -- "Stored and computed checksum do not match", a short chunk, ...
            return StoreCorruptionError, f"failed its CRC32C checksum or could not be decoded{where}: {e}"
        return None

    # -- commits --------------------------------------------------------------------------------

    def commit(self, record: CommitRecord) -> None:
        """Make ``record`` the store's last commit (atomically, durably) and append it to the history.

        Array metadata created since the last commit is made durable first, so a commit never
        refers to arrays a crash could lose. The first commit turns the directory into a store
        (see `mtc.store.directory`). The record's RNG states go to its generation's resume file,
        and its config and data identity to a context file written once per change (see
        `mtc.store.directory`), so the history line stays small. A failed write (no space,
        read-only file system) raises StoreError and leaves the previous commit as it was.
        """
        self._check_writable()
        if not isinstance(record, CommitRecord):
            raise StoreError(f"commit takes a CommitRecord, got {type(record).__name__}")
        if record.durability not in DURABILITY_MODES:
            raise StoreError(
                f"commit record for step {record.step} has durability {record.durability!r}; use one of {', '.join(DURABILITY_MODES)}"
            )
        try:
            record.to_json()
        except TypeError as e:
            raise StoreError(f"commit record for step {record.step} is not JSON-serialisable: {e}") from e
        if self._path is None:
            self._commit = record
            self._history.append(record)
            return
        previous = None if self._uncommitted else self._last_commit_or_none()
        stored, resume = split_resume(record)
        from_files = resume is None and bool(stored.resume)  # a record read back: its RNG states are in its resume file
        if from_files:
            try:
                read_resume(self._path, stored)
            except (ValueError, OSError) as e:
                raise StoreError(f"cannot commit step {record.step} again: the RNG states its record names are gone ({e}); "
                                 "commit a record that carries its rng_state") from e
        try:
            self._sync_metadata()
        except OSError as e:
            raise StoreError(
                f"fsync of new array metadata in {self._path} failed before the commit of step {record.step}: "
                f"{os_error_message(e)}; the last commit is unchanged"
            ) from e
        try:
            write_commit(self._path, stored, first=self._uncommitted, previous=previous, resume=resume)
        except StoreError:
            # a failure after the rename (the directory fsync) leaves the new commit in place: ask the disk
            self._commit_loaded = False
            self._uncommitted = dir_state(self._path) == "uncommitted"
            raise
        self._uncommitted = False
        if from_files:
            self._commit_loaded = False  # read back with its RNG states
        else:
            self._commit, self._commit_loaded = dataclasses.replace(record, resume=stored.resume), True

    def restore_commit(self, record: CommitRecord, *, append_to_history: bool = False) -> None:
        """Rewrite ``commit.json`` as ``record`` without a new history line (for `mtc.store.verify.repair`).

        ``append_to_history``: also append it to ``commits.jsonl`` (when the history lost it).
        """
        self._check_writable()
        if self._path is None:
            raise StoreError("restore_commit is for store directories; an in-memory store has no commit files")
        if record.resume:  # its RNG states stay in its resume file
            record = dataclasses.replace(record, rng_state={})
        replace_commit_file(self._path, record)
        if append_to_history:
            try:
                append_history(self._path, record)
            except OSError as e:
                raise StoreError(
                    f"{commit_path(self._path)} was restored, but appending it to {self._path / HISTORY_FILE} failed: "
                    f"{os_error_message(e)}"
                ) from e
        self._commit_loaded = False  # read back with its RNG states

    def last_commit(self, *, rng: bool = True) -> CommitRecord | None:
        """The last committed record (with its RNG states), or None before the first commit.

        ``rng=False``: for readers of the weights only (eval, generate, export, a warm start): a
        resume file that is missing or damaged leaves the record's ``rng_state`` empty instead of
        raising, since only a resume needs those states (`mtc repair` would roll back whole steps
        whose weights are intact)."""
        self._check_open()
        if not self._commit_loaded:
            record, whole = self._read_last_commit(rng)
            if not whole:
                return record  # (not kept: a resume asking next must still be told)
            self._commit, self._commit_loaded = record, True
        return self._commit

    def _read_last_commit(self, rng: bool = True) -> tuple[CommitRecord | None, bool]:
        """(the record, whether its RNG states were read); see `last_commit`."""
        assert self._path is not None
        f = commit_path(self._path)
        for _ in range(3):  # (a run holding the store may commit between the two reads: read again)
            try:
                record = read_commit_file(self._path)
            except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
                raise StoreCorruptionError(
                    f"commit record {f} is malformed ({e}); the store's last commit cannot be read: "
                    f"`mtc repair {self._path}` restores it from {HISTORY_FILE}"
                ) from None
            except OSError as e:
                raise StoreError(f"reading commit record {f} failed: {os_error_message(e)}") from e
            if record is None:
                if not self._uncommitted:
                    raise StoreCorruptionError(
                        f"commit record {f} is missing; `mtc repair {self._path}` restores it from {HISTORY_FILE}"
                    )
                return None, True
            try:
                return dataclasses.replace(record, rng_state=read_resume(self._path, record)), True
            except OSError as e:
                if not rng:
                    return record, False
                raise StoreError(f"reading the resume file of step {record.step} failed: {os_error_message(e)}") from e
            except ValueError as e:
                if not rng:
                    return record, False
                try:
                    moved = read_commit_file(self._path) != record
                except (ValueError, TypeError, OSError):
                    moved = False
                if moved:
                    continue
                raise StoreCorruptionError(
                    f"the RNG states of step {record.step}'s commit cannot be read ({e}), so no run can resume it exactly: "
                    f"`mtc repair {self._path}` rolls back to the newest earlier commit whose state is whole"
                ) from None
        raise StoreError(f"{f} changed three times while it was read: a run holding the store commits too fast to read "
                         "it beside; read it again, or once the run has stopped")

    def commit_history(self) -> list[CommitRecord]:
        """Every commit so far, oldest first (for `mtc inspect`; `last_commit` is authoritative).

        Lines torn by a crash mid-append are skipped. A record whose RNG states are in a resume
        file has ``rng_state`` empty (`last_commit` fills it in).
        """
        self._check_open()
        if self._path is None:
            return list(self._history)
        return [h.record for h in read_history(self._path) if h.record is not None]

    def _last_commit_or_none(self) -> CommitRecord | None:
        try:
            return self.last_commit()
        except StoreError:
            return None  # damaged: the error message then speaks of "the last commit" without a step

    # -- internals ------------------------------------------------------------------------------

    def _where(self) -> str:
        return str(self._path) if self._path is not None else "<memory>"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store {self._where()} is closed; open it again with TensorStore.open")

    def _check_writable(self) -> None:
        self._check_open()
        if self._read_only:
            raise StoreError(
                f"store {self._where()} was opened read-only; open it with TensorStore.open({str(self._path)!r}) "
                "(not read_only) to write or commit"
            )

    def _open_array(self, name: str) -> zarr.Array | None:
        """The array ``name`` (cached), or None if there is none."""
        arr = self._arrays.get(name)
        if arr is not None:
            return arr
        with self._meta_lock:
            if name in self._arrays:
                return self._arrays[name]
            arr = self._load_array(name)
            if arr is not None:
                self._arrays[name] = arr
            return arr

    def _load_array(self, name: str) -> zarr.Array | None:
        """Array ``name`` as its metadata is on disk now (not cached), or None if there is none."""
        try:
            # zarr < 3.2 ignores open_array(config=...), so the runtime config is applied here
            mode = "r" if self._read_only else "r+"
            return zarr.open_array(store=self._zstore, path=name, mode=mode).with_config(_ARRAY_CONFIG)
        except (FileNotFoundError, KeyError, NodeNotFoundError):
            return None
        except NodeTypeValidationError:
            return None  # a group of that name, not an array
        except Exception as e:
            raise StoreCorruptionError(
                f"metadata of array {name!r} in store {self._where()} cannot be read ({e}); restore the store from a copy"
            ) from e

    def _array(self, name: str) -> zarr.Array:
        self._check_open()
        arr = self._open_array(name)
        if arr is None:
            raise StoreError(f"no array {name!r} in store {self._where()}; `mtc inspect --arrays` lists them")
        return arr

    def _info(self, name: str, arr: zarr.Array) -> ArrayInfo:
        dt_name = arr.attrs.get("mtc_dtype")
        dtype = _BY_NAME.get(dt_name) if isinstance(dt_name, str) else None
        if dtype is None or np.dtype(arr.dtype) != _DTYPES[dtype][0]:
            raise StoreCorruptionError(
                f"array {name!r} in store {self._where()} has dtype attribute {dt_name!r} and stored dtype {arr.dtype}, "
                "which do not match any mtc dtype; it was not written by mtc, or its metadata is damaged"
            )
        shape = tuple(int(s) for s in arr.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return ArrayInfo(name, shape, dtype, int(arr.chunks[0]), nbytes)

    def _scan_nodes(self) -> dict[str, dict[str, Any] | str]:
        """Every zarr node's parsed ``zarr.json`` by node name ("" is the root), or why it does not parse.

        Read from the files (or the memory store's dict) instead of through zarr, which stops at
        the first unreadable node.
        """
        if self._mem is None:
            assert self._path is not None
            return scan_nodes(self._path)
        return {
            key[: -len("zarr.json")].rstrip("/"): parse_node(buf.to_bytes)
            for key, buf in list(self._mem.items())
            if key == "zarr.json" or key.endswith("/zarr.json")
        }

    def _meta_file(self, name: str) -> str:
        if self._path is None:
            return f"{name}/zarr.json" if name else "zarr.json"
        return str(self._path.joinpath(*name.split("/"), "zarr.json") if name else self._path / "zarr.json")

    @staticmethod
    def _chunk_key(name: str, c: int, ndim: int) -> str:
        return "/".join([name, "c", str(c), *(["0"] * (ndim - 1))])

    def _local_chunk_path(self, name: str, c: int, ndim: int) -> Path:
        assert self._path is not None
        return self._path.joinpath(*self._chunk_key(name, c, ndim).split("/"))

    def _chunk_exists(self, name: str, c: int, ndim: int) -> bool:
        if self._mem is not None:
            return self._chunk_key(name, c, ndim) in self._mem
        return self._local_chunk_path(name, c, ndim).is_file()

    def _sync_metadata(self) -> None:
        """fsync metadata files and directories created since the last call (deepest first)."""
        with self._meta_lock:
            pending, self._unsynced = self._unsynced, set()
        todo = sorted(pending, key=lambda q: len(q.parts), reverse=True)
        for i, p in enumerate(todo):
            try:
                if p.exists():
                    _fsync(p, directory=p.is_dir())
            except BaseException:
                with self._meta_lock:  # still not durable: the next commit or close tries again
                    self._unsynced.update(todo[i:])
                raise

    def _is_fast(self, name: str, arr: zarr.Array) -> bool:
        """Whether ``name``'s chunks are exactly what `mtc.store.fastio` reads and writes: a
        little-endian ``bytes`` serializer and one ``crc32c`` codec, nothing else."""
        ok = self._fast.get(name)
        if ok is None:
            try:
                codecs = arr.metadata.to_dict().get("codecs", [])
                names = [(cd.get("name"), (cd.get("configuration") or {}).get("endian", "little")) for cd in codecs]
                ok = names == [("bytes", "little"), ("crc32c", "little")] and np.dtype(arr.dtype).byteorder != ">"
            except Exception:  # noqa: BLE001 -- unknown metadata: zarr's own path reads it
                ok = False
            self._fast[name] = ok
        return ok and self.direct_io

    def _mark_worker(self) -> None:
        self._tls.worker = True

    def _run(self, jobs: list[Callable[[], None]], then: Callable[[], Any] | None = None, *,
             priority: int = PRIORITY_READ) -> Future[None]:
        """Run ``jobs`` on the I/O pool, then ``then``; one Future for all (first chunk's error wins)."""
        done: Future[None] = Future()
        done.set_running_or_notify_cancel()
        if getattr(self._tls, "worker", False):
            # called from one of our own I/O threads: waiting on the pool here could deadlock it
            try:
                for job in jobs:
                    job()
                if then is not None:
                    then()
                done.set_result(None)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller through the Future
                done.set_exception(e)
            return done
        lock = threading.Lock()
        left = [len(jobs)]
        errors: list[tuple[int, BaseException]] = []

        def finish() -> None:
            if errors:
                done.set_exception(min(errors, key=lambda e: e[0])[1])
                return
            try:
                if then is not None:
                    then()
            except OSError as e:
                done.set_exception(StoreError(f"fsync in store {self._where()} failed: {e}"))
                return
            except BaseException as e:  # noqa: BLE001 -- handed to the caller through the Future
                done.set_exception(e)
                return
            done.set_result(None)

        def one_done(i: int, fut: Future[None]) -> None:
            exc = fut.exception()
            with lock:
                if exc is not None:
                    errors.append((i, exc))
                left[0] -= 1
                last = left[0] == 0
            if last:
                finish()

        if not jobs:
            finish()
            return done
        try:
            futs = [self._pool.submit(job, priority) for job in jobs]
        except RuntimeError as e:  # the pool was shut down: closed under our feet
            raise StoreError(f"store {self._where()} is closed; open it again with TensorStore.open") from e
        for i, f in enumerate(futs):
            f.add_done_callback(functools.partial(one_done, i))
        return done

    @staticmethod
    def _wait(fut: Future[None]) -> None:
        fut.result()


def _why_uncommitted(p: Path) -> str:
    """Why the uncommitted store ``p`` has no commit, and what to do.

    A run with durability 'none' commits nothing, also when it trains to the end; the trainer's
    config log (``logs/config-step0.json``, written once set-up is done) tells it from a set-up
    that never finished, which the same command starts over.
    """
    try:
        config = json.loads((p / "logs" / "config-step0.json").read_text())
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and config.get("durability") == "none":
        return ("its run trained with durability 'none', which commits nothing: there are no weights to read or resume "
                f"(to keep them, train with `--durability weights` or `full`: `mtc train ... --store {p}` starts the store over)")
    return (f"the run that created it stopped during set-up (or is still setting it up); run the same `mtc train ... --store {p}` "
            "command again: it starts the store over")


def _raise_if_held(p: Path) -> None:
    """Raise StoreLockedError when another handle holds the lock of the mtc store in ``p``.

    `create` refuses a committed store before it locks (so a foreign directory gets no lock
    file), but a run that committed it a moment ago and still holds it must be reported as the
    holder: "resume it with the same command" would be wrong advice while that run goes on.
    """
    if dir_state(p) not in ("committed", "uncommitted") or not (p / LOCK_FILE).is_file():
        return
    try:
        fd = lock_store(p)
    except StoreLockedError:
        raise
    except StoreError:
        return  # cannot even try the lock (permissions): the caller's own refusal says enough
    unlock_store(fd)


def io_bounce_bytes(largest_numel: int, io_threads: int, itemsize: int = 4) -> int:
    """Host RAM a store on disk with ``io_threads`` I/O threads may hold in their bounce buffers
    (`mtc.store.fastio`) for 1-D arrays of at most ``largest_numel`` elements of ``itemsize`` bytes
    (the default chunking): one per thread, as large as a chunk file's unaligned part may need, at
    most `fastio.BOUNCE_MAX`, kept for the run. An upper bound: page-aligned whole pages go direct."""
    if largest_numel <= 0:
        return 0
    chunk = min(largest_numel, max(1, _CHUNK_BYTES // itemsize)) * itemsize
    return io_threads * bounce_bytes(chunk)


def _chunk_nbytes(arr: zarr.Array) -> int:
    """Data bytes of one chunk file (edge chunks are stored at full size, padded with the fill value)."""
    return int(np.prod(arr.chunks, dtype=np.int64)) * np.dtype(arr.dtype).itemsize


def _chunk_spans(start: int, n: int, rows: int) -> list[tuple[int, int, int]]:
    """(chunk index, first row, end row) of every chunk that rows [start, start + n) touch."""
    return [(c, max(start, c * rows), min(start + n, (c + 1) * rows)) for c in range(start // rows, -(-(start + n) // rows))]


def _check_rows(name: str, what: str, start: int, n: int, total: int) -> None:
    if not isinstance(start, int) or isinstance(start, bool) or start < 0 or start + n > total:
        raise StoreError(f"{what} array {name!r}: rows [{start}, {start}+{n}) do not fit its {total} rows")


def _as_shape(name: str, shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of ints: torch.Size and numpy integers are fine, floats and bools are not."""
    try:
        dims = tuple(shape)
        if any(isinstance(s, bool) for s in dims):
            raise TypeError
        return tuple(operator.index(s) for s in dims)
    except TypeError:
        raise StoreError(f"array {name!r}: shape must be a tuple of ints, got {shape!r}") from None


def _check_threads(io_threads: int) -> None:
    if not isinstance(io_threads, int) or io_threads < 1:
        raise StoreError(f"io_threads must be a positive int, got {io_threads!r}")


def _check_name(name: str) -> None:
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or not all(_NAME_PART.fullmatch(p) for p in parts) or parts[0] in _RESERVED:
        raise StoreError(
            f"bad array name {name!r}: use '/'-separated parts of letters, digits, '_', '-', '.', "
            f"not starting with '.', e.g. 'layers/0003/master/g1' (reserved: {', '.join(sorted(_RESERVED))})"
        )


_fsync = fsync_path
