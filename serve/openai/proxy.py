"""`kimi-jax serve --role proxy`: one OpenAI endpoint in front of prefill and decode replicas.

For `POST /v1/completions` and `/v1/chat/completions` (as vLLM's disaggregation proxy does):
1. the body, with `max_tokens` 1, `n` 1 and no streaming, goes to a prefill replica with a fresh
   `X-KV-Transfer-Id`: it computes the prompt and stages its pages + KDA checkpoint under that id. A response
   other than 200 (a bad request, say) is the client's answer as it is;
2. the original body goes to a decode replica with the same id and `X-KV-Transfer-Source` (the prefill URL): it
   pulls the staged entries, resumes from them and generates; its answer (JSON, or the SSE stream chunk by
   chunk) is the client's.
Replicas are taken round-robin. Failures never hang the client: connect and read timeouts bound every call, a
replica that cannot be reached is a 502 with an OpenAI-style body, and a decode stream that breaks (the replica
died) or ends before `data: [DONE]` gets an in-band error event and `[DONE]`; the prefill replica is then told
to drop the export (`DELETE /kv_transfer/<id>`), which its timeout would otherwise do.
"""

from __future__ import annotations

import itertools
import json
import logging
from http import HTTPStatus

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.openai.app import json_object_body
from serve.openai.disagg import TRANSFER_ID_HEADER, TRANSFER_SOURCE_HEADER, new_transfer_id
from serve.openai.errors import APIError, internal_server_error

logger = logging.getLogger(__name__)

TIMEOUT = httpx.Timeout(600.0, connect=10.0)
"""Per call: 10 s to connect, 600 s for any read (a long prompt's prefill on a CPU replica)."""
_DONE = b"data: [DONE]"


def upstream_error(kind: str, url: str, err: Exception) -> APIError:
    logger.warning("%s replica %s failed: %r", kind, url, err)
    return APIError(f"The {kind} replica did not answer.", status=HTTPStatus.BAD_GATEWAY, type="server_error",
                    code="upstream_unavailable")


def _event(payload: dict | str) -> bytes:
    return b"data: " + (payload if isinstance(payload, str) else json.dumps(payload)).encode() + b"\n\n"


class Proxy:
    """Round-robin over the replicas; ``relay`` serves one request (see the module docstring)."""

    def __init__(self, prefill: list[str], decode: list[str], *, timeout: httpx.Timeout = TIMEOUT):
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self.decode_urls = decode
        self._timeout = timeout
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        return self._client

    async def relay(self, path: str, request: Request) -> Response:
        body = json_object_body(await request.body())
        prefill, decode = next(self._prefill), next(self._decode)
        transfer_id = new_transfer_id()
        auth = {"authorization": request.headers["authorization"]} if "authorization" in request.headers else {}
        first = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
        first.update(max_tokens=1, n=1, stream=False)
        try:
            answer = await self.client.post(prefill + path, json=first, headers={**auth, TRANSFER_ID_HEADER:
                                                                                transfer_id})
        except httpx.HTTPError as err:
            raise upstream_error("prefill", prefill, err) from err
        if answer.status_code != HTTPStatus.OK:
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
        headers = {**auth, TRANSFER_ID_HEADER: transfer_id, TRANSFER_SOURCE_HEADER: prefill}
        upstream = self.client.build_request("POST", decode + path, json=body, headers=headers)
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as err:
            await self._release(prefill, transfer_id)
            raise upstream_error("decode", decode, err) from err
        if response.status_code != HTTPStatus.OK or not body.get("stream"):
            try:
                content = await response.aread()
            except httpx.HTTPError as err:
                await self._release(prefill, transfer_id)
                raise upstream_error("decode", decode, err) from err
            finally:
                await response.aclose()
            return Response(content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))
        return StreamingResponse(self._stream(response, prefill, decode, transfer_id), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def _stream(self, response: httpx.Response, prefill: str, decode: str, transfer_id: str):
        """The decode replica's SSE bytes as they come; an in-band error event if the stream breaks."""
        tail, done = b"", False
        try:
            async for chunk in response.aiter_raw():
                done = done or _DONE in tail + chunk
                tail = (tail + chunk)[-len(_DONE):]
                yield chunk
            if not done:
                raise httpx.RemoteProtocolError("the stream ended before [DONE]")
        except httpx.HTTPError as err:
            await self._release(prefill, transfer_id)
            yield _event(upstream_error("decode", decode, err).body())
            yield _event("[DONE]")
        finally:
            await response.aclose()

    async def _release(self, prefill: str, transfer_id: str) -> None:
        """Best effort: the prefill replica drops the export (404 when the decode replica took it already)."""
        try:
            await self.client.delete(f"{prefill}/kv_transfer/{transfer_id}", timeout=5.0)
        except httpx.HTTPError as err:
            logger.warning("could not release export %s on %s: %r", transfer_id, prefill, err)


def build_proxy_app(prefill: list[str], decode: list[str], *, timeout: httpx.Timeout = TIMEOUT) -> FastAPI:
    app = FastAPI(title="kimi-jax prefill/decode proxy")
    proxy = Proxy(prefill, decode, timeout=timeout)

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=err)
        return internal_server_error().response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=HTTPStatus.OK)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        url = proxy.decode_urls[0]
        auth = {"authorization": request.headers["authorization"]} if "authorization" in request.headers else {}
        try:
            answer = await proxy.client.get(f"{url}/v1/models", headers=auth)
        except httpx.HTTPError as err:
            raise upstream_error("decode", url, err) from err
        return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.relay("/v1/chat/completions", request)

    return app


def run_proxy(args) -> None:
    """Blocking entry point of `kimi-jax serve --role proxy`."""
    app = build_proxy_app(args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
