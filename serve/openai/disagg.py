"""The HTTP side of the KV connector: prefill and decode roles, and the CPU offload tier's metrics.

A request served disaggregated (``serve/openai/proxy.py`` drives it) goes through the same OpenAI routes on both
replicas, which render and tokenize it identically; two headers from the proxy say what to do with its cache:
* prefill replica, ``X-KV-Transfer-Id: <32 hex>``: the request (sent with ``max_tokens`` 1) exports its prompt's
  pages and the KDA checkpoint at its last prompt token when it finishes (``KVConnector.expect_export``); the
  export waits in a ``TransferTable`` until ``GET /kv_transfer/<id>`` takes it (once) or ``DELETE`` drops it, or
  ``timeout_s`` passes. The device pages and slot are freed at once, so a slow or dead decode replica never
  holds the prefill replica's cache.
* decode replica, the same id plus ``X-KV-Transfer-Source: <prefill URL>`` (one of ``peers``): before the request
  enters the engine it pulls the export, keeps only the entries of its own prompt (``items_for_prompt``) and puts
  them into the host store pinned by the request; admission then finds a prefix hit at the last prompt token and
  the request recomputes that one token, as after any prefix hit. A failed pull is logged and counted, and the
  request is computed from scratch (same output, more work).

Transport: HTTP through the stack the server already runs (FastAPI routes here, httpx on the pulling side), with
safetensors bodies (``kv_transfer.encode``). ``jax.experimental.transfer`` was tried first: pulling a transfer
whose offer had expired blocked the caller for good (its timeout did not apply), which a server cannot afford.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import secrets
from collections.abc import AsyncIterator, Sequence
from http import HTTPStatus

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serve.engine.kv_connector import KVConnector, TransferItem, attach_connector
from serve.engine.kv_store import ORIGINS, HostKVStore
from serve.engine.kv_transfer import TransferTable, decode, encode, items_for_prompt
from serve.openai.app import build_app
from serve.openai.disagg_args import KVTransferConfig
from serve.openai.errors import APIError, bad_request

logger = logging.getLogger(__name__)

TRANSFER_ID_HEADER = "x-kv-transfer-id"
TRANSFER_SOURCE_HEADER = "x-kv-transfer-source"
_TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
_TRANSFER: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar(
    "kv_transfer", default=(None, None))
GIB = 1 << 30


def new_transfer_id() -> str:
    return secrets.token_hex(16)


class TransferHeaders:
    """ASGI middleware: the transfer headers of an HTTP request, checked, in a context variable for the engine
    adapter (which the OpenAI handlers call with prompt ids only). A malformed or unknown header is a 400."""

    def __init__(self, app, *, peers: Sequence[str]):
        self.app = app
        self.peers = set(peers)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        transfer_id, source = headers.get(TRANSFER_ID_HEADER), headers.get(TRANSFER_SOURCE_HEADER)
        error = None
        if transfer_id is not None and not _TRANSFER_ID.fullmatch(transfer_id):
            error = f"{TRANSFER_ID_HEADER} must be 32 lowercase hex digits"
        elif source is not None and (source.rstrip("/") not in self.peers or transfer_id is None):
            error = f"{TRANSFER_SOURCE_HEADER} must name a configured peer, with {TRANSFER_ID_HEADER}"
        if error is not None:
            return await bad_request(error, param=None, code="invalid_kv_transfer").response()(scope, receive, send)
        token = _TRANSFER.set((transfer_id, source.rstrip("/") if source else None))
        try:
            await self.app(scope, receive, send)
        finally:
            _TRANSFER.reset(token)


class KVTransferEngine:
    """The AsyncEngine interface with the role's transfer step around ``generate`` (see the module docstring)."""

    def __init__(self, engine, connector: KVConnector, *, role: str | None, config: KVTransferConfig,
                 api_key: str | None):
        self.engine = engine
        self.connector = connector
        self.role = role
        self.config = config
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self.vision_config = getattr(engine, "vision_config", None)
        self.block_size = connector.copier.layout.block_size
        self.pulls = {"ok": 0, "failed": 0, "empty": 0}
        self.pulled_bytes = 0
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = None
        self._pulling: dict[str, tuple[asyncio.Task, int]] = {}  # transfer id -> (pull, requests waiting on it)

    def stats(self):
        return self.engine.stats()

    def check_admission(self, num_prompt_tokens: int, n: int = 1) -> None:
        self.engine.check_admission(num_prompt_tokens, n)

    @property
    def num_open_streams(self) -> int:
        return self.engine.num_open_streams

    def abort_all(self) -> None:
        self.engine.abort_all()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def generate(self, prompt_token_ids: Sequence[int], params, request_id: str, **media) -> AsyncIterator:
        transfer_id, source = _TRANSFER.get()
        if self.role == "prefill" and transfer_id is not None:
            self.connector.expect_export(request_id, transfer_id)
        try:
            if self.role == "decode" and source is not None:
                await self._receive(transfer_id, source, prompt_token_ids, request_id)
            async for output in self.engine.generate(prompt_token_ids, params, request_id, **media):
                yield output
        finally:
            self.connector.forget_export(request_id)
            self.connector.store.release(request_id)

    async def _receive(self, transfer_id: str, source: str, prompt: Sequence[int], request_id: str) -> None:
        """Pull the transfer (once per id, shared by the requests of one HTTP request) and store this prompt's
        entries pinned by ``request_id``."""
        task, users = self._pulling.get(transfer_id, (None, 0))
        if task is None:
            task = asyncio.ensure_future(self._pull(transfer_id, source))
        self._pulling[transfer_id] = (task, users + 1)
        try:
            items = await asyncio.shield(task)
        finally:
            task, users = self._pulling[transfer_id]
            if users == 1:
                del self._pulling[transfer_id]
            else:
                self._pulling[transfer_id] = (task, users - 1)
        mine = items_for_prompt(items, prompt, self.block_size)
        if mine:
            self.connector.insert(mine, owner=request_id)

    async def _pull(self, transfer_id: str, source: str) -> list[TransferItem]:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.config.timeout_s)
        try:
            response = await self._client.get(f"{source}/kv_transfer/{transfer_id}", headers=self._auth)
            if response.status_code == HTTPStatus.NOT_FOUND:
                self.pulls["empty"] += 1
                return []
            response.raise_for_status()
            items = await asyncio.to_thread(self._place, response.content)
        except (httpx.HTTPError, ValueError) as err:
            logger.warning("KV transfer %s from %s failed, computing the prompt here: %s", transfer_id, source, err)
            self.pulls["failed"] += 1
            return []
        self.pulls["ok"] += 1
        self.pulled_bytes += len(response.content)
        return items

    def _place(self, blob: bytes) -> list[TransferItem]:
        """Decode a blob and put its arrays where the load executables read them (a worker thread)."""
        copier = self.connector.copier
        items = decode(blob, copier.layout)
        for item in items:
            for page in item.pages:
                page.data = copier.to_host("page", page.data)
            ckpt = item.checkpoint
            ckpt.state = copier.to_host("slot", ckpt.state)
            if ckpt.tail_page is not None:
                ckpt.tail_page = copier.to_host("page", ckpt.tail_page)
        return items


class ConnectorMetrics:
    """Prometheus collector: prefix-hit tokens by tier, the host tier's contents and copies, transfers."""

    def __init__(self, engine: KVTransferEngine, table: TransferTable | None, model_name: str):
        self._engine = engine
        self._table = table
        self._model = model_name

    def collect(self):
        connector, labels = self._engine.connector, [self._model]
        tiers = connector.stats.hit_tokens
        hits = CounterMetricFamily("kimi_jax:prefix_cache_hits_by_tier",
                                   "Prefix-cache hit tokens by the tier their KV came from (device, cpu: the "
                                   "offload tier, remote: pulled from a prefill replica).",
                                   labels=["model_name", "tier"])
        device = self._engine.stats().prefix_cache_hits - sum(tiers[o] for o in ORIGINS)
        hits.add_metric([self._model, "device"], float(device))
        for origin in ORIGINS:
            hits.add_metric([self._model, origin], float(tiers[origin]))
        yield hits
        store = connector.store.stats()
        yield _gauge("kimi_jax:cpu_offload_bytes", "Bytes of pages and KDA checkpoints held in host memory.",
                     labels, store.num_bytes)
        entries = GaugeMetricFamily("kimi_jax:cpu_offload_entries", "Entries held in host memory.",
                                    labels=["model_name", "kind"])
        entries.add_metric([self._model, "page"], store.num_pages)
        entries.add_metric([self._model, "checkpoint"], store.num_checkpoints)
        yield entries
        copied = CounterMetricFamily("kimi_jax:cpu_offload_copied_bytes", "Bytes copied between device and host.",
                                     labels=["model_name", "direction"])
        copied.add_metric([self._model, "to_host"], float(connector.stats.saved_bytes))
        copied.add_metric([self._model, "to_device"], float(connector.stats.loaded_bytes))
        yield copied
        if self._table is not None:
            stats = self._table.stats()
            yield _gauge("kimi_jax:kv_transfers_pending", "Exports waiting for a decode replica.", labels,
                         stats.num_pending)
            yield _gauge("kimi_jax:kv_transfers_pending_bytes", "Bytes of exports waiting for a decode replica.",
                         labels, stats.pending_bytes)
            done = CounterMetricFamily("kimi_jax:kv_transfers", "Exports by how they ended.",
                                       labels=["model_name", "result"])
            for result, count in stats.results.items():
                done.add_metric([self._model, result], float(count))
            yield done
        if self._engine.role == "decode":
            pulls = CounterMetricFamily("kimi_jax:kv_transfer_pulls", "Pulls from prefill replicas by result.",
                                        labels=["model_name", "result"])
            for result, count in self._engine.pulls.items():
                pulls.add_metric([self._model, result], float(count))
            yield pulls
            yield CounterMetricFamily("kimi_jax:kv_transfer_pulled_bytes", "Bytes pulled from prefill replicas.",
                                      value=float(self._engine.pulled_bytes))


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, float(value))
    return family


def add_transfer_routes(app: FastAPI, table: TransferTable, layout, api_key: str | None) -> None:
    """``GET /kv_transfer/{id}`` (take an export, safetensors body) and ``DELETE`` (drop it) on a prefill app."""

    def authorize(request: Request) -> None:
        if api_key is not None and not secrets.compare_digest(
                request.headers.get("authorization", "").encode(), f"Bearer {api_key}".encode()):
            raise APIError("Incorrect API key provided.", status=HTTPStatus.UNAUTHORIZED, code="invalid_api_key")

    def check(transfer_id: str) -> None:
        if not _TRANSFER_ID.fullmatch(transfer_id):
            raise bad_request("transfer ids are 32 lowercase hex digits", param="transfer_id")

    def not_found(transfer_id: str) -> APIError:
        return APIError(f"no export {transfer_id} is waiting (never staged, taken, released or expired)",
                        status=HTTPStatus.NOT_FOUND, type="not_found_error")

    @app.get("/kv_transfer/{transfer_id}")
    async def take(transfer_id: str, request: Request) -> Response:
        authorize(request)
        check(transfer_id)
        items = table.take(transfer_id)
        if items is None:
            raise not_found(transfer_id)
        blob = await asyncio.to_thread(encode, items, layout)
        return Response(blob, media_type="application/octet-stream")

    @app.delete("/kv_transfer/{transfer_id}")
    async def release(transfer_id: str, request: Request) -> Response:
        authorize(request)
        check(transfer_id)
        if not table.release(transfer_id):
            raise not_found(transfer_id)
        return Response(status_code=HTTPStatus.NO_CONTENT)


def build_connector(engine, *, role: str | None, cpu_offload_gb: float, config: KVTransferConfig
                    ) -> tuple[KVConnector, TransferTable | None]:
    """The connector of a role (and the prefill role's transfer table), attached to ``engine`` (an LLMEngine)."""
    table = TransferTable(config.timeout_s) if role == "prefill" else None
    connector = KVConnector(HostKVStore(int(cpu_offload_gb * GIB)), spill=cpu_offload_gb > 0,
                            on_export=table.stage if table is not None else None)
    attach_connector(engine, connector)
    return connector, table


def build_kv_app(async_engine, connector: KVConnector, table: TransferTable | None, *, role: str | None,
                 config: KVTransferConfig, server_config) -> FastAPI:
    """The OpenAI app over the role's engine adapter, with the transfer routes, headers and metrics."""
    engine = KVTransferEngine(async_engine, connector, role=role, config=config, api_key=server_config.api_key)
    app = build_app(engine, server_config)
    if table is not None:
        add_transfer_routes(app, table, connector.copier.layout, server_config.api_key)
    app.state.metrics.registry.register(ConnectorMetrics(engine, table, server_config.model_name))
    app.add_middleware(TransferHeaders, peers=config.peers)
    return app


def run_kv_server(args, async_engine, connector: KVConnector, table: TransferTable | None,
                  config: KVTransferConfig) -> None:
    """`kimi-jax serve` with a KV connector (blocking)."""
    from serve.openai.cli_args import server_config_from_args
    from serve.openai.constraints import guidance_tokenizer
    from serve.openai.shutdown import DrainingServer

    app = build_kv_app(async_engine, connector, table, role=args.role, config=config,
                       server_config=server_config_from_args(args, async_engine))
    guidance_tokenizer(async_engine.tokenizer)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    asyncio.run(DrainingServer(config, async_engine, timeout_s=args.shutdown_timeout).serve())
