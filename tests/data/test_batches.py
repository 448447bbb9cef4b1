"""BatchSampler: batches are a pure function of (seed, cursor, split), shifted targets, disjoint splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mtc.data import BatchSampler, check_fits, write_token_file
from mtc.data.batches import IGNORE_INDEX
from mtc.errors import DataError

# Tokens equal to their own positions, so a batch shows exactly where each window came from.
N = 10_000
POSITIONS = np.arange(N, dtype=np.int64)


def _sampler(**kw: object) -> BatchSampler:
    args: dict = {"batch_size": 5, "seq_len": 37, "seed": 3} | kw
    return BatchSampler(POSITIONS, **args)


def test_shapes_and_dtype() -> None:
    x, y = _sampler().batch(0)
    assert x.shape == y.shape == (5, 37)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()


def test_targets_are_inputs_shifted() -> None:
    x, y = _sampler().batch(7)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)  # positions: the target of each token is the next position


def test_same_cursor_same_batch_across_instances() -> None:
    a, b = _sampler(), _sampler()
    for cursor in (0, 1, 12345):
        xa, ya = a.batch(cursor)
        _ = a.batch(cursor + 1)  # no hidden state: other calls in between change nothing
        xb, yb = b.batch(cursor)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_different_cursor_seed_or_split_differ() -> None:
    s = _sampler()
    assert not torch.equal(s.batch(0)[0], s.batch(1)[0])
    assert not torch.equal(s.batch(0)[0], _sampler(seed=4).batch(0)[0])
    # Same relative offsets would mean train and val share a random stream.
    train, val = _sampler(val_fraction=0.5), _sampler(split="val", val_fraction=0.5)
    assert not torch.equal(train.batch(0)[0], val.batch(0)[0] - 5000)


def test_train_val_disjoint() -> None:
    train = _sampler(val_fraction=0.1)
    val = _sampler(split="val", val_fraction=0.1)
    assert train.bounds == (0, 9000) and val.bounds == (9000, N)
    assert train.n_tokens == 9000 and val.n_tokens == 1000
    for cursor in range(50):
        x, y = train.batch(cursor)
        assert int(x.min()) >= 0 and int(y.max()) < 9000
        x, y = val.batch(cursor)
        assert int(x.min()) >= 9000 and int(y.max()) < N


def test_windows_reach_both_ends() -> None:
    # A split exactly seq_len + 1 long has a single possible window.
    s = BatchSampler(POSITIONS[:38], batch_size=3, seq_len=37, seed=0, val_fraction=0.0)
    x, y = s.batch(9)
    assert torch.equal(x, torch.arange(37).expand(3, 37)) and int(y.max()) == 37


def test_too_short() -> None:
    with pytest.raises(DataError, match="needs at least 38"):
        BatchSampler(POSITIONS[:37], batch_size=1, seq_len=37, seed=0, val_fraction=0.0)
    with pytest.raises(DataError, match="val split has 50 tokens.*mtc eval --split train"):
        BatchSampler(POSITIONS[:1000], batch_size=1, seq_len=64, seed=0, split="val")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"seq_len": -1}, "seq_len"),
        ({"seed": -1}, "seed"),
        ({"split": "test"}, "split must be one of"),
        ({"val_fraction": 1.0}, "val_fraction"),
    ],
)
def test_bad_arguments(kw: dict, match: str) -> None:
    with pytest.raises(DataError, match=match):
        _sampler(**kw)


def test_bad_cursor() -> None:
    with pytest.raises(DataError, match="cursor"):
        _sampler().batch(-1)


def test_from_token_file(tmp_path: Path) -> None:
    tf = write_token_file(tmp_path / "p", POSITIONS % 256, vocab_size=256, tokenizer="byte")
    a = BatchSampler(tf, batch_size=4, seq_len=16, seed=1)
    b = BatchSampler(POSITIONS % 256, batch_size=4, seq_len=16, seed=1)
    assert a.n_tokens == b.n_tokens == N - N // 20
    assert torch.equal(a.batch(5)[0], b.batch(5)[0]) and torch.equal(a.batch(5)[1], b.batch(5)[1])


# -- documents: not packed -----------------------------------------------------------------------

DOC_ENDS = [5, 6, 40, 41, 100, 300, 301, 2000]  # short, 1-token (no target), long, ... documents


def _doc_file(tmp_path: Path, mask: np.ndarray | None = None, eos_id: int | None = 0):
    n = DOC_ENDS[-1]
    # token i is i (mod the vocabulary), so a batch shows where each window came from
    return write_token_file(tmp_path / "d", np.arange(n) % 4096, vocab_size=4096, tokenizer="t", doc_ends=DOC_ENDS,
                            mask=mask, eos_id=eos_id)


def _all_windows(seq_len: int) -> list[tuple[int, int]]:
    """(start, targets) of every window: documents cut at k * seq_len from their start."""
    out, lo = [], 0
    for hi in DOC_ENDS:
        out += [(s, min(seq_len, hi - 1 - s)) for s in range(lo, hi - 1, seq_len)]
        lo = hi
    return out


def test_documents_are_not_packed(tmp_path: Path) -> None:
    tf = _doc_file(tmp_path)
    s = BatchSampler(tf, batch_size=16, seq_len=32, seed=0, val_fraction=0.0)
    assert s.mode == "documents" and s.n_windows == len(_all_windows(32))
    seen = set()
    for cursor in range(60):
        x, y = s.batch(cursor)
        for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
            start, n = int(row_x[0]), int((row_y != IGNORE_INDEX).sum())
            assert (start, n) in _all_windows(32)  # a document start, or k * seq_len into one
            seen.add(start)
            assert np.array_equal(row_x[:n], np.arange(start, start + n)) and np.array_equal(row_y[:n], row_x[:n] + 1)
            assert (row_x[n:] == 0).all() and (row_y[n:] == IGNORE_INDEX).all()  # padded with EOS id, no target
            doc = np.searchsorted(DOC_ENDS, start, side="right")
            assert start + n < DOC_ENDS[doc]  # never into the next document
    assert seen == {w for w, _ in _all_windows(32)}  # every window is drawn


def test_document_windows_are_drawn_uniformly(tmp_path: Path) -> None:
    s = BatchSampler(_doc_file(tmp_path), batch_size=64, seq_len=32, seed=1, val_fraction=0.0)
    counts: dict[int, int] = {}
    for cursor in range(200):
        for v in s.batch(cursor)[0][:, 0].tolist():
            counts[v] = counts.get(v, 0) + 1
    expect = 200 * 64 / s.n_windows
    assert min(counts.values()) > 0.6 * expect and max(counts.values()) < 1.5 * expect


def test_document_splits_are_disjoint_and_deterministic(tmp_path: Path) -> None:
    tf = _doc_file(tmp_path)
    train = BatchSampler(tf, batch_size=8, seq_len=32, seed=2, val_fraction=0.1)
    val = BatchSampler(tf, batch_size=8, seq_len=32, seed=2, split="val", val_fraction=0.1)
    boundary = 2000 - 200
    assert train.bounds[1] <= boundary <= val.bounds[0]
    for cursor in range(30):
        _, y = train.batch(cursor)
        assert int(y.max()) < boundary
        x, _ = val.batch(cursor)
        assert int(x[:, 0].min()) >= boundary
    again = BatchSampler(_doc_file(tmp_path / "copy"), batch_size=8, seq_len=32, seed=2, val_fraction=0.1)
    assert all(torch.equal(train.batch(c)[1], again.batch(c)[1]) for c in (0, 7, 999))


def test_files_without_boundaries_keep_stream_sampling(tmp_path: Path) -> None:
    tf = write_token_file(tmp_path / "s", np.arange(2000) % 4096, vocab_size=4096, tokenizer="t")
    s = BatchSampler(tf, batch_size=64, seq_len=32, seed=0)
    assert s.mode == "stream" and tf.docs is None
    starts = {int(v) for c in range(10) for v in s.batch(c)[0][:, 0]}
    assert any(v not in {w for w, _ in _all_windows(32)} for v in starts)  # windows start anywhere


def test_fully_masked_windows_are_redrawn(tmp_path: Path) -> None:
    mask = np.zeros(DOC_ENDS[-1], dtype=np.uint8)
    mask[1500:1510] = 1  # one window of the long document has targets
    s = BatchSampler(_doc_file(tmp_path, mask=mask), batch_size=4, seq_len=32, seed=0, val_fraction=0.0)
    x, y = s.batch(3)
    assert (x[:, 0] == 301 + 37 * 32).all()  # the window whose targets hold 1500..1509
    assert ((y != IGNORE_INDEX).sum(1) == 10).all()
    empty = _doc_file(tmp_path / "e", mask=np.zeros(DOC_ENDS[-1], dtype=np.uint8))
    with pytest.raises(DataError, match="loss mask leaves almost no window with a target"):
        BatchSampler(empty, batch_size=1, seq_len=32, seed=0).batch(0)


def test_check_fits_with_documents(tmp_path: Path) -> None:
    tf = write_token_file(tmp_path / "one", np.arange(4), vocab_size=256, tokenizer="byte", doc_ends=[4])
    check_fits(tf, 1024)  # a short document is padded: any seq_len fits
    lone = write_token_file(tmp_path / "lone", np.arange(1), vocab_size=256, tokenizer="byte", doc_ends=[1])
    with pytest.raises(DataError, match="the train split of the token file holds no sequence"):
        check_fits(lone, 8)


def test_an_id_beyond_what_the_header_states_is_named_as_damage(tmp_path: Path) -> None:
    # the model's vocabulary is checked against the header's max_token_id: an id past it (the .bin
    # changed since) indexed past the embedding table ("IndexError: index out of range")
    toks = np.arange(64) % 50
    tf = write_token_file(tmp_path / "t", toks, vocab_size=256, tokenizer="byte")
    s = BatchSampler(tf, batch_size=2, seq_len=8, seed=0)
    s.batch(0)
    raw = np.memmap(tf.path, dtype=np.uint16, mode="r+")
    raw[:] = 200
    raw.flush()
    del raw
    with pytest.raises(DataError, match=r"holds id 200 \(batch 0\), beyond the ids its header states \(below 50\): the file "
                                        r"was damaged"):
        BatchSampler(tf, batch_size=2, seq_len=8, seed=0).batch(0)
    # documents padded with an EOS the tokens never hold: the padding is no damage
    docs = write_token_file(tmp_path / "d", np.arange(5) % 5, vocab_size=256, tokenizer="byte", doc_ends=[2, 5], eos_id=99)
    x, _ = BatchSampler(docs, batch_size=4, seq_len=8, seed=0).batch(0)
    assert int(x.max()) == 99
