"""DraftGate: per-request turn-down of speculation whose drafts keep being rejected.

A verification step costs more than a decode step (on the Kimi-Linear-48B layer shape at batch 1, about three
times on the device: BENCHMARKS.md), so a request whose drafts are rejected is slower speculating than not. The
gate keeps the acceptance length (tokens a verification step emitted: accepted drafts + the drawn token) of a
request's last ``WINDOW`` verification steps with drafts. When their mean falls below the floor, the request
stops drafting for a pause of ``FIRST_PAUSE`` of its steps, doubling (up to ``MAX_PAUSE``) each time a window
after a pause fails again and back to ``FIRST_PAUSE`` when one passes; after a pause it drafts again, so a
request whose text turns repetitive (code, quoting its prompt) gets speculation back.
"""

from __future__ import annotations

from collections import deque

WINDOW = 4
FIRST_PAUSE = 8
MAX_PAUSE = 256


class DraftGate:
    """One request's gate; ``floor`` 0 never pauses. ``drafting``: whether the request drafts in its next step."""

    def __init__(self, floor: float):
        self.floor = floor
        self.drafting = True
        self._lengths: deque[int] = deque(maxlen=WINDOW)
        self._pause_left = 0
        self._next_pause = FIRST_PAUSE

    def step(self) -> None:
        """Before a step the request could draft in: set ``drafting`` (a paused gate counts the step off its pause)."""
        self.drafting = self._pause_left == 0
        if not self.drafting:
            self._pause_left -= 1

    def record(self, accepted: int) -> None:
        """After a verification step that verified drafts for this request: ``accepted`` of them were kept."""
        self._lengths.append(1 + accepted)
        if len(self._lengths) < WINDOW:
            return
        if sum(self._lengths) < self.floor * WINDOW:
            self._pause_left = self._next_pause
            self._next_pause = min(2 * self._next_pause, MAX_PAUSE)
        else:
            self._next_pause = FIRST_PAUSE
        self._lengths.clear()
