"""Data: tokenizers, the token file format (`prepare`, `TokenFile`), cursor-addressed batches
(one document per sequence, SFT loss masks), and the small English corpus shipped for the demo."""

from __future__ import annotations

from pathlib import Path

from mtc.data.batches import BatchSampler, check_fits
from mtc.data.ingest import prepare
from mtc.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, get_tokenizer
from mtc.data.tokens import (
    TokenFile,
    TokenHeader,
    TokenWriter,
    check_data_identity,
    check_store_tokenizer,
    check_tokenizer_identity,
    write_token_file,
)
from mtc.errors import DataError

__all__ = [
    "BatchSampler",
    "ByteTokenizer",
    "HFTokenizer",
    "TokenFile",
    "TokenHeader",
    "TokenWriter",
    "Tokenizer",
    "check_data_identity",
    "check_fits",
    "check_store_tokenizer",
    "check_tokenizer_identity",
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
