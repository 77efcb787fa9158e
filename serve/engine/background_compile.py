"""The tail of a progressive warm-up: executables compiled on background threads while the engine serves.

``ModelRunner.warm_up`` with ``EngineConfig.warm_up == "progressive"`` compiles the executables no step can do
without and hands the rest here. One daemon thread lowers them in the given order (lowering holds the GIL, so
one thread does it) and ``threads`` daemon threads compile them (XLA compiles outside the GIL). Finished ones
wait in a queue until the thread that launches steps takes them (``take``): only that thread touches the
runner's executable tables, so a step never sees one half installed. ``stop`` starts nothing new and waits for
the lowering and compiles under way (an XLA compile cannot be interrupted, and a process that exits while one runs
on a daemon thread crashes in XLA's teardown); an ``atexit`` hook stops a compiler the process forgot, so exiting
waits for at most the compiles in flight.
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Callable, Iterable


class BackgroundCompiler:
    """Lowers and compiles ``items`` ((key, thunk returning a ``jax.stages.Lowered``), in order) with
    ``build(key, lowered) -> compiled`` on daemon threads; ``wrap`` wraps every thread's body (the runner's
    compile attribution)."""

    def __init__(self, items: Iterable[tuple[object, Callable]], build: Callable, threads: int,
                 wrap: Callable[[Callable], Callable] = lambda fn: fn):
        self._items = list(items)
        self.num_items = len(self._items)
        self.pending = {key for key, _ in self._items}  # not yet taken (``take``)
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (key, executable or the exception it raised)
        self._work: queue.Queue = queue.Queue(maxsize=max(1, threads))  # lowered, waiting for a compile thread
        self._stop = threading.Event()
        self._build = build
        self._threads = [threading.Thread(target=wrap(self._lower_all), name="kimi-jax-lower", daemon=True)]
        self._threads += [threading.Thread(target=wrap(self._compile_loop), name=f"kimi-jax-compile-{i}", daemon=True)
                          for i in range(max(1, threads))]
        for thread in self._threads:
            thread.start()
        atexit.register(self.stop)

    def _lower_all(self) -> None:
        for key, make in self._items:
            if self._stop.is_set():
                break
            try:
                self._work.put((key, make()))
            except Exception as err:  # noqa: BLE001 - reported by take(); the bucket is served by a larger one
                self._done.put((key, err))
        for _ in self._threads[1:]:
            self._work.put(None)

    def _compile_loop(self) -> None:
        while (item := self._work.get()) is not None:
            key, lowered = item
            if self._stop.is_set():
                continue
            try:
                self._done.put((key, self._build(key, lowered)))
            except Exception as err:  # noqa: BLE001 - as above
                self._done.put((key, err))

    def take(self, timeout_s: float | None = 0.0) -> list[tuple[object, object]]:
        """The (key, executable or exception) pairs finished since the last call; with ``timeout_s`` > 0 (None:
        no limit) waits up to that long for the first one while any is pending."""
        out = []
        wait = timeout_s != 0.0  # only for the first one
        while self.pending:
            try:
                key, result = self._done.get(timeout=timeout_s) if wait else self._done.get_nowait()
            except queue.Empty:
                break
            wait = False
            self.pending.discard(key)
            out.append((key, result))
        return out

    @property
    def compiling(self) -> int:
        """Executables not yet finished (pending minus those waiting to be taken)."""
        return max(0, len(self.pending) - self._done.qsize())

    def stop(self) -> None:
        """Start nothing new, wait for the lowering and compiles under way, and drop whatever is not taken yet."""
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        self.pending.clear()
        atexit.unregister(self.stop)
