"""A store directory's own files: the lock, the set-up marker and the commit records.

This module decides when a directory is a store, who may write it, and how a commit reaches
the disk; `mtc.store.tensor_store` holds the arrays. A store directory holds ``.lock`` (the
writer's ``flock``), ``commit.json`` (the last commit: the one a resume starts from) and
``commits.jsonl`` (every commit, oldest first), and per state generation g the resume file
``resume-g<g>.json`` (see below). A directory becomes a store only at its first commit; until
then it carries the set-up marker ``setup.json``:

* `TensorStore.create` writes the marker (and fsyncs it) before it makes anything else, and
  before it removes the commit files of a store it overwrites;
* the first commit writes its record *into the marker* and renames the marker to ``commit.json``.
  That one rename is the moment the directory becomes a store: no state is copied, and a crash
  at any point leaves either the marker (an uncommitted store, which ``create`` re-initialises
  and ``open`` refuses) or ``commit.json`` (a committed store);
* later commits write ``commit.json.tmp`` and rename it over ``commit.json``.

The RNG states a resume restores are kilobytes of base64 per commit, and the history keeps
every commit: they live in the resume file of the generation the commit names, not in its
record, which names the file's digest (``resume``). Only a generation still on disk can be
resumed from, so one file per generation holds all that is needed; it is rewritten (in place)
only by a commit into its generation, whose state writes had already made the older commit
there unusable. Records written before the resume files existed carry ``rng_state`` inline and
are read as they are.

Likewise the run's config and data identity (``config``, and ``meta["data"]`` and
``meta["changes"]``: `CONTEXT_META`) change only when a run is resumed with other settings, yet
took ~1.5 KB of every history line, and with disk layers every step commits. A history line
names them by digest (``context``), and ``contexts/<digest>.json`` holds them once, written
atomically (temp file, fsync, rename) before the first line that names it; `read_history`
puts them back, so a record read from the history equals the one committed. ``commit.json``
keeps its record whole: the last commit stands on its own, and `mtc.store.verify.repair`
rewrites a lost or damaged context file from it. History lines written before the context
files existed carry ``config`` and ``meta`` inline and are read as they are.

Write order of a commit: the generation's resume file (fsync: durable before any record names
it), the new record file (marker or tmp; fsync), then the context file if it is new, then the
history line (fsync), then the rename, then an fsync of the directory. So the history's last
record is never older than ``commit.json``; a crash between the append and the rename leaves the history one
record ahead (a commit that never completed: ``commit.json`` stays authoritative). When a write
fails (ENOSPC, EROFS, EIO) the history is truncated back and the temp file removed, so the
previous commit stays exactly as it was.

State of a directory (`dir_state`):

| files                                          | state         |
|------------------------------------------------|---------------|
| marker, no ``commit.json``                     | uncommitted   |
| ``commit.json`` (a leftover marker is ignored) | committed     |
| ``commits.jsonl`` only                         | committed (``commit.json`` lost: `mtc repair`) |
| an mtc ``zarr.json`` and none of the above     | no-commit (set up by an older mtc, or commit files lost) |
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from mtc.errors import StoreError, StoreLockedError

__all__ = [
    "COMMIT_FILE",
    "CONTEXT_DIR",
    "CONTEXT_META",
    "DURABILITY_MODES",
    "HISTORY_FILE",
    "LOCK_FILE",
    "MARKER_FILE",
    "RESUME_FILES",
    "RUNTIME_DIRS",
    "CommitRecord",
    "DirState",
    "HistoryLine",
    "append_line",
    "check_creatable",
    "context_file",
    "dir_state",
    "file_in_the_way",
    "lock_store",
    "read_commit_file",
    "read_context",
    "read_history",
    "read_resume",
    "read_write_starts",
    "record_write_start",
    "restore_context",
    "resume_file",
    "split_context",
    "split_resume",
    "unlock_store",
    "write_commit",
    "write_marker",
    "written_since",
]

LOCK_FILE = ".lock"
COMMIT_FILE = "commit.json"
COMMIT_TMP = COMMIT_FILE + ".tmp"
HISTORY_FILE = "commits.jsonl"
MARKER_FILE = "setup.json"
# one resume file per state generation (0 and 1: `mtc.store.layout.GENERATIONS`, which imports this module)
RESUME_FILES: tuple[str, ...] = ("resume-g0.json", "resume-g1.json")
# logs/writes.jsonl: one line per start of a state write into a generation (its step), appended and
# fsynced before the write begins, so a reader can tell whether a generation was written since a
# commit without trusting file times (a plain `cp -r` of a store resets them)
WRITES_LOG = "writes.jsonl"
# the run's config and data identity, once per change, named by the history lines (see the module docstring)
CONTEXT_DIR = "contexts"
# the fields of a record's meta that a run sets when it starts (the data's identity, the changes
# --allow-change let through), kept in the context file with the config rather than in every line
CONTEXT_META: tuple[str, ...] = ("data", "changes")
DURABILITY_MODES: tuple[str, ...] = ("full", "weights", "none")
# Made inside a store directory during set-up by the runtime (`trainer.open_run`), so `create`
# may remove them when it re-initialises an uncommitted store; anything else there is not ours.
RUNTIME_DIRS: tuple[str, ...] = ("plan", "logs")
_ZARR_TEMP = re.compile(r"zarr\.[0-9a-f]{32}\.partial")  # LocalStore's temp file of a metadata write

DirState = Literal["absent", "empty", "uncommitted", "committed", "no-commit", "foreign"]


@dataclasses.dataclass(frozen=True, slots=True)
class CommitRecord:
    """What a step commit records: enough to resume exactly.

    ``generation`` is the state generation (see `mtc.store.layout`) that holds the weights after
    ``step``; ``data_cursor`` is the position in the token stream; ``rng_state`` maps a generator
    name to its serialised state. ``durability`` says which arrays of that generation are on disk
    (``full``: master, m and v; ``weights``: master only; ``none``: nothing written after set-up),
    and so what `mtc.store.verify` requires. ``meta`` holds free-form fields of the engine (data
    identity, history of allowed changes). Records written before these two fields existed load
    as ``durability="full"``, ``meta={}``.

    ``resume`` is the digest of the generation's resume file, which holds ``rng_state`` on disk
    (`split_resume`): a record read from the commit files has ``rng_state`` empty until
    `read_resume` fills it (`TensorStore.last_commit` does). ``""``: the record carries its
    ``rng_state`` inline (written before resume files existed, or in memory). It takes no part
    in comparisons: a record read back equals the one committed.
    """

    step: int
    generation: int
    data_cursor: int
    rng_state: dict[str, str]
    config: dict[str, Any]
    time_unix: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    durability: str = "full"
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    resume: str = dataclasses.field(default="", compare=False)

    def to_json(self) -> str:
        """The record as one line of JSON."""
        d = dataclasses.asdict(self)
        if not d["resume"]:
            del d["resume"]  # a record without one is written as before (a shard record's digest hashes this text)
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CommitRecord:
        """Parse `to_json` output; raises ValueError or TypeError naming the first bad field."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: Any) -> CommitRecord:
        """A record from the parsed JSON object of `to_json`; ValueError or TypeError naming the first bad field."""
        if not isinstance(d, dict):
            raise TypeError(f"a commit record is a JSON object, got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(d) - fields):
            raise ValueError(f"unknown fields {unknown}")
        if missing := sorted(fields - set(d) - {"extra", "durability", "meta", "resume"}):
            raise ValueError(f"missing fields {missing}")
        for key in ("step", "generation", "data_cursor"):
            if not isinstance(d[key], int) or isinstance(d[key], bool):
                raise TypeError(f"{key} must be an integer, got {d[key]!r}")
        if not isinstance(d["time_unix"], (int, float)) or isinstance(d["time_unix"], bool):
            raise TypeError(f"time_unix must be a number, got {d['time_unix']!r}")
        rng = d["rng_state"]
        if not isinstance(rng, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in rng.items()):
            raise TypeError("rng_state must map names to strings")
        for key in ("config", "extra", "meta"):
            if not isinstance(d.get(key, {}), dict):
                raise TypeError(f"{key} must be a JSON object")
        if not isinstance(d.get("resume", ""), str):
            raise TypeError(f"resume must be a string (a resume file's digest), got {d['resume']!r}")
        if d.get("durability", "full") not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY_MODES)}, got {d['durability']!r}")
        return cls(**d)


@dataclasses.dataclass(frozen=True, slots=True)
class HistoryLine:
    """One line of ``commits.jsonl``: its record, or why it does not parse (a torn append)."""

    line_no: int
    record: CommitRecord | None
    error: str | None = None
    context: str = ""  # the digest of the context file the line names ("": config and meta inline)


def dir_state(p: Path) -> DirState:
    """What directory ``p`` is, by its commit files and marker (see the table in the module docstring)."""
    if not p.is_dir():
        return "absent"
    names = {c.name for c in p.iterdir()}
    if not names - {LOCK_FILE}:
        return "empty"
    if COMMIT_FILE in names:
        return "committed"
    if MARKER_FILE in names:
        return "uncommitted"
    if HISTORY_FILE in names:
        return "committed"
    return "no-commit" if is_mtc_root(p) else "foreign"


def is_mtc_root(p: Path) -> bool:
    """Whether ``p/zarr.json`` is the root group metadata of an mtc store."""
    try:
        return json.loads((p / "zarr.json").read_text()).get("attributes", {}).get("mtc_store") is not None
    except (OSError, ValueError, AttributeError):
        return False


def commit_path(p: Path) -> Path:
    """The ``commit.json`` of store directory ``p``."""
    return p / COMMIT_FILE


def read_commit_file(p: Path) -> CommitRecord | None:
    """The record in ``p/commit.json``; None if there is none; ValueError/TypeError if it is garbled."""
    f = p / COMMIT_FILE
    try:
        text = f.read_text()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e})") from None
    return CommitRecord.from_json(text)


def read_history(p: Path, *, known: CommitRecord | None = None) -> list[HistoryLine]:
    """Every line of ``p/commits.jsonl``, parsed or with its error; [] when there is no history.

    ``known``: a whole record (``commit.json``'s) whose context stands in for its context file
    when that file is missing or damaged.
    """
    try:
        text = (p / HISTORY_FILE).read_text(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    contexts: dict[str, dict[str, Any] | str] = {}  # digest -> its context, or why it cannot be read
    if known is not None:
        _line, ctx_text, digest = split_context(known)
        contexts[digest] = json.loads(ctx_text)
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        digest = ""
        try:
            d = json.loads(line)
            if isinstance(d, dict) and "context" in d:
                digest = d.pop("context")
                if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                    raise TypeError(f"context must be a context file's digest, got {digest!r}")
                if digest not in contexts:
                    try:
                        contexts[digest] = read_context(p, digest)
                    except (ValueError, OSError) as e:
                        contexts[digest] = str(e)
                ctx = contexts[digest]
                if isinstance(ctx, str):
                    raise ValueError(ctx)
                d = _with_context(d, ctx)
            out.append(HistoryLine(i, CommitRecord.from_dict(d), context=digest))
        except (ValueError, TypeError) as e:
            out.append(HistoryLine(i, None, str(e), context=digest))
    return out


_DIGEST = re.compile(r"[0-9a-f]{16}")


def context_file(p: Path, digest: str) -> Path:
    """The context file of ``digest`` in store directory ``p``."""
    return p / CONTEXT_DIR / f"{digest}.json"


def split_context(record: CommitRecord) -> tuple[str, str, str]:
    """``record``'s history line (without its newline), which names its context by digest; the
    text of that context file; and the digest."""
    context = {"config": record.config, "meta": {k: record.meta[k] for k in CONTEXT_META if k in record.meta}}
    text = json.dumps(context, separators=(",", ":"), sort_keys=True) + "\n"
    digest = _digest(text.encode())
    d = dataclasses.asdict(record)
    del d["config"]
    d["meta"] = {k: v for k, v in record.meta.items() if k not in CONTEXT_META}
    for key in ("rng_state", "extra", "meta", "resume"):  # empty ones come back as their defaults (`_with_context`)
        if not d[key]:
            del d[key]
    d["context"] = digest
    return json.dumps(d, separators=(",", ":"), sort_keys=True), text, digest


def _with_context(d: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    """The history line ``d`` (its ``context`` taken out) with its context put back: a whole record's fields."""
    meta = d.get("meta", {})
    if not isinstance(meta, dict):
        raise TypeError("meta must be a JSON object")
    if both := sorted(set(meta) & set(context["meta"])):
        raise ValueError(f"meta fields {both} are both in the line and in its context file")
    return {**d, "rng_state": d.get("rng_state", {}), "extra": d.get("extra", {}), "config": context["config"],
            "meta": {**meta, **context["meta"]}}


def read_context(p: Path, digest: str) -> dict[str, Any]:
    """The context (``{"config": ..., "meta": ...}``) that history lines of store directory ``p``
    name by ``digest``. ValueError saying why when its file does not hold it (missing, or damaged:
    its content has another digest); OSError when it cannot be read."""
    f = context_file(p, digest)
    try:
        blob = f.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"context file {f} (the run's config and data identity) is missing") from None
    if (got := _digest(blob)) != digest:
        raise ValueError(f"context file {f} is damaged (its content has digest {got})")
    context = json.loads(blob)  # (the digest matched: the text a commit wrote)
    return {"config": dict(context["config"]), "meta": dict(context["meta"])}


def restore_context(p: Path, record: CommitRecord) -> str | None:
    """Write the context file of ``record`` (a whole record, as ``commit.json`` keeps it) unless it
    is there and whole; return the digest when it was (re)written, else None. Raises OSError."""
    _line, text, digest = split_context(record)
    f = context_file(p, digest)
    try:
        if f.read_bytes() == text.encode():
            return None
    except FileNotFoundError:
        pass
    d = f.parent
    if not d.is_dir():
        d.mkdir(exist_ok=True)
        fsync_path(p, directory=True)  # the directory's name must be durable before a line names a file in it
    tmp = d / f"{digest}.json.tmp"
    try:
        _write_synced(tmp, text)
        os.replace(tmp, f)  # atomic: a reader sees no file or the whole file
    except OSError:
        _unlink_quietly(tmp)
        raise
    fsync_path(d, directory=True)
    return digest


def resume_file(p: Path, generation: int) -> Path:
    """The resume file of state ``generation`` in store directory ``p``."""
    if generation not in (0, 1) or isinstance(generation, bool):
        raise ValueError(f"generation must be 0 or 1, got {generation!r}")
    return p / RESUME_FILES[generation]


def split_resume(record: CommitRecord) -> tuple[CommitRecord, str | None]:
    """``record`` as the commit files keep it, and the text of its generation's resume file (None:
    nothing to write, the record has no RNG states to move out)."""
    if not record.rng_state:
        return record, None
    text = json.dumps({"generation": record.generation, "step": record.step, "rng_state": record.rng_state},
                      separators=(",", ":"), sort_keys=True) + "\n"
    return dataclasses.replace(record, rng_state={}, resume=_digest(text.encode())), text


def read_resume(p: Path, record: CommitRecord) -> dict[str, str]:
    """The RNG states a resume from ``record`` restores: its own when it carries them inline, else
    those in its generation's resume file in ``p``. ValueError saying why when that file does not
    hold them (missing, damaged, or rewritten by a later commit into the generation); OSError when
    it cannot be read."""
    if not record.resume:
        return record.rng_state
    f = resume_file(p, record.generation)
    try:
        blob = f.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{f} is missing") from None
    if (got := _digest(blob)) != record.resume:
        raise ValueError(f"{f} has digest {got}, step {record.step}'s record names {record.resume}: the file is damaged, "
                         "or a later commit into the generation rewrote it")
    rng = json.loads(blob)["rng_state"]  # (the digest matched: the text commit wrote)
    return {str(k): str(v) for k, v in rng.items()}


def _digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()[:16]


def write_marker(p: Path) -> None:
    """Write the set-up marker (durably): from now on ``p`` is an uncommitted store until the first commit."""
    text = json.dumps({"mtc_store_setup": 1, "pid": os.getpid()}) + "\n"
    _write_synced(p / MARKER_FILE, text)
    fsync_path(p, directory=True)


def write_commit(p: Path, record: CommitRecord, *, first: bool, previous: CommitRecord | None,
                 resume: str | None = None) -> None:
    """Commit ``record`` in directory ``p`` (see the module docstring for the order of writes).

    ``first``: the store is uncommitted and the marker becomes ``commit.json``. ``previous`` is
    the last commit, named in the error message when a write fails. ``resume``: the text of the
    resume file of ``record``'s generation (`split_resume`), written first.
    """
    if resume is not None:
        _write_resume(p, record, resume, previous, first=first)
    text = record.to_json() + "\n"
    tmp, final, hist = p / (MARKER_FILE if first else COMMIT_TMP), p / COMMIT_FILE, p / HISTORY_FILE
    try:
        hist_size = hist.stat().st_size
    except FileNotFoundError:
        hist_size = None
    except OSError as e:
        raise commit_error(e, hist, record, previous, first=first) from e
    try:
        _write_synced(tmp, text)
    except OSError as e:
        if not first:  # the marker itself must stay: without it the directory would look damaged
            _unlink_quietly(tmp)
        raise commit_error(e, tmp, record, previous, first=first) from e
    try:
        append_history(p, record)
    except OSError as e:
        _truncate_quietly(hist, hist_size)
        if not first:
            _unlink_quietly(tmp)
        raise commit_error(e, hist, record, previous, first=first) from e
    try:
        os.replace(tmp, final)  # atomic: readers see the old record or the new one, never half
    except OSError as e:
        _truncate_quietly(hist, hist_size)
        if not first:
            _unlink_quietly(tmp)
        raise commit_error(e, final, record, previous, first=first) from e
    try:
        fsync_path(p, directory=True)  # the rename and a new history file
    except OSError as e:
        # too late to undo: the new commit is in place, only its durability is in doubt
        raise StoreError(
            f"commit of step {record.step} was written to {final}, but the fsync of directory {p} failed ({e}); "
            "it may not survive a power loss: check the disk, then `mtc verify` the store"
        ) from e


def _write_resume(p: Path, record: CommitRecord, text: str, previous: CommitRecord | None, *, first: bool) -> None:
    """Write the resume file of ``record``'s generation as ``text`` and fsync it, before any record names it.

    In place, as the disk tier writes the state of the generation no commit names: the commit
    the file held before is the older one in this generation, whose state this step's writes
    have begun to overwrite already, and a torn file no longer matches any record's digest. One
    fsync per commit, not the three of a temp file, a rename and a directory fsync (each ~4 ms
    on the 2-core VM). Re-committing a step into the same generation (a reshard) writes the same
    bytes, so the file never stops matching the last commit; it is not truncated first for that.
    """
    final = resume_file(p, record.generation)
    data = text.encode()
    try:
        created = not final.exists()
        fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:  # (twice in a store's life) the new name must be durable before a record names it
            fsync_path(p, directory=True)
    except OSError as e:
        raise commit_error(e, final, record, previous, first=first) from e


def append_history(p: Path, record: CommitRecord) -> None:
    """Append ``record`` to ``p/commits.jsonl`` (writing its context file first if it is new) and
    fsync it; raises OSError."""
    restore_context(p, record)
    line, _text, _digest = split_context(record)
    with open(p / HISTORY_FILE, "a+b") as f:
        # a crash mid-append leaves a torn line without "\n": end it so the next record is whole
        torn = False
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + line.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def replace_commit_file(p: Path, record: CommitRecord) -> None:
    """Atomically rewrite ``p/commit.json`` as ``record`` (no history line): for `repair`."""
    tmp = p / COMMIT_TMP
    try:
        _write_synced(tmp, record.to_json() + "\n")
        os.replace(tmp, p / COMMIT_FILE)
        fsync_path(p, directory=True)
    except OSError as e:
        _unlink_quietly(tmp)
        raise StoreError(f"writing {p / COMMIT_FILE} failed ({os_error_reason(e)}); nothing was changed: {_fix(e)}") from e


def commit_error(e: OSError, file: Path, record: CommitRecord, previous: CommitRecord | None, *, first: bool) -> StoreError:
    """One clear StoreError for an OSError while committing ``record``."""
    if first:
        kept = "the store stays uncommitted: the same `mtc train` command starts it over"
    elif previous is None:
        kept = "the last commit is unchanged"
    else:
        kept = f"the last commit (step {previous.step}) is intact"
    return StoreError(f"{os_error_reason(e)} writing {file} (commit of step {record.step}); {kept}; {_fix(e)}")


def os_error_message(e: OSError) -> str:
    """The cause of ``e`` in words, with how to fix it."""
    return f"{os_error_reason(e)}; {_fix(e)}"


def file_in_the_way(path: str | os.PathLike[str]) -> Path | None:
    """The file that keeps ``path`` from being (or becoming) a directory: ``path`` itself or the
    nearest existing folder above it when that is not a directory; None when nothing is in the way."""
    for p in (Path(path), *Path(path).parents):
        if os.path.lexists(p):
            # a symlink to a directory is a directory here; a dangling one is in the way
            return None if p.is_dir() else p
    return None


def os_error_reason(e: OSError) -> str:
    """The cause of ``e`` in a few words ("no space left on device")."""
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and e.filename is not None and (f := file_in_the_way(e.filename)):
        # not the disk but the path: a file stands where a directory of it should be (the store
        # creates no file exclusively, so its EEXIST is a mkdir's, over something not a directory)
        what = "a broken symlink" if f.is_symlink() and not f.exists() else "a file"
        return f"{f} is {what}, not a directory" if f == Path(e.filename) else \
            f"{f}, a parent of {e.filename}, is {what}, not a directory"
    if e.errno == errno.ENOSPC:
        return "no space left on device"
    if e.errno == errno.EDQUOT:
        return "disk quota exceeded"
    if e.errno == errno.EROFS:
        return "read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return f"I/O error ({e.strerror or e})"


def _fix(e: OSError) -> str:
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and e.filename is not None and (f := file_in_the_way(e.filename)):
        return f"move {f} away"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space on that file system, then resume with the same command"
    if e.errno == errno.EROFS:
        return "remount the file system read-write (or copy the store elsewhere), then resume"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "fix the permissions of the store directory, then resume"
    return "check the disk (dmesg), then resume with the same command"


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path | str, *, directory: bool = False) -> None:
    """fsync a file or directory by path (fsync through a read-only descriptor is enough on Linux)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # best effort: a leftover temp file is ignored by readers and replaced by the next commit


def _truncate_quietly(path: Path, size: int | None) -> None:
    """Undo a failed append: cut the history back to ``size`` bytes (None: it did not exist)."""
    try:
        if size is None:
            path.unlink(missing_ok=True)
        else:
            os.truncate(path, size)
    except OSError:
        pass  # best effort: readers skip a torn last line, and the next append ends it first


def check_creatable(p: Path, overwrite: bool) -> None:
    """Raise StoreError unless `TensorStore.create` may (re-)initialise directory ``p``."""
    state = dir_state(p)
    if state in ("absent", "empty"):
        return
    if state == "uncommitted":
        if foreign := _not_ours(p):
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise StoreError(
                f"cannot re-initialise the uncommitted store {p}: it also holds {shown}, which mtc did not make; "
                "move those away, or use another directory"
            )
        return  # a set-up that never reached its first commit: start it over
    content = sorted(c.name for c in p.iterdir() if c.name != LOCK_FILE)
    shown = ", ".join(content[:5]) + (", ..." if len(content) > 5 else "")
    if not overwrite:
        if state == "committed":
            lost = "" if (p / COMMIT_FILE).exists() else f" (its {COMMIT_FILE} is missing: `mtc repair {p}` restores it)"
            raise StoreError(
                f"cannot create a store at {p}: it already holds a committed mtc store{lost}; resume it with the same "
                "`mtc train` command, or pass overwrite=True (`--overwrite`) to replace it"
            )
        raise StoreError(
            f"cannot create a store at {p}: the directory is not empty ({shown}); "
            "use a new or empty directory, or pass overwrite=True (`--overwrite`) to replace a store there"
        )
    if not is_mtc_root(p):
        raise StoreError(
            f"refusing to overwrite {p}: it is not empty and not an mtc store ({shown}); "
            "remove its contents yourself or use another directory"
        )


def _not_ours(p: Path) -> list[str]:
    """Top-level entries of uncommitted store ``p`` that mtc did not make (sorted)."""
    ours = {LOCK_FILE, MARKER_FILE, COMMIT_TMP, HISTORY_FILE, CONTEXT_DIR, "zarr.json", *RUNTIME_DIRS, *RESUME_FILES}
    out = []
    for c in p.iterdir():
        if c.name in ours or _ZARR_TEMP.fullmatch(c.name):
            continue
        if c.is_dir() and not c.is_symlink() and (c / "zarr.json").is_file():
            continue  # a zarr node: the arrays (layers/...) made by `create_array`
        out.append(c.name)
    return sorted(out)


def lock_store(path: Path) -> int:
    """Take the exclusive lock of store ``path``; return the lock file's descriptor."""
    # O_CLOEXEC: a subprocess the trainer starts must not inherit (and so keep) the lock
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        # not the disk but the path (e.g. a directory removed since it was checked): say which
        if e.errno == errno.ENOENT:
            raise StoreError(
                f"no store at {path}: the directory does not exist; a new run creates its store (`mtc train --store {path} "
                f"...`, TensorStore.create({str(path)!r})), or give the directory of an existing store"
            ) from e
        if e.errno == errno.ENOTDIR:
            raise StoreError(f"no store at {path}: a part of that path is a file, not a directory; pick a directory path") from e
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise StoreError(f"cannot open the lock file {path / LOCK_FILE}: {os_error_message(e)}") from e
        raise StoreError(
            f"cannot lock store {path}: {os_error_reason(e)} on {path / LOCK_FILE}; "
            f"to only read the store, open it read-only (`mtc inspect {path}`, TensorStore.open(path, read_only=True)); "
            "to write it, fix the permissions (or copy the store to a writable place)"
        ) from e
    try:
        # flock locks belong to the open file description, so a second handle in this same
        # process conflicts too, as it should (two handles would interleave writes)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        if holder == str(os.getpid()):
            raise StoreLockedError(
                f"store {path} is locked by this process (pid {holder}) through another open handle (e.g. the result of an earlier "
                "mtc.train call: call its .close(), or use `with mtc.train(...) as res:`); close that handle, "
                "or use another store directory"
            ) from None
        raise StoreLockedError(
            f"store {path} is locked by pid {holder}; stop the other run, or use another store directory"
        ) from None
    except OSError as e:
        os.close(fd)
        raise StoreError(f"cannot lock store {path} ({e}); put the store on a local filesystem that supports flock") from e
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_store(fd: int) -> None:
    """Release the lock `lock_store` took and close its descriptor."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def scan_nodes(root: Path) -> dict[str, dict[str, Any] | str]:
    """Each zarr node's parsed ``zarr.json`` under ``root``, by node name ("" is the root), or why it does not parse.

    Chunk directories (below an array, or below a node that does not parse) and the runtime's
    directories are not entered, so the walk costs one step per node, not one per chunk.
    """
    out: dict[str, dict[str, Any] | str] = {}
    for d, dirs, files in os.walk(root):
        rel = Path(d).relative_to(root).as_posix()
        rel = "" if rel == "." else rel
        if rel == "":
            dirs[:] = [x for x in dirs if x not in RUNTIME_DIRS and x != CONTEXT_DIR]
        if "zarr.json" not in files:
            continue
        doc = out[rel] = parse_node((Path(d) / "zarr.json").read_bytes)
        if isinstance(doc, dict) and doc.get("node_type") == "group":
            continue
        if isinstance(doc, str) and looks_like_group(Path(d), dirs):
            continue  # a group whose metadata is garbled: the nodes below it are still there, and checked
        dirs[:] = []
    return out


def looks_like_group(d: Path, subdirs: list[str] | None = None) -> bool:
    """Whether the node directory ``d`` holds child nodes (a directory with a ``zarr.json``) and
    no chunk directory: a group, whatever its own metadata says."""
    subdirs = [x.name for x in d.iterdir() if x.is_dir()] if subdirs is None else subdirs
    return "c" not in subdirs and any((d / x / "zarr.json").is_file() for x in subdirs)


GROUP_METADATA = {"attributes": {}, "zarr_format": 3, "node_type": "group"}  # what zarr writes for a plain group


def parse_node(read: Callable[[], bytes]) -> dict[str, Any] | str:
    """A node's metadata document, or why it cannot be read or parsed."""
    try:
        doc = json.loads(read())
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return str(e) or type(e).__name__
    return doc if isinstance(doc, dict) else f"a JSON {type(doc).__name__}, not an object"


def append_line(path: Path, line: str, *, sync: bool = False) -> None:
    """Append ``line`` and a newline to a log, on a line of its own: a crash mid-write leaves a torn
    last line, and the next record must not be glued onto it (a reader skips the torn line, and
    would lose the record with it)."""
    with open(path, "ab+") as f:
        end = f.seek(0, os.SEEK_END)
        lead = b""
        if end:
            f.seek(end - 1)
            lead = b"" if f.read(1) == b"\n" else b"\n"
        f.write(lead + line.encode("utf-8") + b"\n")  # (append mode: at the end, wherever the seek was)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def record_write_start(store_dir: str | Path, step: int, generation: int) -> None:
    """Note durably that writes of ``step``'s state into ``generation`` begin now (before they do);
    StoreError when it cannot be noted (then nothing of that step is written)."""
    logs = Path(store_dir) / "logs"
    try:
        logs.mkdir(exist_ok=True)
        append_line(logs / WRITES_LOG, json.dumps({"step": step, "generation": generation}), sync=True)
    except OSError as e:
        raise StoreError(f"writing {logs / WRITES_LOG} failed ({os_error_reason(e)}) before step {step}'s state was "
                         f"written: the last commit is intact; {_fix(e)}") from e


def read_write_starts(store_dir: str | Path) -> list[dict[str, Any]] | None:
    """The write starts `record_write_start` logged in ``store_dir`` (None: no log, e.g. a store made
    before the log existed, or a data-parallel rank's shard store: its run directory keeps it)."""
    f = Path(store_dir) / "logs" / WRITES_LOG
    if not f.is_file():
        return None
    out = []
    for line in f.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash: its write never began
    return out


def written_since(starts: list[dict[str, Any]], step: int, generation: int) -> bool:
    """Whether the log ``starts`` shows a write of a later step than ``step`` into ``generation``."""
    return any(s.get("generation") == generation and s.get("step", 0) > step for s in starts)
