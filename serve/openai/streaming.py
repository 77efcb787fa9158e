"""Engine output streams for HTTP handlers: abort on cancel or disconnect, merging, and SSE framing.

SSE framing, keep-alive pings (a `: ping` comment every 15 s, which clients skip) and client-disconnect
detection are sse-starlette's `EventSourceResponse`: on `http.disconnect` it cancels the task that iterates the
handler's event generator (thrown into the generator while it awaits the engine, or an `aclose()` when it
was cut in a send), which runs the generator's cleanup (`aclosing(outputs)` -> `generate_or_abort` ->
`engine.abort`), and the engine frees the request's cache. Events are `data: JSON` lines with `\n`
separators (as vLLM sends them), the stream ends with `data: [DONE]`, and an error after the status line is
an in-band error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
from fastapi import Request
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from serve.engine.async_engine import EngineDeadError, EngineOverloadedError, RequestFailedError
from serve.openai.errors import APIError, engine_failed, internal_server_error, request_timeout, service_unavailable

logger = logging.getLogger(__name__)

SSE_SEPARATOR = "\n"
SSE_DONE = ServerSentEvent("[DONE]", sep=SSE_SEPARATOR)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"


def sse_error_event(err: Exception) -> ServerSentEvent:
    """The in-band error event of a stream whose status line is already sent (vLLM does the same).

    An `APIError` is told as it is; any other exception only as "Internal server error" (logged here).
    """
    if not isinstance(err, APIError):
        logger.error("error in a stream", exc_info=err)
        err = internal_server_error()
    return sse_event(err.body())


def sse_event(payload: BaseModel | dict) -> ServerSentEvent:
    """One server-sent event carrying `payload` as JSON (None fields of models left out)."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_none=True)
    else:
        data = json.dumps(payload, ensure_ascii=False)
    return ServerSentEvent(data, sep=SSE_SEPARATOR)


@dataclasses.dataclass(frozen=True)
class Deadline:
    """When a request must have finished: ``at`` on the event loop's clock, ``timeout_s`` after its arrival;
    ``param`` "timeout" when the client's own `timeout` set it (else the server's --request-timeout did)."""

    at: float
    timeout_s: float
    param: str | None

    @classmethod
    def of(cls, requested_s: float | None, server_s: float | None) -> "Deadline | None":
        """The tighter of the request's `timeout` and the server's, from now; None when neither is set."""
        if requested_s is None and server_s is None:
            return None
        by_client = server_s is None or (requested_s is not None and requested_s <= server_s)
        timeout_s = requested_s if by_client else server_s
        return cls(asyncio.get_running_loop().time() + timeout_s, timeout_s, "timeout" if by_client else None)

    def remaining(self) -> float:
        return max(0.0, self.at - asyncio.get_running_loop().time())


def engine_error(err: Exception) -> APIError | None:
    """The API error an engine exception is answered with (None: not an engine condition, i.e. a bug)."""
    if isinstance(err, RequestFailedError):
        return engine_failed(str(err))
    if isinstance(err, EngineOverloadedError):
        return service_unavailable(str(err), retry_after_s=err.retry_after_s, code="server_overloaded")
    if isinstance(err, EngineDeadError):
        return service_unavailable("The engine has stopped; this server cannot serve requests.", retry_after_s=5,
                                   code="engine_stopped")
    return None


def check_admission(engine, num_prompt_tokens: int, n: int) -> None:
    """Refuse (a 503 with Retry-After) a request the engine's waiting queue has no room for, before a stream
    starts; a request admitted here may still be refused in its first output if others took the room first."""
    try:
        engine.check_admission(num_prompt_tokens, n)
    except (EngineOverloadedError, EngineDeadError) as err:
        raise engine_error(err) from err


async def generate_or_abort(engine, prompt_token_ids: list[int], params, request_id: str,
                            deadline: Deadline | None = None, *, media=()) -> AsyncIterator[Any]:
    """`engine.generate(...)`, calling `engine.abort(request_id)` if the consumer stops before the last output
    (client disconnect, task cancellation, an exception in the handler) or the deadline passes (then a 408
    `APIError` is raised). Engine conditions become `APIError`s (`engine_error`). `media`: the prompt's images."""
    finished = False
    outputs = engine.generate(prompt_token_ids, params, request_id, **({"media": media} if media else {}))
    try:
        while not finished:
            try:
                if deadline is None:
                    output = await anext(outputs)
                else:  # on timeout the pending anext is cancelled, which closes the engine stream
                    output = await asyncio.wait_for(anext(outputs), deadline.remaining())
            except StopAsyncIteration:
                return
            except TimeoutError as err:
                raise request_timeout(deadline.timeout_s, param=deadline.param) from err
            except (RequestFailedError, EngineOverloadedError, EngineDeadError) as err:
                raise engine_error(err) from err
            finished = output.finished
            yield output
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                await engine.abort(request_id)
                await outputs.aclose()


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as `(stream index, item)`, in arrival order.

    If the consumer stops early, every stream is closed (so each aborts its engine request).
    """
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await _close_all(streams)
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, done))
        except BaseException as exc:  # forwarded to the consumer
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            await _close_all(streams)


async def _close_all(streams: list[AsyncIterator[Any]]) -> None:
    with anyio.CancelScope(shield=True):
        for stream in streams:
            await stream.aclose()


class SSEResponse(EventSourceResponse):
    """`text/event-stream` response of `sse_event`s (see the module docstring)."""

    def __init__(self, content: AsyncIterator[ServerSentEvent]):
        super().__init__(content, sep=SSE_SEPARATOR, headers={"Cache-Control": "no-cache"})


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work` (a non-streaming handler) but cancel it if the client disconnects first.

    Returns `work`'s result, or None when the client is gone (nobody is left to answer).
    """
    work_task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch_task = asyncio.create_task(wait_disconnect())
    try:
        await asyncio.wait([work_task, watch_task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    return work_task.result() if not work_task.cancelled() else None
