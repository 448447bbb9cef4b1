"""Token files: prepare -> open round trips, dtype choice, and the errors for damaged files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mtc.data import ByteTokenizer, TokenFile, prepare, write_token_file
from mtc.errors import DataError, MTCError


def _prepared(tmp_path: Path, text: str = "The fox sat by the lantern.\n") -> TokenFile:
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    return prepare(src, tmp_path / "out.bin")


def test_prepare_round_trip(tmp_path: Path) -> None:
    text = "The fox sat by the lantern. Caf\u00e9.\n"
    tf = _prepared(tmp_path, text)
    # the byte tokenizer has no EOS: a document ends with a blank line
    assert len(tf) == len(text.encode("utf-8")) + 1
    docs = tmp_path / "out.docs"
    assert tf.header.to_dict() == {
        "format": "mtc-tokens", "version": 2, "dtype": "uint16", "vocab_size": 256,
        "tokenizer": "byte", "n_tokens": len(tf),
        "max_token_id": max(text.encode("utf-8")), "sha256": hashlib.sha256(tf.path.read_bytes()).hexdigest(),
        "tokenizer_spec": "byte",
        "docs": {"file": "out.docs", "n_docs": 1, "sha256": hashlib.sha256(docs.read_bytes()).hexdigest()},
        "source": {"read": 1, "empty": 0, "skipped": 0, "skipped_examples": []},
    }
    assert tf.docs.tolist() == [0, len(tf)] and tf.mask is None and tf.tokenizer_dir is None
    assert ByteTokenizer().decode(tf.tokens) == text + "\n"
    assert (tmp_path / "out.bin").stat().st_size == 2 * len(tf)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # temp files renamed away


@pytest.mark.parametrize("name", ["out.bin", "out.json", "out"])
def test_open_accepts_bin_json_or_stem(tmp_path: Path, name: str) -> None:
    tf = _prepared(tmp_path)
    again = TokenFile.open(tmp_path / name)
    assert again.path == tf.path and again.header == tf.header
    np.testing.assert_array_equal(again.tokens, tf.tokens)


def test_tokens_are_read_only_memmap(tmp_path: Path) -> None:
    tf = _prepared(tmp_path)
    assert isinstance(tf.tokens, np.memmap)
    with pytest.raises(ValueError):
        tf.tokens[0] = 1


def test_prepare_directory_in_sorted_order(tmp_path: Path) -> None:
    d = tmp_path / "texts"
    d.mkdir()
    (d / "b.txt").write_text("second\n")
    (d / "a.txt").write_text("first")  # no final newline: one is added before the blank line
    (d / "notes.md").write_text("ignored\n")
    tf = prepare(d, tmp_path / "corpus.bin")
    assert ByteTokenizer().decode(tf.tokens) == "first\n\nsecond\n\n"
    assert tf.docs.tolist() == [0, 7, 15]  # one document per file


def test_prepare_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        prepare(tmp_path / "nope.txt", tmp_path / "o.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no input files \(\*\.txt, \*\.jsonl"):
        prepare(tmp_path / "empty", tmp_path / "o.bin")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="not valid UTF-8"):
        prepare(tmp_path / "latin1.txt", tmp_path / "o.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "latin1.txt"]  # no partial or temporary files
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(DataError, match="contains no text"):
        prepare(tmp_path / "blank.txt", tmp_path / "o.bin")
    with pytest.raises(DataError, match="unknown tokenizer"):
        prepare(tmp_path / "latin1.txt", tmp_path / "o.bin", tokenizer="nope")
    # an output path that cannot be written (here under a regular file): one line, nothing left behind
    (tmp_path / "ok.txt").write_text("some text")
    for out in (tmp_path / "blank.txt" / "o.bin", tmp_path / "blank.txt" / "sub" / "o.bin"):  # (made, or not, by prepare)
        # the message names the file in the way, not only the token file it blocks
        with pytest.raises(DataError, match=r"cannot write the token file .*blank.txt/.*o.bin: .*: .*blank.txt(/sub)?; choose another -o"):
            prepare(tmp_path / "ok.txt", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.txt", "empty", "latin1.txt", "ok.txt"]
    # a directory where the token file (or a sidecar) would go: refused before anything is read or written
    for taken in ("o.bin", "o.json"):
        (tmp_path / "out" / taken).mkdir(parents=True)
        with pytest.raises(DataError, match=rf"cannot write the token file .*o.bin: .*{taken} exists and is not a file"):
            prepare(tmp_path / "ok.txt", tmp_path / "out" / "o.bin")
        assert [p.name for p in (tmp_path / "out").iterdir()] == [taken]  # no temporaries left
        (tmp_path / "out" / taken).rmdir()


def test_a_token_file_whose_second_temporary_cannot_be_made_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    from mtc.data import tokens

    made = []
    real = tokens._temporary

    def failing_second(final: Path) -> tuple[int, str]:
        if made:
            raise PermissionError(13, "Permission denied")
        made.append(real(final))
        return made[-1]

    monkeypatch.setattr(tokens, "_temporary", failing_second)
    with pytest.raises(DataError, match=r"cannot write the token file .*o.bin: Permission denied; choose another -o"):
        tokens.TokenWriter(tmp_path / "o.bin", vocab_size=256, tokenizer="byte", with_docs=True)
    assert made and list(tmp_path.iterdir()) == []  # the first temporary was closed and removed


def test_uint32_for_large_vocab(tmp_path: Path) -> None:
    toks = np.array([0, 65535, 65536, 99_999], dtype=np.int64)
    tf = write_token_file(tmp_path / "big", toks, vocab_size=100_000, tokenizer="custom")
    assert tf.header.dtype == "uint32" and tf.tokens.dtype == np.dtype("<u4")
    assert (tmp_path / "big.bin").stat().st_size == 4 * 4
    np.testing.assert_array_equal(TokenFile.open(tmp_path / "big.bin").tokens, toks)


def test_uint16_up_to_65536(tmp_path: Path) -> None:
    tf = write_token_file(tmp_path / "edge", np.array([65535]), vocab_size=65536, tokenizer="custom")
    assert tf.header.dtype == "uint16" and int(tf.tokens[0]) == 65535


@pytest.mark.parametrize("bad", [256, -1])
def test_token_outside_vocab(tmp_path: Path, bad: int) -> None:
    with pytest.raises(DataError, match=f"token {bad} at position 2"):
        write_token_file(tmp_path / "t", np.array([1, 2, bad, 3]), vocab_size=256, tokenizer="byte")
    assert not (tmp_path / "t.bin").exists()


def test_write_rejects_non_integer_tokens(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="1-D integer"):
        write_token_file(tmp_path / "t", np.array([1.0, 2.0]), vocab_size=256, tokenizer="byte")


def test_empty_token_file_opens(tmp_path: Path) -> None:
    tf = write_token_file(tmp_path / "e", np.array([], dtype=np.int64), vocab_size=256, tokenizer="byte")
    assert len(tf) == 0 and tf.tokens.size == 0


def test_truncated_bin(tmp_path: Path) -> None:
    tf = _prepared(tmp_path)
    data = tf.path.read_bytes()
    tf.path.write_bytes(data[:-3])
    with pytest.raises(DataError, match=r"is \d+ bytes but its header says .* re-run `mtc prepare"):
        TokenFile.open(tmp_path / "out.bin")


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found.*mtc prepare"):
        TokenFile.open(tmp_path / "none.bin")
    _prepared(tmp_path)
    (tmp_path / "out.json").unlink()
    with pytest.raises(DataError, match="header .* is missing"):
        TokenFile.open(tmp_path / "out.bin")
    # raw text handed to --data: named as such, with the prepare command that makes a token file of it
    (tmp_path / "fables.txt").write_text("once upon a time")
    with pytest.raises(DataError, match=r"fables.txt is not an mtc token file .*`mtc prepare .*fables.txt -o .*fables.bin`"):
        TokenFile.open(tmp_path / "fables.txt")
    (tmp_path / "texts").mkdir()
    with pytest.raises(DataError, match="texts is not an mtc token file"):
        TokenFile.open(tmp_path / "texts")
    (tmp_path / "only.json").write_text("{}")
    with pytest.raises(DataError, match="only.bin not found"):  # the header alone: its .bin is what is missing
        TokenFile.open(tmp_path / "only.json")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"format": "npy"}, "format is 'npy'"),
        ({"version": 3}, r"version 3 is not supported \(this mtc reads versions 1, 2\)"),
        ({"docs": {"file": "../x.docs", "n_docs": 1}}, "docs must be an object naming a sibling file"),
        ({"mask": {"file": "out.mask", "n_targets": -1}}, "mask.n_targets must be an integer >= 0"),
        ({"eos_id": 256}, r"eos_id must be an integer in \[0, 255\]"),
        ({"tokenizer_sha256": "xyz"}, "tokenizer_sha256 must be 64 lowercase hex digits"),
        ({"tokenizer_dir": "../tok"}, "tokenizer_dir must name a sibling directory"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"dtype": "uint16", "vocab_size": 70_000}, "cannot hold"),
        ({"n_tokens": -1}, "n_tokens must be an integer"),
        ({"n_tokens": True}, "n_tokens must be an integer"),
        ({"vocab_size": "256"}, "vocab_size must be an integer"),
        ({"tokenizer": None}, "tokenizer must be"),
    ],
)
def test_bad_header(tmp_path: Path, edit: dict, match: str) -> None:
    _prepared(tmp_path)
    h = tmp_path / "out.json"
    h.write_text(json.dumps(json.loads(h.read_text()) | edit))
    with pytest.raises(DataError, match=match) as e:
        TokenFile.open(tmp_path / "out")
    assert "re-run `mtc prepare" in str(e.value)
    assert isinstance(e.value, MTCError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_header_not_an_object(tmp_path: Path, content: str) -> None:
    _prepared(tmp_path)
    (tmp_path / "out.json").write_text(content)
    with pytest.raises(DataError, match="JSON"):
        TokenFile.open(tmp_path / "out.bin")
