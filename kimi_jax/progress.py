"""A dependency-free text progress bar for long start-up phases (weight loading, warm-up compilation).

Call it as ``bar(done, total)``: on a terminal it redraws one line in place; on a pipe or log file it writes a
line at 0, 25, 50, 75 and 100 % so that logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``ProgressBar("loading weights", unit="tensors")(done, total)``; prints the elapsed time when done."""

    def __init__(self, label: str, *, unit: str = "", stream: TextIO | None = None, width: int = 28,
                 prefix: str = "[kimi-jax] "):
        self.label, self.unit, self.width, self.prefix = label, unit, width, prefix
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self._last_quarter = -1

    def __call__(self, done: int, total: int) -> None:
        total = max(total, 1)
        done = min(max(done, 0), total)
        filled = self.width * done // total
        elapsed = time.perf_counter() - self.start
        unit = f" {self.unit}" if self.unit else ""
        line = (f"{self.prefix}{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}{unit} "
                f"{elapsed:.1f}s")
        interactive = getattr(self.stream, "isatty", lambda: False)()
        if interactive:
            self.stream.write("\r" + line + ("\n" if done == total else ""))
        else:
            quarter = 4 * done // total
            if quarter == self._last_quarter:
                return
            self._last_quarter = quarter
            self.stream.write(line + "\n")
        self.stream.flush()
