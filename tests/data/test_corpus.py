"""The embedded corpus ships with the package, is plain ASCII text, and is big enough for the demo."""

from __future__ import annotations

from pathlib import Path

from mtc.data import BatchSampler, embedded_corpus_dir, prepare


def test_corpus_exists_ascii_and_large_enough() -> None:
    d = embedded_corpus_dir()
    files = sorted(d.glob("*.txt"))
    assert len(files) >= 6
    total = 0
    for f in files:
        data = f.read_bytes()
        assert data.isascii(), f"{f.name} has non-ASCII bytes"
        assert b"\r" not in data and b"\t" not in data
        assert b"\n\n" in data  # paragraphs separated by blank lines
        total += len(data)
    assert total >= 50_000


def test_corpus_prepares_and_samples(tmp_path: Path) -> None:
    tf = prepare(embedded_corpus_dir(), tmp_path / "corpus.bin")
    assert len(tf) >= 50_000 and int(tf.tokens.max()) < 128
    x, y = BatchSampler(tf, batch_size=8, seq_len=128, seed=0, split="val").batch(0)
    assert x.shape == (8, 128)
