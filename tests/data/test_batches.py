"""BatchSampler: batches are a pure function of (seed, cursor, split), shifted targets, disjoint splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mtc.data import BatchSampler, write_token_file
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
    with pytest.raises(DataError, match="val split has 50 tokens.*larger val_fraction"):
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
