"""An optional TensorBoard sink for step records (`mtc train --tensorboard DIR`)."""

from __future__ import annotations

from pathlib import Path

from mtc.errors import ConfigError

__all__ = ["TensorBoardSink", "check_log_dir"]


def _summary_writer() -> type:
    try:
        import tensorboard  # noqa: F401  (torch's writer imports it lazily; fail here, in one line)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter


def check_log_dir(log_dir: str | Path) -> None:
    """Raise ConfigError unless a `TensorBoardSink` can write into ``log_dir``: the tensorboard
    package is missing, or ``log_dir`` (or a folder above it) is a file. `mtc train` asks before
    it creates the store, so a bad --tensorboard leaves nothing behind."""
    from mtc.store.directory import file_in_the_way

    _summary_writer()
    f = file_in_the_way(log_dir)
    if f is not None:
        where = "it is a file" if f == Path(log_dir) else f"{f}, a parent of it, is a file"
        raise ConfigError(f"--tensorboard {log_dir}: {where}, not a directory; give a directory for the event files")


class TensorBoardSink:
    """Writes each step's scalars as TensorBoard events under ``log_dir`` (needs the tensorboard package)."""

    def __init__(self, log_dir: str | Path, *, start_step: int = 0) -> None:
        """``start_step``: the step this run starts from (its last commit; records count completed
        steps, so its first is ``start_step + 1``); a resumed run redoes the steps after that
        commit, so the events an interrupted run logged for them are dropped (not doubled)."""
        check_log_dir(log_dir)
        writer = _summary_writer()
        try:
            self.writer = writer(log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None)
        except OSError as e:  # (permissions, a full disk: the path itself was checked above)
            raise ConfigError(f"--tensorboard {log_dir}: cannot write event files there ({e.strerror or e}); "
                              "give another directory") from None

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
