"""AsyncEngine: the LLMEngine loop on a background thread, behind the asyncio interface the HTTP server uses.

The engine thread owns the LLMEngine: it drains the commands posted by coroutines (add, abort), runs
``step()`` while there is work (sleeping on an event otherwise) and hands each RequestOutput to the event loop
of the coroutine that asked for it (``call_soon_threadsafe`` into a per-request asyncio.Queue). JAX work and
output processing therefore never block the event loop, and a slow client never stalls the batch.

Admission control bounds the queue in front of the scheduler: sequences (a request of n completions counts n)
and their tokens waiting for admission, counted exactly across the two threads (requests posted but not yet
handed to the engine, plus the scheduler's waiting queue as of its last step). A request that would take the
queue past ``max_waiting_requests`` or ``max_waiting_tokens`` is refused at once (``EngineOverloadedError``),
so memory stays bounded under any load; the token bound never refuses a request into an empty queue, so every
valid request can be served when the server is idle.

A request the engine failed (a failed step, non-finite logits, broken output processing: ``RequestOutput.error``)
raises ``RequestFailedError`` from its stream; other requests are unaffected.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Sequence

from serve.engine.engine import LLMEngine
from serve.engine.outputs import EngineStats, RequestOutput
from serve.engine.sampling_params import SamplingParams


DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_WAITING_TOKENS = 1 << 21
RETRY_AFTER_S = 1  # what a refused client is told to wait before retrying


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an exception outside a step, or shutdown); no request can make progress."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """The engine failed this request (``RequestOutput.error``, a message meant for the client)."""


class AsyncEngine:
    """Shared interface: ``generate``, ``abort``, ``stats``, ``tokenizer``, ``model_config``, ``max_model_len``.

    Args:
      engine: the LLMEngine to drive (only the engine thread touches it after construction).
      idle_wait_s: longest sleep of an idle loop before it looks for commands again.
      max_waiting_requests: most sequences waiting for admission (see the module docstring).
      max_waiting_tokens: most tokens of waiting sequences (a lone request may exceed it).
    """

    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.1,
                 max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                 max_waiting_tokens: int = DEFAULT_MAX_WAITING_TOKENS):
        if max_waiting_requests < 1 or max_waiting_tokens < 1:
            raise ValueError(f"max_waiting_requests ({max_waiting_requests}) and max_waiting_tokens "
                             f"({max_waiting_tokens}) must be >= 1")
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self._pending: dict[str, tuple[int, int]] = {}  # posted adds not yet in the engine: (sequences, tokens)
        self._pending_load = (0, 0)  # their sums
        self._engine_waiting = (0, 0)  # the scheduler's waiting queue as of the engine thread's last look
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self.vision_config = getattr(engine, "vision_config", None)
        self.media_rows = getattr(engine, "media_rows", 0)
        self._idle_wait_s = idle_wait_s
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kimi-jax-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model, **kwargs) -> "AsyncEngine":
        """``LLMEngine.from_pretrained(model, **kwargs)`` driven by a new AsyncEngine."""
        return cls(LLMEngine.from_pretrained(model, **kwargs))

    # ---- coroutine side ----
    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str, *,
                       media: Sequence = ()) -> AsyncIterator[RequestOutput]:
        """Outputs of one request (cumulative), one per engine step that changed it; the last has
        ``finished=True``. Leaving the iteration early aborts the request. Bad requests raise ValueError.
        ``media``: the prompt's images (``media.ImageSpan``s)."""
        self._check_alive()
        self.engine.validate_request(prompt_token_ids, params)
        queue: asyncio.Queue = asyncio.Queue()
        load = (params.n, len(prompt_token_ids))
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._refuse_if_full(*load)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._pending[request_id] = load
            self._pending_load = _plus(self._pending_load, load)
        self._post(("add", request_id, list(prompt_token_ids), params, time.monotonic(), tuple(media)))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
        finally:
            if not finished:
                self._post(("abort", request_id))
            with self._lock:
                self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """End a request; its stream yields a last output with finish_reason "abort"."""
        self._post(("abort", request_id))

    def abort_all(self) -> None:
        """End every open stream (each yields a last output with finish_reason "abort"); for shutdown."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._post(("abort", request_id))

    def check_admission(self, num_prompt_tokens: int, n: int = 1) -> None:
        """Raise EngineOverloadedError if a request of ``n`` sequences and this prompt would be refused now (the
        server asks before it starts a stream, so a refusal is an HTTP status, not an in-band error)."""
        with self._lock:
            self._refuse_if_full(n, num_prompt_tokens)

    @property
    def num_open_streams(self) -> int:
        """Requests whose stream has not ended."""
        with self._lock:
            return len(self._streams)

    @property
    def is_alive(self) -> bool:
        """The engine loop runs and accepts requests."""
        return self._error is None and not self._stopping and self._thread.is_alive()

    def _refuse_if_full(self, seqs: int, tokens: int) -> None:
        """(Holding the lock.) The admission rule of the module docstring."""
        waiting, waiting_tokens = _plus(self._engine_waiting, self._pending_load)
        if waiting + seqs > self.max_waiting_requests:
            raise EngineOverloadedError(f"The server is overloaded: {waiting} sequences are waiting (at most "
                                        f"{self.max_waiting_requests}). Retry after {RETRY_AFTER_S} s.")
        if waiting and waiting_tokens + tokens > self.max_waiting_tokens:
            raise EngineOverloadedError(f"The server is overloaded: {waiting_tokens} prompt tokens are waiting (at "
                                        f"most {self.max_waiting_tokens}). Retry after {RETRY_AFTER_S} s.")

    def stats(self) -> EngineStats:
        """The counters as of the last engine step (safe from any thread)."""
        return self._stats

    def shutdown(self) -> None:
        """Stop the engine thread; open streams raise EngineDeadError."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._fail(EngineDeadError("the engine was shut down"))

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _post(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError("the engine loop has stopped") from self._error
        if self._stopping:
            raise EngineDeadError("the engine was shut down")

    # ---- engine thread ----
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_commands()
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    waiting = engine.waiting_load()
                    with self._lock:
                        self._engine_waiting = waiting
                    self._stats = engine.stats()
                    for output in outputs:
                        self._deliver(output.request_id, output)
                else:
                    engine.idle()
                    self._stats = engine.stats()
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # the loop cannot continue: fail every stream rather than hang them
            self._fail(e)

    def _drain_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "add":
                _, request_id, prompt, params, arrival, media = command
                try:
                    self.engine.add_request(request_id, prompt, params, arrival_time=arrival,
                                            **({"media": media} if media else {}))
                except ValueError as e:
                    self._deliver(request_id, e)
                    self._unpend(request_id, admitted=False)
                else:  # now in the scheduler's waiting queue, until its next step says otherwise
                    self._unpend(request_id, admitted=True)
            else:
                self.engine.abort_request(command[1])

    def _unpend(self, request_id: str, *, admitted: bool) -> None:
        with self._lock:
            load = self._pending.pop(request_id, (0, 0))
            self._pending_load = _plus(self._pending_load, load, -1)
            if admitted:
                self._engine_waiting = _plus(self._engine_waiting, load)

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed
            pass

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, _dead(error))


def _plus(a: tuple[int, int], b: tuple[int, int], sign: int = 1) -> tuple[int, int]:
    return a[0] + sign * b[0], a[1] + sign * b[1]


def _dead(error: BaseException) -> EngineDeadError:
    if isinstance(error, EngineDeadError):
        return error
    dead = EngineDeadError(f"the engine loop stopped: {error!r}")
    dead.__cause__ = error
    return dead
