"""The FastAPI app: OpenAI routes, /health, /metrics, API-key check, and OpenAI-style error bodies.

Request bodies are JSON objects nested at most MAX_JSON_DEPTH levels (arrays and objects; the body itself is
level 1), checked on the raw bytes before anything parses them, since Python's json module and the code after
it recurse per level: a deeper body is a 400 (`code` "json_too_deep"), never a RecursionError. 128 leaves room
for tool schemas nested some 60 levels (each schema level is an object in a `properties` object).

Errors: anything deliberate is an `APIError` (its message is meant for the client). Any other exception is a
500 whose body says only "Internal server error"; the exception itself goes to the server log.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from http import HTTPStatus

import numpy as np
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.openai.chat import ChatHandler
from serve.openai.completions import CompletionHandler
from serve.openai.config import ServerConfig
from serve.openai.errors import (APIError, bad_request, from_validation_error, internal_server_error,
                                 service_unavailable)
from serve.openai.metrics import ServerMetrics
from serve.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, now

logger = logging.getLogger(__name__)

MAX_JSON_DEPTH = 128
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (brackets inside strings do not count).

    Linear in the body and recursion-free (regex and numpy); on malformed JSON (say an unterminated string) a
    number that json.loads would never reach, which is harmless: such a body is a 400 either way.
    """
    brackets = np.frombuffer(_JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS), np.uint8)
    if not brackets.size:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def json_object_body(body: bytes) -> dict:
    """A request body as a JSON object, or a 400 (too deep, malformed, not an object) before anything recurses."""
    if json_depth(body) > MAX_JSON_DEPTH:
        raise bad_request(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels.",
                          code="json_too_deep")
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"Malformed JSON body: {err}", code="invalid_json") from err
    if not isinstance(payload, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return payload


async def _parse(request: Request, model: type[pydantic.BaseModel]) -> pydantic.BaseModel:
    body = await request.body()
    json_object_body(body)
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as err:
        raise from_validation_error(err) from err


def build_app(engine, config: ServerConfig) -> FastAPI:
    """The HTTP app over `engine` (an `AsyncEngine`: generate / abort / stats / tokenizer / max_model_len)."""
    app = FastAPI(title="kimi-jax OpenAI-compatible server")
    metrics = ServerMetrics(engine, config.model_name)
    completions = CompletionHandler(engine, config, metrics)
    chat = ChatHandler(engine, config, metrics)
    app.state.metrics = metrics
    app.state.draining = False  # set by DrainingServer on SIGTERM

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        supplied = request.headers.get("authorization", "")
        if not secrets.compare_digest(supplied.encode(), f"Bearer {config.api_key}".encode()):
            raise APIError("Incorrect API key provided.", status=HTTPStatus.UNAUTHORIZED, code="invalid_api_key")

    def refuse_if_draining() -> None:
        if app.state.draining:
            raise service_unavailable("The server is shutting down.", retry_after_s=5, code="shutting_down")

    def check_model(model: str | None) -> None:
        if model is not None and model not in config.served_model_names:
            raise bad_request(f"The model `{model}` does not exist.", param="model", code="model_not_found")

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return bad_request(str(err)).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == HTTPStatus.NOT_FOUND else "invalid_request_error"
        return APIError(str(err.detail), status=err.status_code, type=kind).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=err)
        return internal_server_error().response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE if app.state.draining else HTTPStatus.OK)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        if config.protect_metrics:
            authorize(request)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        authorize(request)
        cards = [ModelCard(id=name, created=now(), root=config.model_root, max_model_len=engine.max_model_len)
                 for name in config.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        authorize(request)
        refuse_if_draining()
        body = await _parse(request, CompletionRequest)
        check_model(body.model)
        return await completions.create(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        authorize(request)
        refuse_if_draining()
        body = await _parse(request, ChatCompletionRequest)
        check_model(body.model)
        return await chat.create(body, request)

    return app
