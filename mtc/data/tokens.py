"""The token file format: a raw token array on disk, a small JSON header, optional sidecars.

``<name>.bin`` holds the tokens as a flat little-endian ``uint16`` array (vocabulary <= 65536) or
``uint32`` array (larger vocabularies), nothing else, so it can be memory-mapped and sliced without
reading it. ``<name>.json`` says how to read it::

    {"format": "mtc-tokens", "version": 2, "dtype": "uint16", "vocab_size": 50257,
     "tokenizer": "gpt2", "n_tokens": 12345, "max_token_id": 50256, "sha256": "9f86d0...",
     "tokenizer_spec": "/data/gpt2", "tokenizer_sha256": "3c1a...", "eos_id": 50256,
     "tokenizer_dir": "corpus.tokenizer",
     "docs": {"file": "corpus.docs", "n_docs": 812, "sha256": "..."},
     "mask": {"file": "corpus.mask", "n_targets": 5210, "sha256": "..."}}

``max_token_id`` and ``sha256`` (of the .bin's bytes) let a run check the data against the model's
vocabulary and notice when a resumed run's data changed, without reading the tokens. The
tokenizer fields say which tokenizer made the ids (its tokenizer.json's hash, vocabulary size, EOS
id; its files are copied to ``tokenizer_dir`` beside the .bin). ``docs`` names ``<name>.docs``:
the document boundaries, little-endian int64 ``[0, end_1, ..., n_tokens]``, so a batch can start
at a document and never cross into the next one. ``mask`` names ``<name>.mask``: one uint8 per
token, 1 where the token is a training target (SFT: the assistant's replies), 0 where the loss
ignores it. Version 1 headers (no tokenizer fields, no sidecars: older mtc versions and other tools)
are still read, and so are headers without ``max_token_id`` and ``sha256``.

Every file is written to a temporary name and renamed into place, the header last, so a reader
never sees a half-written set; `TokenFile.open` checks the header against the files' sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Self

import numpy as np

from mtc.errors import DataError, write_failure

__all__ = [
    "FORMAT",
    "VERSION",
    "TokenFile",
    "TokenHeader",
    "TokenWriter",
    "check_data_identity",
    "check_store_tokenizer",
    "check_tokenizer_beside",
    "check_tokenizer_identity",
    "token_file_paths",
    "write_token_file",
]

FORMAT = "mtc-tokens"
VERSION = 2
_READS = (1, 2)  # header versions this mtc reads
# Explicit little-endian dtypes: the .bin must read the same on any host.
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_MAX_VOCAB = 2**32
_HASH_BLOCK = 1 << 24  # 16 MiB: hashing and writing stream through blocks, never a whole copy
_SAMPLE = 1 << 20  # a file without a content hash is identified by its first and last MiB
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DOCS_DTYPE = np.dtype("<i8")
_MASK_DTYPE = np.dtype("u1")


def token_file_paths(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The (.bin, .json) pair for a path given as the .bin, the .json or the bare stem."""
    p = Path(path)
    # Only strip our own suffixes: "corpus.v2" is a stem, not "corpus" with suffix ".v2".
    stem = p.with_suffix("") if p.suffix in (".bin", ".json") else p
    return stem.with_name(stem.name + ".bin"), stem.with_name(stem.name + ".json")


@dataclasses.dataclass(frozen=True, slots=True)
class TokenHeader:
    """The parsed .json header of a token file."""

    dtype: str
    vocab_size: int
    tokenizer: str
    n_tokens: int
    format: str = FORMAT
    version: int = VERSION
    max_token_id: int | None = None  # None: not recorded (older header) or no tokens
    sha256: str | None = None  # of the .bin's bytes; None: not recorded
    tokenizer_spec: str | None = None  # what `prepare --tokenizer` was given
    tokenizer_sha256: str | None = None  # of its tokenizer.json; None: byte, or not recorded
    eos_id: int | None = None  # the token ending each document; None: none (byte) or not recorded
    tokenizer_dir: str | None = None  # sibling directory holding the tokenizer's files
    docs: dict[str, Any] | None = None  # {"file", "n_docs", "sha256"} of the boundaries sidecar
    mask: dict[str, Any] | None = None  # {"file", "n_targets", "sha256"} of the loss-mask sidecar
    # what `prepare` read: {"read", "empty", "skipped", "skipped_examples"} (documents read, those
    # with no tokens, bad records skipped and the first few of them); None: not recorded
    source: dict[str, Any] | None = None

    @property
    def itemsize(self) -> int:
        """Bytes per token in the .bin."""
        return _DTYPES[self.dtype].itemsize

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to disk, in a fixed key order (optional fields only when recorded)."""
        d: dict[str, Any] = {
            "format": self.format, "version": self.version, "dtype": self.dtype,
            "vocab_size": self.vocab_size, "tokenizer": self.tokenizer, "n_tokens": self.n_tokens,
        }
        for k in ("max_token_id", "sha256", "tokenizer_spec", "tokenizer_sha256", "eos_id", "tokenizer_dir", "docs", "mask",
                  "source"):
            v = getattr(self, k)
            if v is not None:
                d[k] = dict(v) if isinstance(v, dict) else v
        return d

    @classmethod
    def from_dict(cls, d: Any, *, where: str = "header") -> TokenHeader:
        """Validate a decoded JSON object; DataError saying which field is wrong otherwise."""
        fix = "re-run `mtc prepare TEXT -o OUT.bin` to rewrite the token file"
        if not isinstance(d, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(d).__name__}; {fix}")
        if d.get("format") != FORMAT:
            raise DataError(f"{where}: format is {d.get('format')!r}, expected {FORMAT!r}; is this an mtc token file? {fix}")
        if d.get("version") not in _READS:
            raise DataError(
                f"{where}: version {d.get('version')!r} is not supported (this mtc reads versions "
                f"{', '.join(map(str, _READS))}); {fix}"
            )

        def _int(key: str, lo: int, hi: int | None = None, src: dict = d, at: str = "") -> int:
            v = src.get(key)
            # bool is an int in Python; a header saying "n_tokens": true is corrupt, not 1.
            if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
                rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                raise DataError(f"{where}: {at}{key} must be an integer {rng}, got {v!r}; {fix}")
            return v

        def _sha(key: str, src: dict = d, at: str = "") -> str | None:
            sha = src.get(key)
            if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
                raise DataError(f"{where}: {at}{key} must be 64 lowercase hex digits, got {sha!r}; {fix}")
            return sha

        def _str(key: str) -> str | None:
            v = d.get(key)
            if v is not None and not (isinstance(v, str) and v):
                raise DataError(f"{where}: {key} must be a non-empty string, got {v!r}; {fix}")
            return v

        vocab_size = _int("vocab_size", 1, _MAX_VOCAB)
        n_tokens = _int("n_tokens", 0)
        dtype = d.get("dtype")
        if dtype not in _DTYPES:
            raise DataError(f"{where}: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}; {fix}")
        if dtype == "uint16" and vocab_size > 2**16:
            raise DataError(f"{where}: dtype uint16 cannot hold ids of vocab_size {vocab_size}; {fix}")
        tokenizer = d.get("tokenizer")
        if not isinstance(tokenizer, str) or not tokenizer:
            raise DataError(f"{where}: tokenizer must be a non-empty string, got {tokenizer!r}; {fix}")
        max_id = _int("max_token_id", 0, vocab_size - 1) if d.get("max_token_id") is not None else None
        eos = _int("eos_id", 0, vocab_size - 1) if d.get("eos_id") is not None else None
        tdir = _str("tokenizer_dir")
        if tdir is not None and ("/" in tdir or "\\" in tdir or tdir in (".", "..")):
            raise DataError(f"{where}: tokenizer_dir must name a sibling directory, got {tdir!r}; {fix}")
        sides: dict[str, dict[str, Any] | None] = {}
        for key, count in (("docs", "n_docs"), ("mask", "n_targets")):
            v = d.get(key)
            if v is None:
                sides[key] = None
                continue
            if not isinstance(v, dict) or not isinstance(v.get("file"), str) or "/" in v["file"] or not v["file"]:
                raise DataError(f"{where}: {key} must be an object naming a sibling file, got {v!r}; {fix}")
            sides[key] = {"file": v["file"], count: _int(count, 0, None, v, f"{key}."),
                          "sha256": _sha("sha256", v, f"{key}.")}
        source = d.get("source")
        if source is not None:
            if not isinstance(source, dict):
                raise DataError(f"{where}: source must be an object, got {source!r}; {fix}")
            ex = source.get("skipped_examples", [])
            if not (isinstance(ex, list) and all(isinstance(e, str) for e in ex)):
                raise DataError(f"{where}: source.skipped_examples must be a list of strings, got {ex!r}; {fix}")
            source = {k: _int(k, 0, None, source, "source.") for k in ("read", "empty", "skipped")} | {
                "skipped_examples": list(ex)}
        return cls(dtype=dtype, vocab_size=vocab_size, tokenizer=tokenizer, n_tokens=n_tokens, version=d["version"],
                   max_token_id=max_id, sha256=_sha("sha256"), tokenizer_spec=_str("tokenizer_spec"),
                   tokenizer_sha256=_sha("tokenizer_sha256"), eos_id=eos, tokenizer_dir=tdir,
                   docs=sides["docs"], mask=sides["mask"], source=source)


class TokenFile:
    """An opened, validated token file: ``.header``, read-only memory-mapped ``.tokens``, ``len()``,
    and the sidecars when recorded: ``.docs`` (document boundaries) and ``.mask`` (loss mask)."""

    __slots__ = ("_max_id", "docs", "header", "header_path", "mask", "path", "tokens")

    def __init__(self, path: Path, header_path: Path, header: TokenHeader, tokens: np.ndarray,
                 docs: np.ndarray | None = None, mask: np.ndarray | None = None) -> None:
        self.path = path
        self.header_path = header_path
        self.header = header
        self.tokens = tokens
        self.docs = docs  # int64 [0, end_1, ..., n_tokens]; None: a stream without document boundaries
        self.mask = mask  # uint8 per token, 1 = a training target; None: every token is one
        self._max_id: int | None = header.max_token_id

    @property
    def tokenizer_dir(self) -> Path | None:
        """The directory of the tokenizer's files copied beside the token file (None: none recorded)."""
        return self.path.parent / self.header.tokenizer_dir if self.header.tokenizer_dir else None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TokenFile:
        """Open ``<name>.bin`` + ``<name>.json`` (pass either file or the stem) and check they agree."""
        bin_path, json_path = token_file_paths(path)
        given = Path(path)
        if not bin_path.is_file() and given.exists() and given not in (bin_path, json_path):
            # e.g. a text file or a folder of them: the raw data, not what training reads
            raise DataError(
                f"{given} is not an mtc token file (those are NAME.bin with NAME.json beside them); tokenize it "
                f"first: `mtc prepare {given} -o {given.with_suffix('')}.bin`, then --data {given.with_suffix('')}.bin"
            )
        if not bin_path.is_file():
            raise DataError(
                f"token file {bin_path} not found; create it with `mtc prepare TEXT -o {bin_path}`"
            )
        if not json_path.is_file():
            raise DataError(
                f"token file header {json_path} is missing beside {bin_path}; "
                f"re-run `mtc prepare TEXT -o {bin_path}` to write both"
            )
        try:
            raw = json.loads(json_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"token file header {json_path} is not valid JSON ({e}); re-run `mtc prepare`") from None
        header = TokenHeader.from_dict(raw, where=str(json_path))
        size = bin_path.stat().st_size
        want = header.n_tokens * header.itemsize
        if size != want:
            raise DataError(
                f"token file {bin_path} is {size:,} bytes but its header says {header.n_tokens:,} {header.dtype} "
                f"tokens ({want:,} bytes); the file is truncated or the header is stale: "
                f"re-run `mtc prepare TEXT -o {bin_path}`"
            )
        dtype = _DTYPES[header.dtype]
        if header.n_tokens == 0:
            # mmap cannot map an empty file; an empty read-only array keeps the same interface.
            tokens = np.empty(0, dtype=dtype)
            tokens.flags.writeable = False
        else:
            tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(header.n_tokens,))
        docs = mask = None
        if header.docs is not None:
            docs = _open_sidecar(bin_path.parent / header.docs["file"], _DOCS_DTYPE, header.docs["n_docs"] + 1, bin_path)
            if docs[0] != 0 or docs[-1] != header.n_tokens or (docs.size > 1 and bool((np.diff(docs) <= 0).any())):
                raise DataError(f"document boundaries {header.docs['file']} do not fit {bin_path} ({header.n_tokens:,} "
                                f"tokens); re-run `mtc prepare` to rewrite the token file")
        if header.mask is not None:
            mask = _open_sidecar(bin_path.parent / header.mask["file"], _MASK_DTYPE, header.n_tokens, bin_path)
        return cls(bin_path, json_path, header, tokens, docs, mask)

    def __len__(self) -> int:
        return self.header.n_tokens

    def max_token_id(self) -> int | None:
        """The largest token id: from the header, else one vectorised scan (remembered); None if empty."""
        if self._max_id is None and len(self):
            self._max_id = int(self.tokens.max())
        return self._max_id

    def check_vocab(self, vocab_size: int) -> None:
        """Raise DataError when the file is empty or holds a token id a model of ``vocab_size`` ids cannot embed."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise DataError(f"vocab_size must be an integer >= 1, got {vocab_size!r} ({type(vocab_size).__name__})")
        if len(self) == 0:
            raise DataError(f"token file {self.path} is empty (0 tokens); prepare it from a non-empty text with `mtc prepare`")
        top = self.max_token_id()
        if top is not None and top >= vocab_size:
            raise DataError(
                f"token file {self.path} holds token id {top:,} (tokenizer {self.header.tokenizer!r}, vocab_size "
                f"{self.header.vocab_size:,}) but the model embeds only {vocab_size:,} ids (0-{vocab_size - 1:,}); "
                f"prepare the data with the model's tokenizer, or give the model vocab_size >= {top + 1:,} "
                "(a preset's model_overrides.vocab_size; your own model's embedding rows)"
            )
        if self.header.vocab_size > vocab_size:
            raise DataError(
                f"token file {self.path} was made by tokenizer {self.header.tokenizer!r} of {self.header.vocab_size:,} ids "
                f"but the model embeds only {vocab_size:,}: the tokenizer does not match the model's vocabulary; prepare "
                f"the data with the model's tokenizer, or give the model vocab_size >= {self.header.vocab_size:,} "
                "(a preset's model_overrides.vocab_size; your own model's embedding rows)"
            )

    def identity(self) -> dict[str, Any]:
        """What identifies this data for a resumed run: path, size in bytes, header and a hash.

        ``hash_kind`` is "content" when the header records the sha256 of all token bytes, else
        "sample": the sha256 of the first and last MiB and the size (a file from an older mtc or
        another tool; re-run `mtc prepare` to give it a content hash).
        """
        size = self.path.stat().st_size
        if self.header.sha256 is not None:
            digest, kind = self.header.sha256, "content"
        else:
            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                h.update(f.read(_SAMPLE))
                f.seek(max(0, size - _SAMPLE))
                h.update(f.read(_SAMPLE))
            h.update(str(size).encode())
            digest, kind = h.hexdigest(), "sample"
        return {"path": str(self.path.resolve()), "size_bytes": size, "header": self.header.to_dict(),
                "hash": digest, "hash_kind": kind}

    def __repr__(self) -> str:
        h = self.header
        return f"TokenFile({str(self.path)!r}, n_tokens={h.n_tokens}, dtype={h.dtype}, vocab_size={h.vocab_size}, tokenizer={h.tokenizer!r})"


def _open_sidecar(p: Path, dtype: np.dtype, n: int, bin_path: Path) -> np.ndarray:
    """A sidecar of ``n`` items, memory-mapped read-only, after checking its size."""
    fix = f"re-run `mtc prepare` to rewrite {bin_path} and its sidecars"
    if not p.is_file():
        raise DataError(f"{p} is missing beside {bin_path} (its header names it); {fix}")
    size, want = p.stat().st_size, n * dtype.itemsize
    if size != want:
        raise DataError(f"{p} is {size:,} bytes, its header says {want:,}; the file is truncated or stale: {fix}")
    if n == 0:
        arr = np.empty(0, dtype=dtype)
        arr.flags.writeable = False
        return arr
    return np.memmap(p, dtype=dtype, mode="r", shape=(n,))


def _cannot_write(path: Path, e: OSError) -> str:
    """The one-line error for a token file that cannot be written."""
    return f"cannot write the token file {path}: {write_failure(e, path)}; choose another -o path"


def _temporary(final: Path) -> tuple[int, str]:
    """A temporary file beside ``final``, named with this process's id (see `remove_dead_temporaries`)."""
    return tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.{os.getpid()}.", suffix=".tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_temporaries(final: Path) -> list[tuple[Path, int]]:
    """Remove the temporary files a writer of ``final`` left behind when it was killed (kill -9, an
    out-of-memory kill, a power cut: no cleanup ran), and return them with their sizes. Each names
    its writer's process id; a file whose process still runs on this machine is another writer's
    and stays (so does one named otherwise)."""
    head = f".{final.name}."
    gone = []
    for p in final.parent.glob(f"{glob.escape(head)}*.tmp"):
        pid = p.name[len(head):].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            size = p.stat().st_size
            p.unlink()
        except FileNotFoundError:  # (its writer's own cleanup, or another reader of this directory)
            continue
        gone.append((p, size))
    return gone


def _atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a temporary file in the same directory, fsync, then rename over ``path``."""
    fd, tmp = _temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            # mkstemp makes the file 0600; a data file should read like any other the user writes
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class TokenWriter:
    """Writes a token file piece by piece (`add`), never holding the corpus: tokens, document
    boundaries and the loss mask stream to temporary files, hashed as they go; `finish` renames
    them into place and writes the header last. ``with_docs`` records document boundaries (each
    `add` with ``end_doc`` closes one), ``with_mask`` a loss mask (every `add` then passes one).
    Use it as a context manager: leaving the block by an exception removes the temporary files."""

    def __init__(self, path: str | os.PathLike[str], *, vocab_size: int, tokenizer: str, with_docs: bool = False,
                 with_mask: bool = False, tokenizer_spec: str | None = None, tokenizer_sha256: str | None = None,
                 eos_id: int | None = None, tokenizer_dir: str | None = None) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= _MAX_VOCAB:
            raise DataError(f"vocab_size must be an integer in [1, 2**32], got {vocab_size!r}")
        self.bin_path, self.json_path = token_file_paths(path)
        try:
            self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(_cannot_write(self.bin_path, e)) from None
        self.vocab_size, self.dtype_name = vocab_size, ("uint16" if vocab_size <= 2**16 else "uint32")
        self._meta = {"tokenizer": tokenizer, "tokenizer_spec": tokenizer_spec, "tokenizer_sha256": tokenizer_sha256,
                      "eos_id": eos_id, "tokenizer_dir": tokenizer_dir}
        stem = self.bin_path.with_suffix("")
        self.docs_path = stem.with_name(stem.name + ".docs") if with_docs else None
        self.mask_path = stem.with_name(stem.name + ".mask") if with_mask else None
        self._files: dict[str, tuple[Path, Path, BinaryIO, Any]] = {}
        for final in (self.bin_path, self.json_path, self.docs_path, self.mask_path):
            # checked now, not when `finish` renames into it after the whole corpus was tokenized
            if final is not None and final.exists() and not final.is_file():
                raise DataError(f"cannot write the token file {self.bin_path}: {final} exists and is not a file; "
                                "choose another -o path or move it away")
        # an earlier writer of these files that was killed left its temporaries: as large as its output
        self.removed_leftovers = [x for final in (self.bin_path, self.json_path, self.docs_path, self.mask_path)
                                  if final is not None for x in remove_dead_temporaries(final)]
        try:
            for kind, final in (("bin", self.bin_path), ("docs", self.docs_path), ("mask", self.mask_path)):
                if final is not None:
                    fd, tmp = _temporary(final)
                    self._files[kind] = (final, Path(tmp), os.fdopen(fd, "wb"), hashlib.sha256())
        except OSError as e:  # (a directory that does not exist or cannot be written: nothing left behind)
            for _, tmp, f, _ in self._files.values():
                f.close()
                tmp.unlink(missing_ok=True)
            raise DataError(_cannot_write(self.bin_path, e)) from None
        self.n_tokens = 0
        self.n_docs = 0
        self.n_targets = 0
        self._doc_start = 0
        self._max = -1
        if with_docs:
            self._put("docs", np.zeros(1, dtype=_DOCS_DTYPE))

    def _put(self, kind: str, arr: np.ndarray) -> None:
        _, _, f, h = self._files[kind]
        raw = memoryview(np.ascontiguousarray(arr)).cast("B")
        for i in range(0, len(raw), _HASH_BLOCK):
            f.write(raw[i:i + _HASH_BLOCK])
            h.update(raw[i:i + _HASH_BLOCK])

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None, *, end_doc: bool = False) -> None:
        """Append ``ids`` (1-D integers < vocab_size) and, with a mask, their mask (0/1, one per id);
        ``end_doc`` closes the current document (empty documents are not recorded)."""
        arr = np.asarray(ids)
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise DataError(f"tokens must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                pos = self.n_tokens + int(np.argmax(arr == bad))
                raise DataError(
                    f"token {bad} at position {pos} is outside the vocabulary [0, {self.vocab_size}); "
                    "pass the tokenizer's vocab_size, or check the tokenizer's output"
                )
            self._max = max(self._max, hi)
            self._put("bin", arr.astype(_DTYPES[self.dtype_name], copy=False))
        if self.mask_path is not None:
            m = np.asarray(mask if mask is not None else np.ones(arr.size, dtype=_MASK_DTYPE))
            if m.shape != arr.shape:
                raise DataError(f"a loss mask must have one entry per token: {m.shape} for {arr.shape} tokens")
            m = (m != 0).astype(_MASK_DTYPE)
            self.n_targets += int(m.sum())
            self._put("mask", m)
        elif mask is not None:
            raise DataError("this token file records no loss mask (open the writer with with_mask=True)")
        self.n_tokens += int(arr.size)
        if end_doc and self.docs_path is not None and self.n_tokens > self._doc_start:
            self._put("docs", np.asarray([self.n_tokens], dtype=_DOCS_DTYPE))
            self._doc_start = self.n_tokens
            self.n_docs += 1

    def finish(self, source: dict[str, Any] | None = None) -> TokenFile:
        """Close the last document, rename every file into place (the header last) and open the
        result; ``source`` (what `prepare` read, see `TokenHeader.source`) goes into the header."""
        if self.docs_path is not None and self.n_tokens > self._doc_start:
            self.add(np.empty(0, dtype=np.int64), None if self.mask_path is None else np.empty(0, _MASK_DTYPE), end_doc=True)
        stale_tok = self._stale_tokenizer_dir()
        # Drop a stale header first: if we die before the new one lands, open() reports a missing
        # header instead of pairing the new .bin with the old header.
        self.json_path.unlink(missing_ok=True)
        stem = self.bin_path.with_suffix("")
        for sfx, mine in ((".docs", self.docs_path), (".mask", self.mask_path)):
            if mine is None:  # a sidecar of the file this one replaces would only mislead
                stem.with_name(stem.name + sfx).unlink(missing_ok=True)
        digests = {}
        for kind, (final, tmp, f, h) in self._files.items():
            f.flush()
            umask = os.umask(0)  # mkstemp makes the file 0600; a data file should read like any other
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)
            os.fsync(f.fileno())
            f.close()
            os.replace(tmp, final)
            digests[kind] = h.hexdigest()
        self._files = {}
        docs = mask = None
        if self.docs_path is not None:
            docs = {"file": self.docs_path.name, "n_docs": self.n_docs, "sha256": digests["docs"]}
        if self.mask_path is not None:
            mask = {"file": self.mask_path.name, "n_targets": self.n_targets, "sha256": digests["mask"]}
        header = TokenHeader(dtype=self.dtype_name, vocab_size=self.vocab_size, n_tokens=self.n_tokens,
                             max_token_id=self._max if self._max >= 0 else None, sha256=digests["bin"],
                             docs=docs, mask=mask, source=source, **self._meta)
        text = json.dumps(header.to_dict(), indent=1) + "\n"
        _atomic_write(self.json_path, lambda f: f.write(text.encode("utf-8")))
        if stale_tok is not None:
            shutil.rmtree(stale_tok, ignore_errors=True)
        return TokenFile.open(self.bin_path)

    def _stale_tokenizer_dir(self) -> Path | None:
        """The tokenizer directory the header being replaced names, when the new one names none
        (a byte-level file written over one from `--tokenizer DIR`): its files would only mislead."""
        if self._meta["tokenizer_dir"] is not None or not self.json_path.is_file():
            return None
        try:
            old = json.loads(self.json_path.read_text(encoding="utf-8")).get("tokenizer_dir")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            return None
        stem = self.bin_path.with_suffix("")
        mine = stem.with_name(stem.name + ".tokenizer")
        return mine if old == mine.name and mine.is_dir() else None

    def abort(self) -> None:
        """Remove the temporary files (nothing was renamed into place)."""
        for _, tmp, f, _ in self._files.values():
            with contextlib.suppress(OSError):
                f.close()
            tmp.unlink(missing_ok=True)
        self._files = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.abort()  # after finish() there is nothing left to remove


def write_token_file(
    path: str | os.PathLike[str], tokens: np.ndarray, *, vocab_size: int, tokenizer: str,
    doc_ends: np.ndarray | None = None, mask: np.ndarray | None = None, eos_id: int | None = None,
) -> TokenFile:
    """Write ``tokens`` (1-D integers, each < vocab_size) as ``<name>.bin`` + ``<name>.json`` and open it.

    The dtype is uint16 when vocab_size <= 65536, else uint32. ``doc_ends`` (increasing end offsets
    of the documents, the last one ``len(tokens)``) records document boundaries, ``mask`` a loss
    mask (one 0/1 per token); without them the file is a plain stream.
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise DataError(f"tokens must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    m = None if mask is None else np.asarray(mask)
    if m is not None and m.shape != arr.shape:
        raise DataError(f"a loss mask must have one entry per token: {m.shape} for {arr.shape} tokens")
    with TokenWriter(path, vocab_size=vocab_size, tokenizer=tokenizer, with_docs=doc_ends is not None,
                     with_mask=m is not None, eos_id=eos_id) as w:
        if doc_ends is None:
            w.add(arr, m)
        else:
            lo = 0
            for hi in np.asarray(doc_ends, dtype=np.int64).tolist():
                if not lo < hi <= arr.size:
                    raise DataError(f"doc_ends must increase within [1, {arr.size}], got {hi} after {lo}")
                w.add(arr[lo:hi], None if m is None else m[lo:hi], end_doc=True)
                lo = hi
            if lo != arr.size:
                raise DataError(f"doc_ends must end at len(tokens) = {arr.size}, not {lo}")
        return w.finish()


# Header fields that say what the tokens are; max_token_id and sha256 are compared through the hash.
# The sidecars (document boundaries, loss mask) carry their own sha256 inside their entries.
_IDENTITY_HEADER_KEYS = ("dtype", "vocab_size", "tokenizer", "n_tokens", "tokenizer_sha256", "eos_id", "docs", "mask")


def _tokenizer_text(h: dict[str, Any]) -> str:
    sha = h.get("tokenizer_sha256")
    return f"{h.get('tokenizer')!r} ({h.get('vocab_size')} ids" + (f", tokenizer.json sha256 {sha[:12]}...)" if sha else ")")


def check_tokenizer_identity(saved: dict[str, Any] | None, now: dict[str, Any], *, where: str = "this run") -> None:
    """Raise DataError when data (``now``, from `TokenFile.identity`) was made by another tokenizer
    than ``saved``'s: its ids would mean other tokens to the trained embeddings, so no
    --allow-change lets it through. Tokenizers compare by tokenizer.json hash when both record one,
    else by name and vocabulary size."""
    if saved is None:
        return
    sh, nh = saved.get("header") or {}, now.get("header") or {}
    a, b = sh.get("tokenizer_sha256"), nh.get("tokenizer_sha256")
    same = a == b if (a is not None and b is not None) else (
        sh.get("tokenizer") == nh.get("tokenizer") and sh.get("vocab_size") == nh.get("vocab_size") and a is None and b is None)
    if not same:
        raise DataError(
            f"the data {now.get('path')} was tokenized by {_tokenizer_text(nh)}, but {where} was trained on data from "
            f"{_tokenizer_text(sh)}; the ids would mean other tokens: prepare the data with the run's tokenizer "
            "(`mtc prepare ... --tokenizer` with the same files), or start a new run"
        )


def check_store_tokenizer(store_dir: str | os.PathLike[str] | None, data: TokenFile) -> None:
    """Raise DataError when the run in ``store_dir`` carries its tokenizer (``RUN/tokenizer/``, from
    `mtc import`) and ``data`` was made by another one (compared by tokenizer.json's sha256)."""
    if store_dir is None:
        return
    check_tokenizer_file(Path(store_dir) / "tokenizer" / "tokenizer.json", data)


def check_tokenizer_beside(directory: Path, identity: dict[str, Any] | None) -> None:
    """Raise DataError when ``directory`` (the ``<stem>.tokenizer/`` beside a run's data, which
    export and generate fall back on) holds another tokenizer.json than the one the run's data was
    made by (``identity``: the data identity its commits record): the data was prepared again with
    another tokenizer since, and its files would decode the run's ids into other text."""
    want = ((identity or {}).get("header") or {}).get("tokenizer_sha256")
    f = directory / "tokenizer.json"
    if want is None or not f.is_file():
        return
    got = hashlib.sha256(f.read_bytes()).hexdigest()
    if got != want:
        raise DataError(f"the tokenizer beside the run's data, {directory}, is not the one that data was made by (its "
                        f"tokenizer.json sha256 {got[:12]}..., the run's {want[:12]}...): the data was prepared again since; "
                        "pass the run's tokenizer with --tokenizer")


def check_tokenizer_file(f: Path, data: TokenFile) -> None:
    """Raise DataError when ``f`` (a tokenizer.json) exists and ``data`` was made by another tokenizer."""
    if not f.is_file():
        return
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    got = data.header.tokenizer_sha256
    if got != want:
        made = f"tokenizer {data.header.tokenizer!r}" + (f" (tokenizer.json sha256 {got[:12]}...)" if got else "")
        raise DataError(
            f"the data {data.path} was made by {made}, not by the run's tokenizer {f.parent} (sha256 {want[:12]}...): "
            f"the ids would mean other tokens; prepare it with `mtc prepare ... --tokenizer {f.parent}`"
        )


def _content(v: Any) -> Any:
    """A header value as compared on resume: a sidecar entry without its file name (a renamed token
    file has renamed sidecars, with the same contents)."""
    return {k: x for k, x in v.items() if k != "file"} if isinstance(v, dict) else v


def _short(v: Any) -> str:
    """A header value for a message: a sidecar entry by its file and hash prefix, a hash by its prefix."""
    if isinstance(v, dict):
        return f"{v.get('file')} (sha256 {str(v.get('sha256'))[:12]}...)"
    if isinstance(v, str) and _SHA256.fullmatch(v):
        return v[:12] + "..."
    return repr(v)


def check_data_identity(saved: dict[str, Any] | None, now: dict[str, Any], allow_change: bool) -> None:
    """Raise DataError when a resumed run's data (``now``, from `TokenFile.identity`) differs from ``saved``.

    ``saved`` None (a run that recorded no identity) or ``allow_change`` skip the check. A moved
    file with the same contents passes; the hashes are compared when both are of the same kind.
    """
    if saved is None or allow_change:
        return
    diff = []
    if saved.get("size_bytes") != now.get("size_bytes"):
        diff.append(f"size {saved.get('size_bytes')} -> {now.get('size_bytes')} bytes")
    sh, nh = saved.get("header") or {}, now.get("header") or {}
    diff += [f"{k} {_short(sh.get(k))} -> {_short(nh.get(k))}" for k in _IDENTITY_HEADER_KEYS
             if _content(sh.get(k)) != _content(nh.get(k))]
    if saved.get("hash_kind") == now.get("hash_kind") and saved.get("hash") != now.get("hash"):
        diff.append(f"{now.get('hash_kind')} sha256 {str(saved.get('hash'))[:12]}... -> {str(now.get('hash'))[:12]}...")
    if diff:
        raise DataError(
            f"the data {now.get('path')} is not the data this run was trained on ({saved.get('path')}): differs in "
            f"{'; '.join(diff)}; resume with the original data, or pass --allow-change data to continue on new data"
        )
