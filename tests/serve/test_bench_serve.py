"""`kimi-jax bench serve`: statistics on hand-made timings, the datasets, arrival times, and full runs against
the fake-engine server."""

import argparse
import dataclasses
import json
import random

import numpy as np
import pytest

from kimi_jax.tokenizer import load_tokenizer
from serve.bench import add_bench_args, main
from serve.bench.client import RequestResult
from serve.bench.datasets import random_requests, shared_prefix_requests
from serve.bench.serve_bench import arrival_delays
from serve.bench.spec_metrics import SpecCounters, parse_spec_counters
from serve.bench.stats import format_report, summarize
from serve.openai import ServerConfig, build_app
from serve.openai.background import serve_in_thread
from tests.serve.fake_engine import FakeAsyncEngine

API_KEY = "bench-key"


def result(start, ttft, gaps, tokens, prompt_len=10):
    latency = ttft + sum(gaps)
    chunk_times = list(start + ttft + np.cumsum([0.0, *gaps]))
    return RequestResult(success=True, prompt_len=prompt_len, output_tokens=tokens, ttft=ttft, itl=list(gaps),
                         latency=latency, start_time=start, chunk_times=chunk_times)


def test_summary_statistics_by_hand():
    results = [result(0.0, 0.1, [0.02, 0.04], 3), result(0.05, 0.3, [0.01], 2),
               RequestResult(error="HTTP 500", start_time=0.1)]
    summary = summarize(results, 2.0, metrics=["ttft", "tpot", "itl", "e2el"], percentiles=[50, 90])
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (20, 5)
    assert summary["request_throughput"] == 1.0 and summary["output_throughput"] == 2.5
    assert summary["total_token_throughput"] == 12.5
    assert summary["mean_ttft_ms"] == pytest.approx(200.0) and summary["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["p90_ttft_ms"] == pytest.approx(100.0 + 0.9 * 200.0)
    assert summary["mean_tpot_ms"] == pytest.approx(((0.06 / 2) + (0.01 / 1)) / 2 * 1000)
    assert summary["mean_itl_ms"] == pytest.approx(70.0 / 3)
    assert summary["median_e2el_ms"] == pytest.approx((160.0 + 310.0) / 2)
    assert summary["max_concurrent_requests"] == 2
    assert summary["max_output_tokens_per_s"] == 5.0  # all five chunks land within the first second
    assert summary["errors"] == ["", "", "HTTP 500"]
    report = format_report(summary, metrics=["ttft"], percentiles=[50, 90], request_rate=float("inf"),
                           max_concurrency=None)
    assert "Successful requests:                    2" in report and "P90 TTFT (ms):" in report


def test_random_dataset_lengths_and_determinism():
    requests = random_requests(50, 40, 12, 0.25, random.Random(1))
    assert all(30 <= r.prompt_len <= 50 and 9 <= r.output_len <= 15 for r in requests)
    assert all(len(r.prompt.split()) == r.prompt_len for r in requests)
    assert requests == random_requests(50, 40, 12, 0.25, random.Random(1))
    assert len({r.prompt.split()[0] for r in requests}) == 50  # no two share a first token


def test_shared_prefix_dataset_groups():
    requests = shared_prefix_requests(30, 3, 20, 5, 8, 0.0, random.Random(2))
    prefixes = {r.prompt.split(" question ")[0] for r in requests}
    assert len(prefixes) == 3 and all(len(p.split()) == 22 for p in prefixes)
    assert len({r.prompt for r in requests}) == 30 and all(r.output_len == 8 for r in requests)


def test_arrival_delays():
    assert not arrival_delays(5, float("inf"), 1.0, 0).any()
    gaps = arrival_delays(4000, 20.0, 1.0, 0)
    assert gaps[0] == 0.0 and gaps[1:].mean() == pytest.approx(1 / 20.0, rel=0.08)
    bursty = arrival_delays(4000, 20.0, 0.25, 0)
    assert bursty[1:].std() > 1.5 * gaps[1:].std()  # gamma shape 0.25: same mean, larger spread


@pytest.fixture(scope="module")
def server():
    engine = FakeAsyncEngine(load_tokenizer("tiny"), max_model_len=1024, step_delay_s=0.001)
    with serve_in_thread(build_app(engine, ServerConfig(("tiny",), "tiny", api_key=API_KEY))) as url:
        yield engine, url


def bench_args(url, *extra):
    return add_bench_args(argparse.ArgumentParser()).parse_args(["--base-url", url, "--api-key", API_KEY, *extra])


def test_random_run_with_concurrency_and_ignore_eos(server, tmp_path):
    engine, url = server
    before = set(engine.received)
    summary = main(bench_args(url, "--num-prompts", "9", "--random-input-len", "20", "--random-output-len", "6",
                              "--max-concurrency", "3", "--ignore-eos", "--save-result", "--result-dir",
                              str(tmp_path), "--result-filename", "out.json"))
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["completed"] == summary["completed"] == 9 and saved["failed"] == 0
    assert saved["output_lens"] == [6] * 9 and saved["total_output_tokens"] == 54
    assert saved["max_concurrent_requests"] <= 3 and saved["model_id"] == "tiny"
    for key in ("mean_ttft_ms", "median_tpot_ms", "p90_itl_ms", "p99_e2el_ms", "request_throughput"):
        assert saved[key] > 0, key
    new = [engine.received[r][1] for r in set(engine.received) - before]
    assert len(new) == 10 and all(p.ignore_eos and p.max_tokens == 6 for p in new)  # 9 + the initial probe


def test_shared_prefix_chat_run_at_a_request_rate(server):
    engine, url = server
    hits_before = engine.stats().prefix_cache_hits
    summary = main(bench_args(url, "--backend", "openai-chat", "--dataset-name", "shared-prefix", "--num-prompts",
                              "8", "--shared-prefix-len", "30", "--shared-prefix-num-groups", "2",
                              "--random-input-len", "4", "--random-output-len", "4", "--request-rate", "100",
                              "--metric-percentiles", "50,99"))
    assert summary["completed"] == 8 and "p99_ttft_ms" in summary and "p90_ttft_ms" not in summary
    assert engine.stats().prefix_cache_hits - hits_before >= 6 * 30  # all but the first of each group hit


def test_run_fails_fast_without_the_api_key(server):
    args = bench_args(server[1], "--num-prompts", "2", "--model", "tiny")
    args.api_key = None
    with pytest.raises(RuntimeError, match="HTTP 401"):
        main(args)


def test_spec_counters_parsed_summed_over_labels_and_differenced():
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{model_name="a"} 4.0',
        'vllm:spec_decode_num_drafts_total{model_name="b"} 6.0',
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        'vllm:spec_decode_num_draft_tokens_total{model_name="a"} 30.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        'vllm:spec_decode_num_accepted_tokens_total{model_name="a"} 12.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="1"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="0"} 8.0', ""])
    after = parse_spec_counters(text)
    assert after == SpecCounters(10.0, 30.0, 12.0, (8.0, 4.0))
    before = SpecCounters(5.0, 15.0, 2.0, (2.0,))
    got = after.minus(before).summary()
    assert got["num_drafts"] == 5 and got["num_accepted_tokens"] == 10
    assert got["mean_acceptance_length"] == pytest.approx(3.0)
    assert got["draft_acceptance_rate"] == pytest.approx(10 / 15)
    assert got["acceptance_rate_per_position"] == pytest.approx([6 / 5, 4 / 5])
    assert parse_spec_counters('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n') is None


@pytest.fixture(scope="module")
def spec_server():
    engine = FakeAsyncEngine(load_tokenizer("tiny"), max_model_len=1024, step_delay_s=0.001, num_speculative_tokens=3)
    with serve_in_thread(build_app(engine, ServerConfig(("tiny",), "tiny", api_key=API_KEY))) as url:
        yield engine, url


def test_report_carries_the_runs_acceptance_from_metrics(spec_server, server, capsys):
    engine, url = spec_server
    engine.reply = lambda prompt_ids, params, index: "alpha bravo charlie delta echo foxtrot golf hotel"
    args = ["--num-prompts", "5", "--random-input-len", "8", "--random-output-len", "6", "--ignore-eos"]
    main(bench_args(url, *args))  # the server's counters are not zero when the next run starts
    start = dataclasses.replace(engine.spec_decode, accepted_per_pos=list(engine.spec_decode.accepted_per_pos))
    summary = main(bench_args(url, *args))
    end = engine.stats().spec_decode
    # every request gets the same tokens: the run's 5 requests are 5/6 of what the 6 (with the probe, which the
    # report leaves out) added
    assert end.num_drafts - start.num_drafts == 36
    spec = summary["spec_decode"]
    assert spec["num_drafts"] == 30 and spec["num_draft_tokens"] == 90
    accepted = end.num_accepted_tokens - start.num_accepted_tokens
    assert accepted > 0 and spec["num_accepted_tokens"] == accepted * 5 // 6
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted * 5 / 6 / 30)
    assert spec["acceptance_rate_per_position"] == pytest.approx(
        [(b - a) * 5 / 6 / 30 for a, b in zip(start.accepted_per_pos, end.accepted_per_pos)])
    assert "Mean acceptance length:" in capsys.readouterr().out
    assert "spec_decode" not in main(bench_args(server[1], *args))  # a server that does not speculate
