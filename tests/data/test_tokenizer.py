"""ByteTokenizer round trips and tokenizer lookup."""

from __future__ import annotations

import numpy as np
import pytest

from mtc.data import ByteTokenizer, get_tokenizer
from mtc.errors import DataError


@pytest.mark.parametrize("text", ["", "hello, world\n", "caf\u00e9 na\u00efve \u00fcber", "\u65e5\u672c\u8a9e \U0001f600 \u03b1\u03b2"])
def test_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.ndim == 1
    assert len(ids) == len(text.encode("utf-8"))  # one token per UTF-8 byte, not per character
    assert int(ids.max(initial=0)) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode(list(map(int, ids))) == text  # plain lists, as the demo passes


def test_decode_broken_utf8_is_replaced() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("\u00e9")[:1]  # half of a two-byte character, as a sampled model may emit
    assert tok.decode(ids) == "\ufffd"


def test_decode_rejects_out_of_range() -> None:
    with pytest.raises(DataError, match="256"):
        ByteTokenizer().decode([65, 300])


def test_get_tokenizer() -> None:
    tok = get_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.name == "byte" and tok.vocab_size == 256
    with pytest.raises(DataError, match="known tokenizers: byte"):
        get_tokenizer("gpt2")
