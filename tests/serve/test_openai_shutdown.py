"""Graceful shutdown: SIGTERM makes /health unready and refuses new work; open streams finish, or at the
deadline end with a clean final chunk; then the server exits."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from kimi_jax.tokenizer import load_tokenizer
from serve.openai import ServerConfig, build_app
from serve.openai.background import free_port
from serve.openai.shutdown import DrainingServer
from tests.serve.fake_engine import FakeAsyncEngine

MODEL = "kimi-tiny"


def _stream(url: str, max_tokens: int) -> list[dict | str]:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_sigterm_drains_then_ends_streams_cleanly():
    engine = FakeAsyncEngine(load_tokenizer("tiny"), step_delay_s=0.02)
    port = free_port()
    config = uvicorn.Config(build_app(engine, ServerConfig((MODEL,), "tiny")), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="off")
    server = DrainingServer(config, engine, timeout_s=1.5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    with ThreadPoolExecutor(2) as pool:
        short, long = pool.submit(_stream, url, 20), pool.submit(_stream, url, 400)
        while engine.num_open_streams < 2:
            time.sleep(0.01)
        server.handle_exit(signal.SIGTERM, None)
        assert httpx.get(url + "/health").status_code == 503
        refused = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert "retry-after" in refused.headers
        short, long = short.result(), long.result()
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in short[:-1] if e["choices"]) == 20
    assert long[-1] == "[DONE]" and long[-2]["choices"][0]["finish_reason"] == "abort"
    assert not any("error" in e for e in long[:-1])
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_shutdown_timeout_is_checked():
    engine = FakeAsyncEngine(load_tokenizer("tiny"))
    with pytest.raises(ValueError, match="shutdown timeout"):
        DrainingServer(uvicorn.Config(build_app(engine, ServerConfig((MODEL,), "tiny"))), engine, timeout_s=-1)
