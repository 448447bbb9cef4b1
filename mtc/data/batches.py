"""Random next-token batches from a token file, addressed by a cursor so training can resume anywhere.

Batch ``k`` is a pure function of ``(seed, k, split)``: its windows are drawn from
``np.random.default_rng([seed, k, split_id])``. There is no sampler state to checkpoint; a run that
stores its data cursor replays exactly the batches it would have seen. Windows are drawn
independently, with replacement: there are no epochs (a run never runs out of data, and a window
may be drawn twice before another is drawn once).

Two ways to cut sequences, chosen by the file:

* **documents** (a token file with document boundaries, as `prepare` writes them, header version 2): documents
  are *not packed*. A sequence holds one document: a document of more than ``seq_len`` targets is
  split into consecutive windows of ``seq_len`` (the last one shorter), and a window shorter than
  ``seq_len`` is padded (inputs with the EOS id, or 0; targets with ``IGNORE_INDEX``, so the loss
  skips them). No sequence crosses a document boundary, so no attention mask or position reset is
  needed. Every window of the split is drawn with the same probability, so every token is as
  likely to be trained on as any other. Padding costs compute on short documents.
* **stream** (a plain token array, or a file from an older mtc without boundaries): windows of
  ``seq_len + 1`` tokens start at any position, across document separators.

A loss mask (SFT files) turns the targets it marks 0 into ``IGNORE_INDEX``; a window whose targets
are all ignored is redrawn (from the same generator, so batches stay a function of the cursor).
"""

from __future__ import annotations

import numpy as np
import torch

from mtc.data.tokens import TokenFile
from mtc.errors import DataError

__all__ = ["IGNORE_INDEX", "SPLITS", "BatchSampler", "check_fits"]

# The id is part of the RNG key, so train and val draw unrelated offsets for the same cursor.
SPLITS = {"train": 0, "val": 1}
IGNORE_INDEX = -100  # a target the loss skips (torch's cross_entropy default ignore_index)
_REDRAWS = 64  # rounds of redrawing windows whose targets are all masked before giving up


def check_fits(tokens: TokenFile | np.ndarray, seq_len: int, *, split: str | None = None) -> None:
    """Raise DataError when ``tokens`` hold less than one sequence of ``seq_len`` plus its last
    target; ``split`` ("train": what training samples), when the split holds none (the train split
    leaves out the last 5 %: a file of seq_len + 1 tokens passes the first check, not this one)."""
    if split is not None or (isinstance(tokens, TokenFile) and tokens.docs is not None):
        BatchSampler(tokens, batch_size=1, seq_len=seq_len, seed=0, split=split or "train")  # raises when no window fits
        return
    n = len(tokens)
    need = seq_len + 1
    if n < need:
        where = f"token file {tokens.path}" if isinstance(tokens, TokenFile) else "the token array"
        raise DataError(
            f"{where} has {n:,} tokens but seq_len={seq_len} needs at least {need:,} (one sequence plus its last "
            "target); use more text or a shorter --seq-len"
        )


# the val split is what in-run evals (--eval-every) and `mtc eval` read by default; its fraction is
# fixed for a run, so the user's ways out are other splits or no in-run eval
_VAL_HINT = "`mtc eval --split train` or `--split all` (or --eval-every 0 in training), "


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
        self._tokens = arr
        self._mask = tokens.mask if isinstance(tokens, TokenFile) else None
        self._path = tokens.path if isinstance(tokens, TokenFile) else None
        docs = tokens.docs if isinstance(tokens, TokenFile) else None
        self.mode = "documents" if docs is not None else "stream"
        self._pad = tokens.header.eos_id if isinstance(tokens, TokenFile) and tokens.header.eos_id is not None else 0
        # the largest id a batch may hold: the file's (its header's), or the padding's
        h = tokens.header if isinstance(tokens, TokenFile) else None
        self._vocab = None if h is None else h.vocab_size if h.max_token_id is None else max(h.max_token_id, self._pad) + 1
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = int(seed)
        self.split = split
        self.val_fraction = val_fraction
        if docs is not None:
            self._init_documents(np.asarray(docs, dtype=np.int64), boundary, n)
            return
        lo, hi = (0, boundary) if split == "train" else (boundary, n)
        need = seq_len + 1  # one extra token: the last input's target
        if hi - lo < need:
            hint = _VAL_HINT if split == "val" else ""
            raise DataError(
                f"the {split} split has {hi - lo:,} tokens (of {n:,}, val_fraction={val_fraction}) but seq_len={seq_len} "
                f"needs at least {need:,}; use more text, {hint}or a shorter seq_len"
            )
        self._lo, self._hi = lo, hi
        self._offsets = np.arange(need, dtype=np.int64)

    def _init_documents(self, bounds: np.ndarray, boundary: int, n: int) -> None:
        """Number the windows of every document; the split keeps those wholly before the boundary
        token (train) or starting at or after it (val), so no token is in both."""
        T = self.seq_len
        pairs = np.maximum(np.diff(bounds) - 1, 0)  # (input, target) pairs of each document
        self._bounds, self._pairs = bounds, pairs
        self._cum = np.concatenate([[0], np.cumsum(-(-pairs // T))]).astype(np.int64)
        W = int(self._cum[-1])

        def first(pred) -> int:  # the first window w in [0, W] with pred(w) true (pred is monotone)
            lo, hi = 0, W
            while lo < hi:
                mid = (lo + hi) // 2
                if pred(mid):
                    hi = mid
                else:
                    lo = mid + 1
            return lo

        def span(w: int) -> tuple[int, int]:
            start, length = self._windows(np.asarray([w]))
            return int(start[0]), int(length[0])

        if self.split == "train":
            lo, hi = 0, first(lambda w: sum(span(w)) + 1 > boundary)
        else:
            lo, hi = first(lambda w: span(w)[0] >= boundary), W
        if hi <= lo:
            hint = f"more documents, {_VAL_HINT}" if self.split == "val" else ""
            raise DataError(
                f"the {self.split} split of the token file holds no sequence ({W:,} windows of seq_len={T} in "
                f"{len(pairs):,} documents, {n:,} tokens, val_fraction={self.val_fraction}); use {hint}more text"
            )
        self._lo, self._hi = lo, hi
        self._offsets = np.arange(T + 1, dtype=np.int64)

    def _windows(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first token, number of targets) of document windows ``w``."""
        d = np.searchsorted(self._cum, w, side="right") - 1
        k = w - self._cum[d]
        start = self._bounds[d] + k * self.seq_len
        return start, np.minimum(self.seq_len, self._pairs[d] - k * self.seq_len)

    @property
    def n_tokens(self) -> int:
        """Tokens in this sampler's split."""
        lo, hi = self.bounds
        return hi - lo

    @property
    def n_windows(self) -> int:
        """Distinct sequences the split can yield (stream: distinct start positions)."""
        return self._hi - self._lo if self.mode == "documents" else self._hi - self._lo - self.seq_len

    @property
    def bounds(self) -> tuple[int, int]:
        """The split's half-open token range [start, end) in the whole array."""
        if self.mode == "stream":
            return self._lo, self._hi
        (s0,), _ = self._windows(np.asarray([self._lo]))
        (s1,), (n1,) = self._windows(np.asarray([self._hi - 1]))
        return int(s0), int(s1 + n1 + 1)

    def _draw(self, rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) int64 (size, seq_len) of random windows, masked targets ignored."""
        T = self.seq_len
        if self.mode == "stream":
            # high is exclusive: the last start leaves room for seq_len + 1 tokens before the split end.
            starts = rng.integers(self._lo, self._hi - T, size=size, dtype=np.int64)
            idx = starts[:, None] + self._offsets
            win = self._tokens[idx].astype(np.int64)  # (B, T+1)
            x, y = win[:, :-1], win[:, 1:].copy()
            valid = np.ones((size, T), dtype=bool)
        else:
            starts, lengths = self._windows(rng.integers(self._lo, self._hi, size=size, dtype=np.int64))
            # past a window's end, read its last target again (in the document), then overwrite
            idx = starts[:, None] + np.minimum(self._offsets, lengths[:, None])
            win = self._tokens[idx].astype(np.int64)
            valid = self._offsets[None, :T] < lengths[:, None]
            x = np.where(valid, win[:, :-1], self._pad)
            y = win[:, 1:].copy()
        if self._mask is not None:
            valid &= self._mask[idx[:, 1:]] != 0
        y[~valid] = IGNORE_INDEX
        return x, y

    def batch(self, cursor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``cursor``: (inputs, targets), int64, (batch_size, seq_len), targets shifted by one
        (``IGNORE_INDEX`` where a document's padding or the loss mask leaves no target)."""
        if isinstance(cursor, bool) or not isinstance(cursor, (int, np.integer)) or cursor < 0:
            raise DataError(f"cursor must be a non-negative integer, got {cursor!r}")
        rng = np.random.default_rng([self.seed, int(cursor), SPLITS[self.split]])
        x, y = self._draw(rng, self.batch_size)
        if self._mask is not None:
            for _ in range(_REDRAWS):
                empty = np.flatnonzero((y == IGNORE_INDEX).all(axis=1))
                if not empty.size:
                    break
                # several candidates per missing row, so a sparse mask still fills the batch
                cx, cy = self._draw(rng, max(8 * empty.size, 64))
                ok = np.flatnonzero((cy != IGNORE_INDEX).any(axis=1))[: empty.size]
                x[empty[: ok.size]], y[empty[: ok.size]] = cx[ok], cy[ok]
            else:
                raise DataError(f"the {self.split} split's loss mask leaves almost no window with a target "
                                f"(seq_len={self.seq_len}); check the SFT data (are the responses empty?)")
        top = max(int(x.max()), int(y.max())) if x.size else -1
        if self._vocab is not None and top >= self._vocab:
            # the header vouched for every id (max_token_id, else its vocabulary; the model's was
            # checked against it): a larger one here is damage to the file since it was written
            raise DataError(f"token file {self._path} holds id {top} (batch {cursor}), beyond the ids its header states "
                            f"(below {self._vocab}): the file was damaged since it was written; re-run `mtc prepare` to "
                            "write it again")
        return torch.from_numpy(x).contiguous(), torch.from_numpy(y).contiguous()

    def __repr__(self) -> str:
        return (f"BatchSampler(split={self.split!r}, mode={self.mode!r}, range=[{self._lo}, {self._hi}), "
                f"batch_size={self.batch_size}, seq_len={self.seq_len}, seed={self.seed})")
