"""Graceful shutdown: the first SIGTERM (or SIGINT) drains instead of exiting.

Draining: `/health` answers 503 (a load balancer stops routing here) and new generation requests get a 503 with
Retry-After, while open streams run on; once none is left, or ``timeout_s`` has passed (then every open stream
is aborted, which ends it with a clean final chunk, finish_reason "abort", and `[DONE]`), uvicorn exits. A second
signal exits at once.
"""

from __future__ import annotations

import threading
import time

import uvicorn

ABORT_GRACE_S = 5.0  # after abort_all, how long aborted streams get to send their final chunk


class DrainingServer(uvicorn.Server):
    """A uvicorn server over an app from `build_app` (its ``state.draining`` flag) and its engine."""

    def __init__(self, config: uvicorn.Config, engine, *, timeout_s: float):
        if not timeout_s >= 0:
            raise ValueError(f"shutdown timeout must be >= 0, got {timeout_s}")
        super().__init__(config)
        self._engine = engine
        self._timeout_s = timeout_s
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drainer is not None:
            super().handle_exit(sig, frame)
            return
        self.config.app.state.draining = True
        self._drainer = threading.Thread(target=self._drain, name="drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        self._wait_streams(self._timeout_s)
        if self._engine.num_open_streams:
            self._engine.abort_all()
            self._wait_streams(ABORT_GRACE_S)
        self.should_exit = True

    def _wait_streams(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._engine.num_open_streams and time.monotonic() < deadline:
            time.sleep(0.05)
