"""`kimi-jax bench serve`: a load generator for any OpenAI-compatible server, modelled on `vllm bench serve`.

Sends a dataset of streamed requests at a fixed request rate (Poisson, or gamma with --burstiness) and/or with a
concurrency cap, then prints request and token throughput and TTFT / TPOT / ITL / E2EL statistics (against a
speculating server also the run's draft acceptance, from the difference of its ``/metrics`` counters before and
after the run: ``spec_metrics.py``), and with --save-result writes them (plus per-request lists) as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

from serve.bench.client import RequestResult, build_payload, send_request
from serve.bench.datasets import BenchRequest, random_requests, shared_prefix_requests
from serve.bench.spec_metrics import SpecCounters, format_spec_report, scrape_spec_counters
from serve.bench.stats import METRIC_TITLES, format_report, summarize

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    target = parser.add_argument_group("target")
    target.add_argument("--backend", choices=sorted(ENDPOINTS), default="openai",
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    target.add_argument("--base-url", default=None, help="server root, e.g. http://host:8000 (overrides host/port)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument("--endpoint", default=None, help="path (default: by --backend)")
    target.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=["random", "shared-prefix"], default="random")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="prompt words (random); suffix words after the shared prefix (shared-prefix)")
    data.add_argument("--random-output-len", type=int, default=128, help="max_tokens of each request")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths are uniform in [len * (1 - r), len * (1 + r)]")
    data.add_argument("--shared-prefix-len", type=int, default=512, help="words of each shared prefix")
    data.add_argument("--shared-prefix-num-groups", type=int, default=8, help="number of distinct prefixes")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival times (1 = Poisson; lower = burstier)")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    load.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens per request")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    report = parser.add_argument_group("report")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                        help=f"comma-separated subset of {','.join(METRIC_TITLES)}")
    report.add_argument("--metric-percentiles", default="90,99", help="comma-separated percentiles")
    report.add_argument("--save-result", action="store_true")
    report.add_argument("--result-dir", default=".")
    report.add_argument("--result-filename", default=None)
    return parser


def _dataset(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, rng)
    return shared_prefix_requests(args.num_prompts, args.shared_prefix_num_groups, args.shared_prefix_len,
                                  args.random_input_len, args.random_output_len, args.random_range_ratio, rng)


def arrival_delays(num: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds to wait before each request: zeros at rate inf, else gamma(shape=burstiness) gaps of mean 1/rate."""
    if math.isinf(request_rate):
        return np.zeros(num)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=num)
    return np.concatenate([[0.0], gaps[1:]])


async def _first_model(client: httpx.AsyncClient, base_url: str, headers: dict) -> str:
    response = await client.get(base_url + "/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = base_url + (args.endpoint or ENDPOINTS[args.backend])
    chat = args.backend == "openai-chat"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    requests = _dataset(args)
    delays = arrival_delays(len(requests), args.request_rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        model = args.model or await _first_model(client, base_url, headers)

        def payload(request: BenchRequest) -> dict:
            return build_payload(request, model=model, chat=chat, ignore_eos=args.ignore_eos,
                                 temperature=args.temperature, extra_body=args.extra_body)

        probe = await send_request(client, url, payload(requests[0]), requests[0], chat=chat, headers=headers)
        if not probe.success:
            raise RuntimeError(f"initial test request failed: {probe.error}")

        async def one(request: BenchRequest) -> RequestResult:
            if limit is None:
                return await send_request(client, url, payload(request), request, chat=chat, headers=headers)
            async with limit:
                return await send_request(client, url, payload(request), request, chat=chat, headers=headers)

        spec_before = await scrape_spec_counters(client, base_url, headers)
        start = time.perf_counter()
        tasks = []
        for request, delay in zip(requests, delays):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        spec_after = await scrape_spec_counters(client, base_url, headers)
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    summary = summarize(list(results), duration, metrics=metrics, percentiles=percentiles)
    summary.update({"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "model_id": model,
                    "dataset_name": args.dataset_name, "num_prompts": len(requests),
                    "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                    "burstiness": args.burstiness, "max_concurrency": args.max_concurrency})
    report = format_report(summary, metrics=metrics, percentiles=percentiles, request_rate=args.request_rate,
                           max_concurrency=args.max_concurrency)
    if spec_after is not None:  # a speculating server: the run's acceptance from its /metrics counters
        summary["spec_decode"] = spec_after.minus(spec_before or SpecCounters()).summary()
        report = report.rsplit("\n", 1)[0] + "\n" + format_spec_report(summary["spec_decode"]) + "\n" + "=" * 50
    print(report)
    return summary


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the summary (also written as JSON with --save-result)."""
    summary = asyncio.run(run_benchmark(args))
    if args.save_result:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        name = args.result_filename or (f"{args.backend}-{rate}qps-"
                                        f"{str(summary['model_id']).replace('/', '_')}-{summary['date']}.json")
        path = Path(args.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
        print(f"results written to {path}")
    return summary
