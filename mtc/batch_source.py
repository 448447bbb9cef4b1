"""Training data from Python: any iterable (or sequence) of ``(ids, targets)`` micro-batches.

Each item is one micro-batch at the traced shape: two integer tensors (or arrays) of shape
``(micro_batch_size, seq_len)``; a step takes ``grad_accum`` items. They are read on the host
(checked, then staged in pinned memory by the loader thread): give CPU tensors, as a GPU tensor
is copied back to the host first. The run's data cursor counts
the items its committed steps consumed, and resuming follows one rule:

- a **sequence** (``__getitem__`` and ``__len__``, e.g. a list) is indexed: batch ``k`` is
  ``data[k]``, so a resume reads exactly where the last commit stopped;
- any other **iterable** is iterated from its start and the first ``cursor`` items are drawn and
  dropped: pass the same batches from the beginning (e.g. call your generator function again).
  Items the loader had read ahead of the last commit are not counted as consumed.

mtc cannot hash an iterable, so a resume does not check that it is the same data (a token file's
identity is checked); a change between a token file and batches from Python needs
``--allow-change data`` as any other change of data does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from mtc.errors import DataError

__all__ = ["BatchSource"]


class BatchSource:
    """Micro-batches from an iterable, addressed by cursor like `mtc.data.BatchSampler` (forward only
    for a plain iterable)."""

    def __init__(self, batches: Iterable[Any], *, name: str | None = None) -> None:
        if isinstance(batches, (str, bytes)) or not isinstance(batches, Iterable):
            raise DataError(f"data must be a token file path or an iterable of (ids, targets) batches, got {type(batches).__name__}")
        self._seq = batches if isinstance(batches, Sequence) else None
        self._src = batches
        self._it: Iterator[Any] | None = None
        self._next = 0  # cursor of the item the iterator yields next
        self._lock = threading.Lock()
        self.name = name or f"<{type(batches).__name__} of batches>"
        self.shape: tuple[int, int] | None = None
        self.vocab_size: int | None = None

    def identity(self) -> dict[str, Any]:
        """What the commit records about this data (no hash: an iterable cannot be read twice)."""
        return {"path": self.name, "kind": "python-batches", "size_bytes": None, "header": None, "hash": None,
                "hash_kind": None}

    def check_vocab(self, vocab_size: int) -> None:
        """Remember the model's vocabulary: every batch drawn is checked against it."""
        self.vocab_size = vocab_size

    def check_length(self, cursor: int, steps: int, per_step: int) -> None:
        """DataError now, before any step runs, when a sequence is too short for ``steps`` steps of
        ``per_step`` batches from batch ``cursor`` (a plain iterable's length is not known ahead)."""
        if self._seq is None:
            return
        need = cursor + steps * per_step
        if len(self._seq) < need:
            start = f" from batch {cursor} (where the last commit stopped)" if cursor else ""
            raise DataError(f"the data sequence has {len(self._seq)} batches; {steps} steps of {per_step} batches"
                            f"{start} need {need}: give more batches or train fewer steps")

    def sampler(self, batch_size: int, seq_len: int) -> BatchSource:
        """This source, expecting micro-batches of (batch_size, seq_len)."""
        self.shape = (batch_size, seq_len)
        return self

    def batch(self, cursor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch number ``cursor`` (int64 ids and targets), checked against shape and vocabulary."""
        with self._lock:
            item = self._item(cursor)
        return self._check(item, cursor)

    def _item(self, cursor: int) -> Any:
        if self._seq is not None:
            if cursor >= len(self._seq):
                raise DataError(f"the data sequence has {len(self._seq)} batches; the run needs batch {cursor + 1}: "
                                "give more batches or train fewer steps")
            return self._seq[cursor]
        if self._it is None or cursor < self._next:
            if self._it is not None:
                raise DataError(f"batch {cursor} was already drawn from the data iterator; pass a fresh iterable")
            self._it = iter(self._src)
        try:
            while self._next < cursor:  # resume: drop what committed steps consumed
                next(self._it)
                self._next += 1
            item = next(self._it)
        except StopIteration:
            raise DataError(f"the data iterable ended after {self._next} batches; the run needs batch {cursor + 1}: "
                            "give more batches or train fewer steps") from None
        self._next += 1
        return item

    def _check(self, item: Any, cursor: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise DataError(f"data batch {cursor} is a {type(item).__name__}; each item must be a pair (ids, targets)")
        out = []
        for what, x in zip(("ids", "targets"), item):
            # checked and staged on the host (the loader thread pins them for the copy to the device):
            # a batch on the GPU comes back once here, rather than syncing the device check by check
            a = None if isinstance(x, torch.Tensor) else np.asarray(x)
            # (a read-only array, e.g. a slice of a token file's memmap, is copied: torch warns of those)
            t = x.cpu() if a is None else torch.as_tensor(a if a.flags.writeable else a.copy())
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise DataError(f"data batch {cursor}: {what} have dtype {t.dtype}; token ids must be integers")
            t = t.to(torch.int64)  # (the range checks below: torch has no min/max of uint16 or uint32 tensors)
            if self.shape is not None and tuple(t.shape) != self.shape:
                raise DataError(f"data batch {cursor}: {what} have shape {tuple(t.shape)}, the model was traced for "
                                f"{self.shape} (micro_batch_size, seq_len); batch the data to that shape")
            # a target of -100 is ignored by the loss (cross-entropy's ignore_index): masked positions
            ids = t[t != -100] if what == "targets" else t
            if self.vocab_size is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
                raise DataError(f"data batch {cursor}: {what} hold ids outside 0-{self.vocab_size - 1} (the model's "
                                f"vocabulary): min {int(ids.min())}, max {int(ids.max())}")
            out.append(t.contiguous())
        return out[0], out[1]

    def __repr__(self) -> str:
        return f"BatchSource({self.name}, next={self._next})"
