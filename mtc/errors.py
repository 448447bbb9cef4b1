"""mtc's error types.

Every error mtc raises on purpose is an `MTCError`, which is also a `ValueError`, so callers can
catch either. A message says what was wrong, what was received, and how to fix it; the CLI prints
it as one line and exits 2.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "BadRecordError",
    "DataError",
    "KernelInputError",
    "MTCError",
    "PlanError",
    "StoreCorruptionError",
    "StoreError",
    "StoreLockedError",
    "TraceError",
    "write_failure",
]


class MTCError(ValueError):
    """Base class of every error mtc raises deliberately."""


class ConfigError(MTCError):
    """A configuration value, preset name or config file is invalid."""


class DataError(MTCError):
    """A token file, its header or a text corpus is missing or malformed."""


class BadRecordError(DataError):
    """One record of a corpus (a JSONL line, a parquet row, a conversation) cannot be used as asked;
    `mtc prepare --skip-bad-records` skips and counts such records instead of stopping."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # (pickles with both parts, e.g. across processes)
        return type(self), (self.problem, self.fix)


class TraceError(MTCError):
    """A model could not be traced into a Program."""


class PlanError(MTCError):
    """A plan directory is missing, malformed, or does not match the store or batch."""


class StoreError(MTCError):
    """A tensor store could not be created, opened, read or written."""


class StoreLockedError(StoreError):
    """Another process (or another handle in this one) holds the store's exclusive lock."""


class StoreCorruptionError(StoreError):
    """Stored bytes failed their checksum, or store metadata is inconsistent."""


class KernelInputError(MTCError):
    """A kernel launcher received tensors of the wrong device, dtype, shape or layout."""


def write_failure(e: OSError, output: object) -> str:
    """Why writing ``output`` failed, from ``e``: its reason, and the path it failed on when that is
    not ``output`` itself (a file standing where a folder of the path should be: "File exists: afile")."""
    why = e.strerror or str(e)
    if e.filename is not None and str(e.filename) != str(output):
        why = f"{why}: {e.filename}"
    return why


class CheckpointError(MTCError):
    """A Hugging Face checkpoint cannot be imported (architecture, config, tensors), or a run cannot be exported."""
