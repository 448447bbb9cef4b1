"""The training progress bar, drawn by tqdm: step, loss, tokens/s, model TFLOP/s and MFU, ETA.

On a terminal it redraws in place; written to a file or a pipe (logs, CI) it prints the same line
about 20 times over a run, each on its own line (tqdm's own format, without carriage returns).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

__all__ = ["ProgressBar", "step_fields"]


def step_fields(rec: object) -> dict[str, float | str]:
    """What the bar shows of a `mtc.train.StepRecord`: loss, tok/s, TFLOP/s, MFU, val loss when measured."""
    out: dict[str, float | str] = {"loss": rec.loss, "tok/s": rec.tokens_per_s, "TFLOP/s": rec.tflops}
    mfu = getattr(rec, "mfu", None)
    out["MFU"] = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    if getattr(rec, "val_loss", None) is not None:
        out["val"] = rec.val_loss
    return out


class ProgressBar:
    """``update(step, **fields)`` after each step; ``close()`` ends the line (idempotent)."""

    def __init__(self, total: int, *, initial: int = 0, stream: TextIO | None = None, desc: str = "train") -> None:
        self.total, self.initial = max(1, total), initial
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.desc = desc
        self._start = time.perf_counter()
        self._last_line = -1
        self._bar: tqdm | None = None
        if self.tty:
            self._bar = tqdm(total=self.total, initial=initial, file=self.stream, desc=desc, unit="step",
                             dynamic_ncols=True, leave=True, smoothing=0.1)

    @staticmethod
    def _postfix(fields: dict[str, float | str]) -> str:
        return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())

    def update(self, step: int, **fields: float | str) -> None:
        """Show progress at ``step`` (completed steps) with the given figures."""
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(fields), refresh=False)
            self._bar.update(step - self._bar.n)
            if step >= self.total:
                self.close()
            return
        tick = step * 20 // self.total
        if step >= self.total or step == self.initial + 1 or tick != self._last_line:
            self._last_line = tick
            elapsed = time.perf_counter() - self._start
            # tqdm's ETA from the rate of this process's own steps (a resumed run starts at `initial`)
            rate = (step - self.initial) / elapsed if elapsed > 0 else None
            line = tqdm.format_meter(step, self.total, elapsed, prefix=self.desc, unit="step", rate=rate,
                                     postfix=self._postfix(fields), ncols=120, initial=self.initial, ascii=True)
            self.stream.write(line + "\n")
            self.stream.flush()

    def write(self, message: str) -> None:
        """Print a line above the bar (on a terminal the bar is redrawn below it)."""
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            self.stream.write(message + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the in-place line (if a run stopped before its last step left it open)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
