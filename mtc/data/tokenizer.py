"""Tokenizers: text to integer ids and back. Only the byte-level one for now, looked up by name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from mtc.errors import DataError

__all__ = ["TOKENIZERS", "ByteTokenizer", "Tokenizer", "get_tokenizer"]


class Tokenizer(Protocol):
    """What `prepare` and the demo need from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte: no training, no unknown tokens, vocabulary of 256."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` as a uint16 array (uint16 so it matches the token file dtype)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text from byte ids; a model can emit a broken multi-byte sequence, so those become U+FFFD."""
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise DataError(f"byte tokenizer ids must be in [0, 256), got {bad}")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


TOKENIZERS: dict[str, type] = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    """A fresh tokenizer by its registered name; DataError naming the known ones otherwise."""
    try:
        cls = TOKENIZERS[name]
    except KeyError:
        known = ", ".join(sorted(TOKENIZERS))
        raise DataError(f"unknown tokenizer {name!r}; known tokenizers: {known}") from None
    return cls()
