"""The HTTP side of overload, timeouts, failed engine steps and API-key coverage (over FakeAsyncEngine)."""

from __future__ import annotations

import json

import httpx
import pytest

from kimi_jax.tokenizer import load_tokenizer
from serve.cli import build_parser
from serve.openai import ServerConfig, build_app
from serve.openai.background import serve_in_thread
from serve.openai.cli_args import admission_args, server_config_from_args
from tests.serve.fake_engine import FakeAsyncEngine

MODEL = "kimi-tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 8}


@pytest.fixture(scope="module")
def served():
    engine = FakeAsyncEngine(load_tokenizer("tiny"), step_delay_s=0.02)
    with serve_in_thread(build_app(engine, ServerConfig((MODEL,), "tiny", request_timeout_s=2.0))) as url:
        yield engine, url


@pytest.fixture
def engine(served):
    engine = served[0]
    engine.overloaded, engine.fail_after = False, None
    return engine


def _events(response: httpx.Response) -> list:
    return [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("route,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("stream", [False, True])
def test_overload_is_503_with_retry_after(served, engine, route, body, stream):
    engine.overloaded = True
    r = httpx.post(served[1] + route, json={**body, "stream": stream})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable_error"
    assert r.json()["error"]["code"] == "server_overloaded"
    engine.overloaded = False
    assert httpx.post(served[1] + route, json=body).status_code == 200


@pytest.mark.parametrize("route,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_timeouts(served, engine, route, body):
    slow = {**body, "max_tokens": 300, "ignore_eos": True}
    r = httpx.post(served[1] + route, json={**slow, "timeout": 0.2})
    assert r.status_code == 408 and r.json()["error"]["param"] == "timeout"
    r = httpx.post(served[1] + route, json=slow, timeout=30)  # the server's 2 s limit
    assert r.status_code == 408 and r.json()["error"]["param"] is None
    r = httpx.post(served[1] + route, json={**slow, "timeout": 0.3, "stream": True})
    events = _events(r)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert httpx.post(served[1] + route, json={**body, "timeout": 0}).status_code == 400


@pytest.mark.parametrize("route,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_failed_step_is_500_saying_so(served, engine, route, body):
    engine.fail_after = 3
    r = httpx.post(served[1] + route, json=body)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_request_failed"
    assert "engine step" in r.json()["error"]["message"]
    r = httpx.post(served[1] + route, json={**body, "stream": True})
    events = _events(r)
    assert r.status_code == 200 and events[-1] == "[DONE]" and len(events) >= 3  # chunks, then the error
    assert json.loads(events[-2])["error"]["code"] == "engine_request_failed"
    engine.fail_after = None
    assert httpx.post(served[1] + route, json=body).status_code == 200


def test_metrics_protection():
    tokenizer = load_tokenizer("tiny")
    app = build_app(FakeAsyncEngine(tokenizer), ServerConfig((MODEL,), "tiny", api_key="k", protect_metrics=True))
    with serve_in_thread(app) as url:
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        for route, body in [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]:
            assert httpx.post(url + route, json=body).status_code == 401


def test_cli_flags():
    args = build_parser().parse_args(["serve", "--request-timeout", "30", "--max-waiting-requests", "7",
                                      "--max-waiting-tokens", "900", "--protect-metrics", "--api-key", "k"])
    assert admission_args(args) == {"max_waiting_requests": 7, "max_waiting_tokens": 900}
    config = server_config_from_args(args, FakeAsyncEngine(load_tokenizer("tiny")))
    assert config.request_timeout_s == 30 and config.protect_metrics
    assert admission_args(build_parser().parse_args(["serve"])) == {}
    with pytest.raises(ValueError, match="request_timeout_s"):
        ServerConfig((MODEL,), "tiny", request_timeout_s=0)
