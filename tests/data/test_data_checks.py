"""Data checks a run makes before training: vocabulary, length, and the identity of resumed data."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mtc.data import TokenFile, check_data_identity, check_fits, prepare, write_token_file
from mtc.errors import DataError


def _tokens(tmp_path: Path, toks, name: str = "t", vocab_size: int = 256) -> TokenFile:
    return write_token_file(tmp_path / name, np.asarray(toks), vocab_size=vocab_size, tokenizer="byte")


def _strip_new_fields(tf: TokenFile) -> TokenFile:
    """The header an older mtc (or another tool) writes: no max_token_id, no sha256."""
    h = json.loads(tf.header_path.read_text())
    del h["max_token_id"], h["sha256"]
    tf.header_path.write_text(json.dumps(h))
    return TokenFile.open(tf.path)


def test_header_records_max_id_and_content_hash(tmp_path):
    (tmp_path / "a.txt").write_text("zebra\n")
    tf = prepare(tmp_path / "a.txt", tmp_path / "a.bin")
    assert tf.header.max_token_id == ord("z")
    assert tf.header.sha256 == hashlib.sha256(tf.path.read_bytes()).hexdigest()
    big = _tokens(tmp_path, [0, 70_000, 5], name="big", vocab_size=100_000)
    assert big.header.max_token_id == 70_000 and big.header.sha256 == hashlib.sha256(big.path.read_bytes()).hexdigest()


def test_old_header_still_opens_and_is_scanned(tmp_path):
    old = _strip_new_fields(_tokens(tmp_path, [3, 200, 7]))
    assert old.header.max_token_id is None and old.header.sha256 is None
    assert old.max_token_id() == 200
    with pytest.raises(DataError, match="token id 200"):
        old.check_vocab(100)


@pytest.mark.parametrize(("edit", "match"), [
    ({"max_token_id": 256}, r"max_token_id must be an integer in \[0, 255\], got 256"),
    ({"max_token_id": "9"}, "max_token_id must be an integer"),
    ({"sha256": "abc"}, "sha256 must be 64 lowercase hex digits, got 'abc'"),
])
def test_bad_new_header_fields(tmp_path, edit, match):
    tf = _tokens(tmp_path, [1, 2, 3])
    tf.header_path.write_text(json.dumps(json.loads(tf.header_path.read_text()) | edit))
    with pytest.raises(DataError, match=match):
        TokenFile.open(tf.path)


def test_check_vocab(tmp_path):
    tf = _tokens(tmp_path, [0, 255, 9])
    tf.check_vocab(256)
    with pytest.raises(DataError) as e:
        tf.check_vocab(128)
    msg = str(e.value)
    assert "token id 255" in msg and "only 128 ids (0-127)" in msg and "vocab_size >= 256" in msg
    empty = _tokens(tmp_path, np.array([], dtype=np.int64), name="e")
    with pytest.raises(DataError, match=r"is empty \(0 tokens\)"):
        empty.check_vocab(256)
    with pytest.raises(DataError, match="vocab_size must be an integer >= 1, got True"):
        tf.check_vocab(True)


def test_check_fits(tmp_path):
    tf = _tokens(tmp_path, np.arange(17) % 256)
    check_fits(tf, 16)  # 16 inputs + the last target
    with pytest.raises(DataError) as e:
        check_fits(tf, 32)
    assert "has 17 tokens" in str(e.value) and "seq_len=32 needs at least 33" in str(e.value)
    with pytest.raises(DataError, match="the token array has 0 tokens"):
        check_fits(np.array([], dtype=np.uint16), 1)
    # training samples the train split, which leaves out the last 5 %: 33 tokens hold one sequence
    # of 32, their train split (32 tokens) does not
    tf = _tokens(tmp_path, np.arange(33) % 256, name="t33")
    check_fits(tf, 32)
    with pytest.raises(DataError, match=r"the train split has 32 tokens \(of 33, val_fraction=0.05\) but seq_len=32"):
        check_fits(tf, 32, split="train")


def test_identity_and_resume_check(tmp_path):
    tf = _tokens(tmp_path, np.arange(1000) % 256)
    ident = tf.identity()
    assert ident["hash_kind"] == "content" and ident["hash"] == tf.header.sha256
    assert ident["size_bytes"] == 2000 and ident["header"]["n_tokens"] == 1000 and ident["path"].endswith("t.bin")
    # Moved but identical: the same data.
    (tmp_path / "moved").mkdir()
    for p in (tf.path, tf.header_path):
        shutil.copy(p, tmp_path / "moved" / p.name)
    check_data_identity(ident, TokenFile.open(tmp_path / "moved" / "t.bin").identity(), allow_change=False)
    other = _tokens(tmp_path, (np.arange(1000) + 1) % 256, name="u").identity()
    with pytest.raises(DataError) as e:
        check_data_identity(ident, other, allow_change=False)
    assert "content sha256" in str(e.value) and "pass --allow-change data to continue on new data" in str(e.value)
    check_data_identity(ident, other, allow_change=True)
    check_data_identity(None, other, allow_change=False)  # a run that recorded no identity
    longer = _tokens(tmp_path, np.arange(1200) % 256, name="l").identity()
    with pytest.raises(DataError, match=r"size 2000 -> 2400 bytes; n_tokens 1000 -> 1200"):
        check_data_identity(ident, longer, allow_change=False)


def test_identity_of_a_file_without_content_hash(tmp_path):
    n = 1_500_000  # 3 MB of uint16: the first and last MiB do not overlap
    toks = np.arange(n) % 256
    old = _strip_new_fields(_tokens(tmp_path, toks))
    ident = old.identity()
    assert ident["hash_kind"] == "sample" and ident["header"].get("sha256") is None
    raw = old.path.read_bytes()
    assert ident["hash"] == hashlib.sha256(raw[: 1 << 20] + raw[-(1 << 20):] + str(len(raw)).encode()).hexdigest()
    toks[-1] = 3  # a changed last token shows in the sample
    changed = _strip_new_fields(_tokens(tmp_path, toks, name="c")).identity()
    with pytest.raises(DataError, match="sample sha256"):
        check_data_identity(ident, changed, allow_change=False)


def test_version_1_header_still_opens_as_a_stream(tmp_path):
    """A token file from an older mtc: header version 1, no sidecars; read, sampled as a stream."""
    from mtc.data import BatchSampler

    (tmp_path / "a.txt").write_text("an old corpus, tokenized by an older mtc\n" * 20)
    tf = prepare(tmp_path / "a.txt", tmp_path / "a.bin")
    old = {k: v for k, v in json.loads(tf.header_path.read_text()).items() if k in (
        "format", "dtype", "vocab_size", "tokenizer", "n_tokens", "max_token_id", "sha256")} | {"version": 1}
    tf.header_path.write_text(json.dumps(old))
    (tmp_path / "a.docs").unlink()
    again = TokenFile.open(tmp_path / "a.bin")
    assert again.header.version == 1 and again.docs is None and again.mask is None and again.header.eos_id is None
    assert BatchSampler(again, batch_size=2, seq_len=16, seed=0).mode == "stream"
    assert again.identity()["hash"] == tf.header.sha256


def test_sidecars_are_part_of_the_identity_and_checked_on_open(tmp_path):
    toks = np.arange(1000) % 256
    mask = (np.arange(1000) % 2).astype(np.uint8)
    a = write_token_file(tmp_path / "a", toks, vocab_size=256, tokenizer="byte", doc_ends=[400, 1000], mask=mask)
    b = write_token_file(tmp_path / "b", toks, vocab_size=256, tokenizer="byte", doc_ends=[400, 1000], mask=1 - mask)
    with pytest.raises(DataError, match=r"differs in mask a.mask \(sha256 [0-9a-f]{12}\.\.\.\) -> b.mask"):
        check_data_identity(a.identity(), b.identity(), allow_change=False)
    renamed = write_token_file(tmp_path / "r", toks, vocab_size=256, tokenizer="byte", doc_ends=[400, 1000], mask=mask)
    check_data_identity(a.identity(), renamed.identity(), allow_change=False)  # same contents, other names
    with pytest.raises(DataError, match="differs in mask"):
        check_data_identity(a.identity(), b.identity(), allow_change=False)
    c = write_token_file(tmp_path / "c", toks, vocab_size=256, tokenizer="byte", doc_ends=[500, 1000], mask=mask)
    with pytest.raises(DataError, match="differs in docs"):
        check_data_identity(a.identity(), c.identity(), allow_change=False)
    (tmp_path / "a.mask").write_bytes(b"\x01" * 10)
    with pytest.raises(DataError, match=r"a.mask is 10 bytes, its header says 1,000"):
        TokenFile.open(tmp_path / "a.bin")
    (tmp_path / "b.docs").unlink()
    with pytest.raises(DataError, match=r"b.docs is missing beside"):
        TokenFile.open(tmp_path / "b.bin")
    np.asarray([0, 700, 999], dtype="<i8").tofile(tmp_path / "c.docs")
    with pytest.raises(DataError, match="document boundaries c.docs do not fit"):
        TokenFile.open(tmp_path / "c.bin")


def test_tokenizer_identity(tmp_path):
    from mtc.data import check_tokenizer_identity

    def ident(**h):
        return {"path": "x.bin", "header": {"tokenizer": "byte", "vocab_size": 256} | h}

    check_tokenizer_identity(None, ident())
    check_tokenizer_identity(ident(), ident())  # two byte files (no tokenizer.json)
    check_tokenizer_identity(ident(tokenizer="gpt2", tokenizer_sha256="a" * 64), ident(tokenizer="moved", tokenizer_sha256="a" * 64))
    with pytest.raises(DataError, match=r"was tokenized by 'gpt2' \(50257 ids, tokenizer.json sha256 bbbbbbbbbbbb...\)"):
        check_tokenizer_identity(ident(), ident(tokenizer="gpt2", vocab_size=50257, tokenizer_sha256="b" * 64))
    with pytest.raises(DataError, match="was tokenized by"):
        check_tokenizer_identity(ident(tokenizer="gpt2", tokenizer_sha256="a" * 64), ident(tokenizer="gpt2", tokenizer_sha256="b" * 64))


def test_tokenizer_vocabulary_larger_than_the_model(tmp_path):
    tf = _tokens(tmp_path, [1, 2, 3], vocab_size=300)  # every id fits, but the tokenizer can emit 300
    with pytest.raises(DataError, match=r"tokenizer 'byte' of 300 ids but the model embeds only 256"):
        tf.check_vocab(256)
    tf.check_vocab(300)
