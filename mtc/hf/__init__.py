"""Hugging Face checkpoints in and out: `import_hf` (a checkpoint into a new store) and `export_hf`
(a run's weights as a checkpoint), both streamed one tensor at a time. Needs no transformers."""

from __future__ import annotations

from mtc.hf.arch import ARCHITECTURES
from mtc.hf.exporter import ExportResult, export_hf
from mtc.hf.importer import ImportResult, import_hf

__all__ = ["ARCHITECTURES", "ExportResult", "ImportResult", "export_hf", "import_hf"]
