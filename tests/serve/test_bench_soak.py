"""A smoke run of the soak (the multi-minute 200-stream run is a benchmark, see BENCHMARKS.md)."""

from __future__ import annotations

import asyncio

from kimi_jax.tokenizer import load_tokenizer
from serve.bench.soak import soak
from serve.cli import build_parser
from serve.openai import ServerConfig, build_app
from serve.openai.background import serve_in_thread
from tests.serve.fake_engine import FakeAsyncEngine


def _reply(prompt_ids, params, index):
    return " ".join(str(i) for i in prompt_ids[:40])  # deterministic per prompt, like greedy decoding


def test_soak_smoke():
    engine = FakeAsyncEngine(load_tokenizer("tiny"), reply=_reply, step_delay_s=0.005)
    with serve_in_thread(build_app(engine, ServerConfig(("kimi-tiny",), "tiny"))) as url:
        report = asyncio.run(soak(url, streams=20, rounds=2, duration_s=1.5, disconnect=0.2, max_tokens=12))
    assert report["completed"] > 20 and report["cut_off"] > 0
    assert report["mismatched"] == 0 and report["errors"] == 0, report
    assert len(report["rounds"]) == 2 and engine.num_open_streams == 0


def test_soak_detects_a_wrong_stream():
    calls = []

    def flaky(prompt_ids, params, index):
        calls.append(1)
        return ("extra " if len(calls) % 5 == 0 else "") + _reply(prompt_ids, params, index)

    engine = FakeAsyncEngine(load_tokenizer("tiny"), reply=flaky, step_delay_s=0.002)
    with serve_in_thread(build_app(engine, ServerConfig(("kimi-tiny",), "tiny"))) as url:
        report = asyncio.run(soak(url, streams=5, rounds=1, duration_s=0.3, disconnect=0.0, max_tokens=40))
    assert report["mismatched"] > 0


def test_soak_command_parses():
    args = build_parser().parse_args(["bench", "soak", "--streams", "5", "--disconnect", "0.5"])
    assert args.streams == 5 and args.disconnect == 0.5 and args.func.__name__ == "_bench_soak"
