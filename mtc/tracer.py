"""The public tracing entry point; the tracer itself is `mtc.graphs.trace` (split into named steps)."""

from __future__ import annotations

from mtc.graphs.export import LossModel
from mtc.graphs.trace import find_blocks, trace

__all__ = ["LossModel", "find_blocks", "trace"]
