"""An optional TensorBoard sink for step records (`mtc train --tensorboard DIR`)."""

from __future__ import annotations

from pathlib import Path

from mtc.errors import ConfigError

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Writes each step's scalars as TensorBoard events under ``log_dir`` (needs the tensorboard package)."""

    def __init__(self, log_dir: str | Path, *, start_step: int = 0) -> None:
        """``start_step``: the step this run starts from (its last commit; records count completed
        steps, so its first is ``start_step + 1``); a resumed run redoes the steps after that
        commit, so the events an interrupted run logged for them are dropped (not doubled)."""
        try:
            import tensorboard  # noqa: F401  (torch's writer imports it lazily; fail here, in one line)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None)

    def write(self, rec: object) -> None:
        """Add one `mtc.train.StepRecord` (loss, val loss, lr, grad norm, throughput, memory, phases)."""
        s = rec.step
        w = self.writer
        for name in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "val_loss", "gpu_peak_bytes", "host_rss_bytes"):
            v = getattr(rec, name, None)
            if v is not None:
                w.add_scalar(f"train/{name}" if name != "val_loss" else "val/loss", float(v), s)
        for stage, secs in (getattr(rec, "phase_s", None) or {}).items():
            w.add_scalar(f"phase_s/{stage}", secs, s)
        w.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
