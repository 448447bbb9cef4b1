"""The token file format: a raw token array on disk plus a small JSON header beside it.

``<name>.bin`` holds the tokens as a flat little-endian ``uint16`` array (vocabulary <= 65536) or
``uint32`` array (larger vocabularies), nothing else, so it can be memory-mapped and sliced without
reading it. ``<name>.json`` says how to read it::

    {"format": "mtc-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256,
     "tokenizer": "byte", "n_tokens": 12345, "max_token_id": 255, "sha256": "9f86d0..."}

``max_token_id`` and ``sha256`` (of the .bin's bytes) let a run check the data against the model's
vocabulary and notice when a resumed run's data changed, without reading the tokens; headers written
before they existed (or by other tools) lack them and are still read.

Both files are written to a temporary name and renamed into place, the .bin first, so a reader never
sees a half-written file; `TokenFile.open` checks the header against the .bin's size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mtc.data.tokenizer import get_tokenizer
from mtc.errors import DataError

__all__ = [
    "FORMAT",
    "VERSION",
    "TokenFile",
    "TokenHeader",
    "check_data_identity",
    "prepare",
    "token_file_paths",
    "write_token_file",
]

FORMAT = "mtc-tokens"
VERSION = 1
# Explicit little-endian dtypes: the .bin must read the same on any host.
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_MAX_VOCAB = 2**32
_HASH_BLOCK = 1 << 24  # 16 MiB: hashing and writing stream through blocks, never a whole copy
_SAMPLE = 1 << 20  # a file without a content hash is identified by its first and last MiB
_SHA256 = re.compile(r"[0-9a-f]{64}")


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
        if self.max_token_id is not None:
            d["max_token_id"] = self.max_token_id
        if self.sha256 is not None:
            d["sha256"] = self.sha256
        return d

    @classmethod
    def from_dict(cls, d: Any, *, where: str = "header") -> TokenHeader:
        """Validate a decoded JSON object; DataError saying which field is wrong otherwise."""
        fix = "re-run `mtc prepare TEXT -o OUT.bin` to rewrite the token file"
        if not isinstance(d, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(d).__name__}; {fix}")
        if d.get("format") != FORMAT:
            raise DataError(f"{where}: format is {d.get('format')!r}, expected {FORMAT!r}; is this an mtc token file? {fix}")
        if d.get("version") != VERSION:
            raise DataError(
                f"{where}: version {d.get('version')!r} is not supported (this mtc reads version {VERSION}); {fix}"
            )

        def _int(key: str, lo: int, hi: int | None = None) -> int:
            v = d.get(key)
            # bool is an int in Python; a header saying "n_tokens": true is corrupt, not 1.
            if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
                rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                raise DataError(f"{where}: {key} must be an integer {rng}, got {v!r}; {fix}")
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
        sha = d.get("sha256")
        if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise DataError(f"{where}: sha256 must be 64 lowercase hex digits, got {sha!r}; {fix}")
        return cls(dtype=dtype, vocab_size=vocab_size, tokenizer=tokenizer, n_tokens=n_tokens,
                   max_token_id=max_id, sha256=sha)


class TokenFile:
    """An opened, validated token file: ``.header``, read-only memory-mapped ``.tokens``, ``len()``."""

    __slots__ = ("_max_id", "header", "header_path", "path", "tokens")

    def __init__(self, path: Path, header_path: Path, header: TokenHeader, tokens: np.ndarray) -> None:
        self.path = path
        self.header_path = header_path
        self.header = header
        self.tokens = tokens
        self._max_id: int | None = header.max_token_id

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TokenFile:
        """Open ``<name>.bin`` + ``<name>.json`` (pass either file or the stem) and check they agree."""
        bin_path, json_path = token_file_paths(path)
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
        return cls(bin_path, json_path, header, tokens)

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
                "(model_overrides.vocab_size)"
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


def _atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a temporary file in the same directory, fsync, then rename over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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


def write_token_file(
    path: str | os.PathLike[str], tokens: np.ndarray, *, vocab_size: int, tokenizer: str
) -> TokenFile:
    """Write ``tokens`` (1-D integers, each < vocab_size) as ``<name>.bin`` + ``<name>.json`` and open it.

    The dtype is uint16 when vocab_size <= 65536, else uint32.
    """
    bin_path, json_path = token_file_paths(path)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= _MAX_VOCAB:
        raise DataError(f"vocab_size must be an integer in [1, 2**32], got {vocab_size!r}")
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise DataError(f"tokens must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            pos = int(np.argmax(arr == bad))
            raise DataError(
                f"token {bad} at position {pos} is outside the vocabulary [0, {vocab_size}); "
                "pass the tokenizer's vocab_size, or check the tokenizer's output"
            )
    dtype_name = "uint16" if vocab_size <= 2**16 else "uint32"
    data = np.ascontiguousarray(arr.astype(_DTYPES[dtype_name], copy=False))
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    # Drop a stale header first: if we die before the new one lands, open() reports a missing
    # header instead of pairing the new .bin with the old header.
    json_path.unlink(missing_ok=True)
    digest = hashlib.sha256()

    def write_and_hash(f: BinaryIO) -> None:
        raw = memoryview(data).cast("B")
        for i in range(0, len(raw), _HASH_BLOCK):
            f.write(raw[i:i + _HASH_BLOCK])
            digest.update(raw[i:i + _HASH_BLOCK])

    _atomic_write(bin_path, write_and_hash)
    header = TokenHeader(dtype=dtype_name, vocab_size=vocab_size, tokenizer=tokenizer, n_tokens=int(data.size),
                         max_token_id=int(data.max()) if data.size else None, sha256=digest.hexdigest())
    text = json.dumps(header.to_dict(), indent=1) + "\n"
    _atomic_write(json_path, lambda f: f.write(text.encode("utf-8")))
    return TokenFile.open(bin_path)


def _text_files(text_path: Path) -> list[Path]:
    if text_path.is_dir():
        files = sorted(p for p in text_path.glob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"no *.txt files in directory {text_path}; pass a text file or a directory of .txt files")
        return files
    if text_path.is_file():
        return [text_path]
    raise DataError(f"text path {text_path} does not exist; pass a UTF-8 text file or a directory of .txt files")


def prepare(text_path: str | os.PathLike[str], out_path: str | os.PathLike[str], *, tokenizer: str = "byte") -> TokenFile:
    """Tokenize a UTF-8 text file, or every ``*.txt`` in a directory (sorted by name), into a token file.

    Each file is made to end with a newline and files are joined with a blank line between them,
    so one file's last paragraph does not run into the next file's first.
    """
    tok = get_tokenizer(tokenizer)
    parts: list[np.ndarray] = []
    for i, f in enumerate(_text_files(Path(text_path))):
        try:
            # utf-8-sig: a byte-order mark from a Windows editor is not text to train on.
            text = f.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise DataError(f"{f} is not valid UTF-8 (byte {e.start}: {e.reason}); convert it to UTF-8 first") from None
        if i > 0:
            parts.append(tok.encode("\n"))
        if text and not text.endswith("\n"):
            text += "\n"
        parts.append(tok.encode(text))
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint16)
    if tokens.size == 0:
        raise DataError(f"{text_path} contains no text; nothing to tokenize")
    return write_token_file(out_path, tokens, vocab_size=tok.vocab_size, tokenizer=tok.name)



# Header fields that say what the tokens are; max_token_id and sha256 are compared through the hash.
_IDENTITY_HEADER_KEYS = ("dtype", "vocab_size", "tokenizer", "n_tokens")


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
    diff += [f"{k} {sh.get(k)!r} -> {nh.get(k)!r}" for k in _IDENTITY_HEADER_KEYS if sh.get(k) != nh.get(k)]
    if saved.get("hash_kind") == now.get("hash_kind") and saved.get("hash") != now.get("hash"):
        diff.append(f"{now.get('hash_kind')} sha256 {str(saved.get('hash'))[:12]}... -> {str(now.get('hash'))[:12]}...")
    if diff:
        raise DataError(
            f"the data {now.get('path')} is not the data this run was trained on ({saved.get('path')}): differs in "
            f"{'; '.join(diff)}; resume with the original data, or pass --allow-change data to continue on new data"
        )
