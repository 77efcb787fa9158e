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
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
from fastapi import Request
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from serve.openai.errors import APIError, internal_server_error

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


async def generate_or_abort(engine, prompt_token_ids: list[int], params, request_id: str, *, media=()
                            ) -> AsyncIterator[Any]:
    """`engine.generate(...)`, calling `engine.abort(request_id)` if the consumer stops before the last output
    (client disconnect, task cancellation, an exception in the handler). `media`: the prompt's images."""
    finished = False
    try:
        async for output in engine.generate(prompt_token_ids, params, request_id, **({"media": media} if media
                                                                                        else {})):
            finished = output.finished
            yield output
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                await engine.abort(request_id)


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
