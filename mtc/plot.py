"""`mtc plot`: a run's loss, validation loss, learning rate and throughput against step, as one PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

from mtc.errors import MTCError

__all__ = ["PlotError", "plot_run", "read_metrics"]


class PlotError(MTCError):
    """A run has nothing to plot, or the picture cannot be written."""


def read_metrics(store_dir: str | Path) -> list[dict]:
    """The step records of ``RUN/logs/metrics.jsonl``, oldest first; a resumed step keeps its latest record."""
    f = Path(store_dir) / "logs" / "metrics.jsonl"
    if not f.is_file():
        raise PlotError(f"{f} does not exist; is {store_dir} a run's store directory (`mtc train --store`)?")
    by_step: dict[int, dict] = {}
    for line in f.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            by_step[rec["step"]] = rec  # steps redone after a resume from an earlier commit: the last run's
    if not by_step:
        raise PlotError(f"{f} holds no step records yet; train some steps first")
    return [by_step[s] for s in sorted(by_step)]


def plot_run(store_dir: str | Path, output: str | Path) -> Path:
    """Draw loss and val loss, lr, and tokens/s (with TFLOP/s) against step into ``output`` (PNG, or
    the format its suffix names: .pdf, .svg, ...)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    # a skipped step's non-finite loss is null in the log: a gap in the line
    recs = [dict(r, loss=math.nan if r.get("loss") is None else r["loss"]) for r in read_metrics(store_dir)]
    steps = [r["step"] for r in recs]
    fig, (ax_loss, ax_lr, ax_tp) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in recs], label="train loss", lw=1)
    val = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    if val:
        ax_loss.plot(*zip(*val), "o-", label="val loss", ms=3)
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_loss.set_title(f"mtc run {Path(store_dir).resolve().name}")
    ax_lr.plot(steps, [r["lr"] for r in recs], color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_tp.plot(steps, [r["tokens_per_s"] for r in recs], color="tab:purple", lw=1)
    ax_tp.set_ylabel("tokens/s")
    if any(r.get("tflops") for r in recs):
        tw = ax_tp.twinx()
        tw.plot(steps, [r.get("tflops", 0.0) for r in recs], color="tab:orange", lw=1, alpha=0.7)
        tw.set_ylabel("model TFLOP/s", color="tab:orange")
    ax_tp.set_xlabel("step")
    for ax in (ax_loss, ax_lr, ax_tp):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(output)
    # the file's suffix names the format where matplotlib writes it (run.pdf, run.svg); PNG otherwise
    # (a PNG was written under any name: run.pdf held PNG bytes)
    fmt = out.suffix[1:].lower()
    fmt = fmt if fmt in fig.canvas.get_supported_filetypes() else "png"
    try:
        fig.savefig(out, format=fmt, dpi=100)
    except OSError as e:
        raise PlotError(f"cannot write {out}: {e.strerror or e}; choose another -o path") from None
    finally:
        plt.close(fig)
    return out
