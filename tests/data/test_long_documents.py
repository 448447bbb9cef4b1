"""A document too long to hand to the tokenizer at once (a text file, a long record) is tokenized
in windows; its ids must be the tokenizer's for its whole text, wherever the windows end."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from mtc.data import ByteTokenizer, TokenFile, get_tokenizer, ingest, prepare, sources
from mtc.errors import DataError
from tests.data.tok_util import STYLES, styled_dir, wordlevel_json

# Runs of newlines and spaces (which GPT-2-style pre-tokenizers group by what follows them),
# multi-byte characters (split over several byte-level tokens), digits (Llama 3 groups them in
# threes from the left) and punctuation, every few characters: a window's end falls in one.
_PARTS = ["the", "fox", "sat", "by", "lantern", "watched", "sea", "caf\u00e9", "na\u00efve", "\u65e5\u672c\u8a9e\u306e\u6587",
          "\U0001f600", "\U0001f44d\U0001f3fd", "12345678", "3.14159", "...", "don't", "\t", "\r\n", "\u00dcn\u00efc\u00f6d\u00e9"]


def _text(rnd: random.Random, n: int) -> str:
    out: list[str] = []
    size = 0
    while size < n:
        r = rnd.random()
        part = ("\n" * rnd.randint(1, 9) if r < 0.15 else " " * rnd.randint(1, 12) if r < 0.3
                else rnd.choice("-=*.") * rnd.randint(2, 20) if r < 0.35 else rnd.choice(_PARTS) + rnd.choice(" ,\n"))
        out.append(part)
        size += len(part)
    return "".join(out)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    rnd = random.Random(5)
    texts = [_text(rnd, 400) for _ in range(200)]
    specs = {s: str(styled_dir(root, s, texts)) for s in STYLES}
    specs["words"] = str(wordlevel_json(root))
    specs["byte"] = "byte"
    return specs


def _open(spec: str):
    return get_tokenizer(spec, eos_token="[EOS]" if spec.endswith("words.json") else None)


def _whole(tok, text: str) -> np.ndarray:
    """The ids of ``text`` as one document: the tokenizer's for all of it, then the separator."""
    ids = tok.encode(text, special=True)
    if tok.eos_id is None:
        return np.r_[ids, tok.encode("\n", special=False)]
    return ids if len(ids) and ids[-1] == tok.eos_id else np.r_[ids, tok.eos_id]


def _as_file(text: str) -> str:
    """``text`` as a text file's document: made to end with a newline."""
    return text if text.endswith("\n") else text + "\n"


def _docs(tf: TokenFile) -> list[np.ndarray]:
    b = tf.docs.tolist()
    return [np.asarray(tf.tokens[b[i]:b[i + 1]]) for i in range(len(b) - 1)]


def _small_windows(monkeypatch, window: int, overlap: int = 160, most: int = 2000) -> None:
    monkeypatch.setattr(sources, "_PIECE", 97)  # the pieces a text file and a long record are read in
    monkeypatch.setattr(ingest, "_BATCH_CHARS", window)
    monkeypatch.setattr(ingest, "_OVERLAP", overlap)
    monkeypatch.setattr(ingest, "_MAX_WINDOW", most)


@pytest.mark.parametrize("style", [*STYLES, "words", "byte"])
def test_a_long_document_gets_the_ids_of_its_whole_text(tmp_path, monkeypatch, tokenizers, style):
    spec = tokenizers[style]
    tok = _open(spec)
    text = _text(random.Random(11), 5000)
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "short one"}) + "\n")
    eos = "[EOS]" if style == "words" else None
    for window in range(400, 424, 3):  # windows end at many places in the text's runs
        # no window grows to the whole text (2000 < 5000): the ids are joined from windows
        _small_windows(monkeypatch, window)
        f = prepare(tmp_path / "a.txt", tmp_path / "f.bin", tokenizer=spec, eos_token=eos)
        assert np.array_equal(f.tokens, _whole(tok, _as_file(text))), window
        j = prepare(tmp_path / "a.jsonl", tmp_path / "j.bin", tokenizer=spec, eos_token=eos)
        got = _docs(j)
        assert len(got) == 2 and np.array_equal(got[0], _whole(tok, text)), window
        assert np.array_equal(got[1], _whole(tok, "short one"))


@pytest.mark.parametrize("style", ["gpt2", "llama3", "llama2"])
def test_runs_longer_than_the_overlap_across_a_windows_end(tmp_path, monkeypatch, tokenizers, style):
    """Where two windows share no stretch of equal tokens (a window's end inside a run longer than
    the overlap), the window grows past the run and the ids are still the whole text's."""
    tok = _open(tokenizers[style])
    rnd = random.Random(3)
    text = "".join(_text(rnd, 300) + run for run in (" " * 400, "\n" * 333, "-" * 350, "\u00e9" * 300, "7" * 301))
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": text}) + "\n")
    _small_windows(monkeypatch, 250, most=1 << 20)
    tf = prepare(tmp_path / "a.jsonl", tmp_path / "o.bin", tokenizer=tokenizers[style])
    assert np.array_equal(tf.tokens, _whole(tok, text))


class _NoOffsets:
    """A tokenizer with only what the `Tokenizer` protocol asks: ids, no character offsets."""

    def __init__(self, tok) -> None:
        self._tok = tok
        for k in ("name", "spec", "vocab_size", "eos_id", "sha256", "chat_template", "files"):
            setattr(self, k, getattr(tok, k))

    def encode(self, text: str, *, special: bool = True) -> np.ndarray:
        return self._tok.encode(text, special=special)

    def decode(self, ids) -> str:
        return self._tok.decode(ids)

    def token(self, token_id: int) -> str | None:
        return self._tok.token(token_id)


def test_without_offsets_or_a_join_point_a_document_is_tokenized_whole_or_refused(tmp_path, monkeypatch, tokenizers):
    hf = _open(tokenizers["gpt2"])
    text = _text(random.Random(7), 3000)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": text}) + "\n")
    # no offsets: windows cannot be lined up, so the document is tokenized whole, up to _MAX_WINDOW
    _small_windows(monkeypatch, 250, most=4096)
    tf = prepare(tmp_path / "a.jsonl", tmp_path / "o.bin", tokenizer=_NoOffsets(hf))
    assert np.array_equal(tf.tokens, _whole(hf, text))
    _small_windows(monkeypatch, 250, most=1024)
    with pytest.raises(DataError, match=r"gives no character offsets.*document 1 .*over 1,024 characters.*split the "
                                        r"document"):
        prepare(tmp_path / "a.jsonl", tmp_path / "o.bin", tokenizer=_NoOffsets(hf))
    # windows that never agree on enough tokens to be joined: the same, never ids that differ
    monkeypatch.setattr(ingest, "_AGREE", 10**6)
    with pytest.raises(DataError, match=r"characters 0 to 1,024 of document 1 .*hold no place where tokenizer 'gpt2'"):
        prepare(tmp_path / "a.jsonl", tmp_path / "o.bin", tokenizer=tokenizers["gpt2"])
    _small_windows(monkeypatch, 250, most=4096)
    tf = prepare(tmp_path / "a.jsonl", tmp_path / "o.bin", tokenizer=tokenizers["gpt2"])
    assert np.array_equal(tf.tokens, _whole(hf, text))


def test_the_byte_tokenizer_needs_no_windows(tmp_path, monkeypatch):
    text = _text(random.Random(2), 3000)
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    _small_windows(monkeypatch, 250, most=250)  # no window grows: pieces are tokenized as they come
    tf = prepare(tmp_path / "a.txt", tmp_path / "o.bin")
    assert ByteTokenizer().decode(tf.tokens) == _as_file(text) + "\n"
