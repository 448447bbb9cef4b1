"""A small terminal progress bar for training steps (no dependency, degrades to lines in logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``step/total |#####     | loss ... | s/step``; redraws in place on a TTY, else prints ~20 lines."""

    def __init__(self, total: int, *, initial: int = 0, width: int = 30, stream: TextIO | None = None) -> None:
        self.total, self.width = max(1, total), width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.start, self.initial = time.perf_counter(), initial
        self._last_line_step = -1
        self._ended = False

    def update(self, step: int, **fields: float) -> None:
        """Show progress at ``step`` with the given named figures (e.g. loss=2.3)."""
        done = step - self.initial
        rate = (time.perf_counter() - self.start) / max(1, done)
        filled = int(self.width * step / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        figs = "  ".join(f"{k} {v:.4g}" for k, v in fields.items())
        line = f"step {step:>{len(str(self.total))}}/{self.total} |{bar}| {figs}  {rate:.2f} s/step"
        if self.tty:
            self.stream.write("\r" + line)
            self._ended = step >= self.total
            if self._ended:
                self.stream.write("\n")
        elif step >= self.total or step == self.initial + 1 or step * 20 // self.total != self._last_line_step:
            self.stream.write(line + "\n")
            self._last_line_step = step * 20 // self.total
        self.stream.flush()

    def close(self) -> None:
        """End the in-place line (if a run stopped before its last step left it open)."""
        if self.tty and not self._ended:
            self.stream.write("\n")
            self.stream.flush()
