"""Start-up progress bars (weight loading, warm-up compilation) as ``(done, total)`` callbacks, drawn by tqdm."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


class ProgressBar:
    """``ProgressBar("loading weights", unit="parameters")(done, total)``: a tqdm bar on stderr, closed at the end."""

    def __init__(self, label: str, *, unit: str = "it", stream: TextIO | None = None):
        self.label, self.unit = label, unit
        self.stream = stream if stream is not None else sys.stderr
        self._bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = tqdm(total=total, desc=f"[kimi-jax] {self.label}", unit=f" {self.unit}", file=self.stream,
                             dynamic_ncols=True, mininterval=0.5, leave=True)
        self._bar.total = total
        self._bar.update(max(0, min(done, total) - self._bar.n))
        if done >= total:
            self._bar.close()
