"""Random next-token batches from a token array, addressed by a cursor so training can resume anywhere.

Batch ``k`` is a pure function of ``(seed, k, split)``: its window starts are drawn from
``np.random.default_rng([seed, k, split_id])``. There is no sampler state to checkpoint; a run that
stores its data cursor replays exactly the batches it would have seen.
"""

from __future__ import annotations

import numpy as np
import torch

from mtc.data.tokens import TokenFile
from mtc.errors import DataError

__all__ = ["SPLITS", "BatchSampler", "check_fits"]

# The id is part of the RNG key, so train and val draw unrelated offsets for the same cursor.
SPLITS = {"train": 0, "val": 1}


def check_fits(tokens: TokenFile | np.ndarray, seq_len: int) -> None:
    """Raise DataError when ``tokens`` hold less than one sequence of ``seq_len`` plus its last target."""
    n = len(tokens)
    need = seq_len + 1
    if n < need:
        where = f"token file {tokens.path}" if isinstance(tokens, TokenFile) else "the token array"
        raise DataError(
            f"{where} has {n:,} tokens but seq_len={seq_len} needs at least {need:,} (one sequence plus its last "
            "target); use more text or a shorter --seq-len"
        )


class BatchSampler:
    """(inputs, targets) int64 batches of shape (batch_size, seq_len) from one split of a token array.

    The last ``val_fraction`` of the tokens (rounded down) is the "val" split and the rest is
    "train"; a window never crosses the boundary, so the splits share no token.
    """

    def __init__(
        self,
        tokens: TokenFile | np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        split: str = "train",
        val_fraction: float = 0.05,
    ) -> None:
        arr = tokens.tokens if isinstance(tokens, TokenFile) else tokens
        # np.asarray keeps a memmap's pages on disk (a view, not a copy).
        arr = np.asarray(arr)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"tokens must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
        for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DataError(f"{name} must be a positive integer, got {v!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise DataError(f"seed must be a non-negative integer (it keys numpy's SeedSequence), got {seed!r}")
        if split not in SPLITS:
            raise DataError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction must be in [0, 1), got {val_fraction!r}")

        n = int(arr.size)
        boundary = n - int(n * val_fraction)
        lo, hi = (0, boundary) if split == "train" else (boundary, n)
        need = seq_len + 1  # one extra token: the last input's target
        if hi - lo < need:
            hint = "a larger val_fraction, " if split == "val" else ""
            raise DataError(
                f"the {split} split has {hi - lo:,} tokens (of {n:,}, val_fraction={val_fraction}) but seq_len={seq_len} "
                f"needs at least {need:,}; use more text, {hint}or a shorter seq_len"
            )
        self._tokens = arr
        self._lo, self._hi = lo, hi
        self._offsets = np.arange(need, dtype=np.int64)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = int(seed)
        self.split = split
        self.val_fraction = val_fraction

    @property
    def n_tokens(self) -> int:
        """Tokens in this sampler's split."""
        return self._hi - self._lo

    @property
    def bounds(self) -> tuple[int, int]:
        """The split's half-open token range [start, end) in the whole array."""
        return self._lo, self._hi

    def batch(self, cursor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``cursor``: (inputs, targets), int64, (batch_size, seq_len), targets shifted by one."""
        if isinstance(cursor, bool) or not isinstance(cursor, (int, np.integer)) or cursor < 0:
            raise DataError(f"cursor must be a non-negative integer, got {cursor!r}")
        rng = np.random.default_rng([self.seed, int(cursor), SPLITS[self.split]])
        # high is exclusive: the last start leaves room for seq_len + 1 tokens before the split end.
        starts = rng.integers(self._lo, self._hi - self.seq_len, size=self.batch_size, dtype=np.int64)
        win = self._tokens[starts[:, None] + self._offsets].astype(np.int64)  # (B, T+1)
        w = torch.from_numpy(win)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def __repr__(self) -> str:
        return (f"BatchSampler(split={self.split!r}, tokens=[{self._lo}, {self._hi}), batch_size={self.batch_size}, "
                f"seq_len={self.seq_len}, seed={self.seed})")
