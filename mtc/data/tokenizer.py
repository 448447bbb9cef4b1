"""Tokenizers: text to integer ids and back.

`get_tokenizer` takes a spec: ``"byte"`` (one token per UTF-8 byte, built in), a path to a
``tokenizer.json``, or a Hugging Face tokenizer directory (one holding ``tokenizer.json``, as
``save_pretrained`` of a fast tokenizer writes it; a hub id such as ``gpt2`` is looked up in the
local Hugging Face cache only: mtc never downloads). The ``tokenizers`` library runs the files;
``tokenizer_config.json`` beside them, when present, names the EOS token and holds the chat template
(newer transformers write the template to ``chat_template.jinja`` instead; both are read).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mtc.errors import DataError

__all__ = ["TOKENIZER_FILES", "ByteTokenizer", "HFTokenizer", "Tokenizer", "get_tokenizer", "special_affixes"]

# The files of a Hugging Face tokenizer directory that `prepare` copies beside a token file.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
# Tried, in order, when no tokenizer_config.json names the EOS token.
_EOS_GUESSES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")


class Tokenizer(Protocol):
    """What `prepare`, generation and export need from a tokenizer."""

    name: str  # short name ("byte", or the directory / file the tokenizer came from)
    spec: str  # what was passed to `get_tokenizer` (a resolved path for files)
    vocab_size: int
    eos_id: int | None  # None: documents are separated by a blank line instead (byte)
    sha256: str | None  # of tokenizer.json's bytes; None for the built-in byte tokenizer
    chat_template: str | None
    files: tuple[Path, ...]  # the files to copy beside a token file (empty for byte)

    def encode(self, text: str, *, special: bool = True) -> np.ndarray: ...

    def decode(self, ids: Iterable[int] | np.ndarray) -> str: ...

    def token(self, token_id: int) -> str | None: ...


def _ids_array(ids: Iterable[int] | np.ndarray) -> np.ndarray:
    return np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64).reshape(-1)


class ByteTokenizer:
    """One token per UTF-8 byte: no training, no unknown tokens, vocabulary of 256, no EOS token."""

    name = "byte"
    spec = "byte"
    vocab_size = 256
    eos_id = None
    sha256 = None
    chat_template = None
    files: tuple[Path, ...] = ()

    def encode(self, text: str, *, special: bool = True) -> np.ndarray:
        """UTF-8 bytes of ``text`` as a uint16 array (uint16 so it matches the token file dtype)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text from byte ids; a model can emit a broken multi-byte sequence, so those become U+FFFD."""
        arr = _ids_array(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise DataError(f"byte tokenizer ids must be in [0, 256), got {bad}")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def token(self, token_id: int) -> str | None:
        """The byte as a one-character string (latin-1), for messages."""
        return chr(token_id) if 0 <= token_id < 256 else None


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


class HFTokenizer:
    """A tokenizer.json run by the `tokenizers` library, with its directory's config."""

    def __init__(self, json_path: Path, *, spec: str, eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError:  # pragma: no cover - a dependency of mtc
            raise DataError("reading a tokenizer.json needs the `tokenizers` package: pip install tokenizers") from None
        raw = json_path.read_bytes()
        try:
            self._tok = _RustTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001  (the library raises a bare Exception for malformed files)
            raise DataError(f"{json_path} is not a tokenizer the `tokenizers` library can read ({e}); "
                            "pass a tokenizer.json saved by a fast Hugging Face tokenizer") from None
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.spec = spec
        d = json_path.parent
        self.name = d.name if json_path.name == "tokenizer.json" else json_path.stem
        self.config = self._read_config(d / "tokenizer_config.json")
        self.files = tuple(p for p in (d / f for f in TOKENIZER_FILES) if p.is_file()) if json_path.name == "tokenizer.json" \
            else (json_path,)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._eos(eos_token)
        self.eos_token = self.token(self.eos_id) if self.eos_id is not None else None
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.chat_template = self._chat_template(d)

    @staticmethod
    def _read_config(p: Path) -> dict[str, Any]:
        if not p.is_file():
            return {}
        try:
            cfg = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{p} is not valid JSON ({e}); fix or remove it") from None
        return cfg if isinstance(cfg, dict) else {}

    def _eos(self, eos_token: str | None) -> int | None:
        names = [eos_token] if eos_token is not None else [_token_text(self.config.get("eos_token"))] + list(_EOS_GUESSES)
        for n in names:
            if n is None:
                continue
            i = self._tok.token_to_id(n)
            if i is not None:
                return int(i)
            if eos_token is not None:
                raise DataError(f"--eos {eos_token!r} is not a token of tokenizer {self.spec}; name one of its special tokens")
        return None

    def _chat_template(self, d: Path) -> str | None:
        t = self.config.get("chat_template")
        if isinstance(t, list):  # several named templates: the default one
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        if isinstance(t, str) and t.strip():
            return t
        j = d / "chat_template.jinja"
        if j.is_file():
            return j.read_text(encoding="utf-8")
        return None

    def encode(self, text: str, *, special: bool = True) -> np.ndarray:
        """Token ids of ``text`` (with the tokenizer's special tokens, e.g. BOS, when ``special``)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=special).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str], *, special: bool = True) -> list[np.ndarray]:
        """`encode` of many texts at once (the library tokenizes them on all cores)."""
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts, add_special_tokens=special)]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, start character of each token) of ``text``, without added special tokens."""
        e = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(e.ids, dtype=np.int64), np.asarray([o[0] for o in e.offsets], dtype=np.int64)

    def encode_located(self, text: str) -> tuple[np.ndarray, Callable[[int], int]]:
        """(ids, start) of ``text`` without added special tokens, ``start(i)`` the character token
        ``i`` starts at (-1 for one that has none): asked of a few tokens, far cheaper than
        `encode_offsets`, whose offsets of every token cost a tenth of the time to encode a text."""
        e = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(e.ids, dtype=np.int64), lambda i: (e.token_to_chars(i) or (-1, -1))[0]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of ``ids``; special tokens (BOS, EOS, padding) are left out."""
        arr = _ids_array(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise DataError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size}) of tokenizer {self.name!r}")
        return self._tok.decode(arr.tolist(), skip_special_tokens=True)

    def token(self, token_id: int) -> str | None:
        """The token's string, or None when the id is not in the vocabulary."""
        return self._tok.id_to_token(int(token_id))


def special_affixes(tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The ids a tokenizer's post-processor puts before and after a text (e.g. BOS), found by
    encoding a word with and without them; pieces are then encoded without, once per document."""
    plain = tok.encode("a", special=False)
    full = tok.encode("a", special=True)
    n = len(plain)
    for i in range(len(full) - n + 1):
        if np.array_equal(full[i:i + n], plain):
            return full[:i], full[i + n:]
    return full[:0], full[:0]


def _hub_cache_dir(name: str) -> Path | None:
    """A hub id's newest snapshot in the local Hugging Face cache that holds tokenizer.json."""
    if name.count("/") > 1 or name.startswith((".", "/")):
        return None
    roots = [os.environ.get("HF_HUB_CACHE"), os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None,
             os.path.expanduser("~/.cache/huggingface/hub")]
    for r in roots:
        if not r:
            continue
        snaps = Path(r) / ("models--" + name.replace("/", "--")) / "snapshots"
        found = sorted((p for p in snaps.glob("*/tokenizer.json")), key=lambda p: p.stat().st_mtime) if snaps.is_dir() else []
        if found:
            return found[-1].parent
    return None


def get_tokenizer(spec: str, *, eos_token: str | None = None) -> Tokenizer:
    """The tokenizer named by ``spec``: "byte", a tokenizer.json, or a directory holding one.

    ``eos_token`` names the token that ends a document when tokenizer_config.json does not.
    DataError (one line, with the fix) otherwise.
    """
    if spec == "byte":
        if eos_token is not None:
            raise DataError("the byte tokenizer has no EOS token (documents are separated by a blank line); drop --eos")
        return ByteTokenizer()
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise DataError(
                f"tokenizer directory {p} has no tokenizer.json; save the fast tokenizer there "
                f"(transformers: AutoTokenizer.from_pretrained(...).save_pretrained('{p}')) and pass the directory"
            )
        return HFTokenizer((p / "tokenizer.json").resolve(), spec=str(p.resolve()), eos_token=eos_token)
    if p.is_file():
        if p.suffix != ".json":
            raise DataError(f"tokenizer file {p} is not a tokenizer.json; pass a tokenizer.json or its directory")
        return HFTokenizer(p.resolve(), spec=str(p.resolve()), eos_token=eos_token)
    cached = _hub_cache_dir(spec)
    if cached is not None:
        return HFTokenizer(cached / "tokenizer.json", spec=spec, eos_token=eos_token)
    raise DataError(
        f"unknown tokenizer {spec!r}: not 'byte', not a tokenizer.json, not a directory, not in the local Hugging Face "
        "cache (mtc does not download); known tokenizers: byte, or download one first, e.g. "
        f"`huggingface-cli download {spec} tokenizer.json tokenizer_config.json --local-dir tok/` and pass tok/"
    )
