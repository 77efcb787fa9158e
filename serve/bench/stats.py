"""Benchmark summary with `vllm bench serve`'s definitions, result keys and printed layout.

TTFT: request start -> first chunk with text. TPOT (per request): (latency - TTFT) / (output tokens - 1), for
requests with more than one output token. ITL: gaps between successive text chunks, over all requests. E2EL:
request start -> end of stream. Throughputs divide by the wall time of the whole run.
"""

from __future__ import annotations

import math

import numpy as np

from serve.bench.client import RequestResult

METRIC_TITLES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                 "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def _peak_output_throughput(results: list[RequestResult]) -> float:
    """Most text chunks (about one token each) that arrived within any one-second bucket of the run."""
    times = [t for r in results if r.success for t in r.chunk_times]
    if not times:
        return 0.0
    start = min(r.start_time for r in results)
    return float(np.bincount(((np.asarray(times) - start) // 1.0).astype(np.int64)).max())


def _peak_concurrency(results: list[RequestResult]) -> int:
    events = sorted([(r.start_time, 1) for r in results] + [(r.start_time + r.latency, -1) for r in results])
    peak = running = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def _distribution(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(values_ms.mean()), f"median_{name}_ms": float(np.median(values_ms)),
           f"std_{name}_ms": float(values_ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(values_ms, p))
    return out


def summarize(results: list[RequestResult], duration_s: float, *, metrics: list[str],
              percentiles: list[float]) -> dict:
    """The result dictionary (vLLM's keys): totals, throughputs, per-metric mean/median/std/percentiles in ms,
    and the per-request lists (input_lens, output_lens, ttfts, itls, errors)."""
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    series = {"ttft": [r.ttft for r in done], "tpot": tpots, "itl": [g for r in done for g in r.itl],
              "e2el": [r.latency for r in done]}
    summary = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": _peak_output_throughput(results),
        "max_concurrent_requests": _peak_concurrency(done),
    }
    for name in metrics:
        summary.update(_distribution(name, series[name], percentiles))
    summary.update({"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
                    "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
                    "errors": [r.error for r in results]})
    return summary


def format_report(summary: dict, *, metrics: list[str], percentiles: list[float],
                  request_rate: float, max_concurrency: int | None) -> str:
    """The table `vllm bench serve` prints."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value) -> None:
        lines.append(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Maximum request concurrency:", max_concurrency if max_concurrency is not None else "None")
    row("Request rate configured (RPS):", request_rate if math.isfinite(request_rate) else "inf")
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"])
    row("Peak concurrent requests:", summary["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", summary["total_token_throughput"])
    for name in metrics:
        short, title = METRIC_TITLES[name]
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", summary[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", summary[f"p{p:g}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)
