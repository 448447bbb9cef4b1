"""Data: tokenizers, the token file format (`prepare`, `TokenFile`), cursor-addressed batches, and
the small English corpus shipped with mtc for the demo."""

from __future__ import annotations

from pathlib import Path

from mtc.data.batches import BatchSampler, check_fits
from mtc.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer
from mtc.data.tokens import TokenFile, TokenHeader, check_data_identity, prepare, write_token_file
from mtc.errors import DataError

__all__ = [
    "BatchSampler",
    "ByteTokenizer",
    "TokenFile",
    "TokenHeader",
    "Tokenizer",
    "check_data_identity",
    "check_fits",
    "embedded_corpus_dir",
    "get_tokenizer",
    "prepare",
    "write_token_file",
]


def embedded_corpus_dir() -> Path:
    """The directory of the shipped corpus (original plain-English ``*.txt``), ready for `prepare`."""
    d = Path(__file__).resolve().parent / "corpus"
    if not any(d.glob("*.txt")):
        raise DataError(f"the embedded corpus is missing from {d}; reinstall mtc (the package data was not installed)")
    return d
