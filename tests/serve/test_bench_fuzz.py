"""A smoke run of the fuzzer (the full 10,000-request run is a benchmark, see BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import random

from kimi_jax.tokenizer import load_tokenizer
from serve.bench.fuzz import fuzz, random_request
from serve.openai import ServerConfig, build_app
from serve.openai.background import serve_in_thread
from tests.serve.fake_engine import FakeAsyncEngine


def test_requests_cover_both_routes_and_bad_input():
    rng = random.Random(1)
    cases = [random_request(rng) for _ in range(300)]
    assert {route for route, _ in cases} == {"/v1/chat/completions", "/v1/completions"}
    assert any(isinstance(body, str) for _, body in cases)


def test_fuzz_smoke():
    engine = FakeAsyncEngine(load_tokenizer("tiny"), max_model_len=1024, reply=lambda *_: "alpha bravo")
    with serve_in_thread(build_app(engine, ServerConfig(("kimi-tiny",), "tiny"))) as url:
        report = asyncio.run(fuzz(url, requests=200, timeout_s=20))
    assert report["server_errors"] == 0 and report["hangs"] == 0, report
    assert report["alive_after"] and report["greedy_unchanged"]
    assert set(report["statuses"]) >= {"200", "400"}
    assert engine.num_open_streams == 0
