"""Prometheus metrics under vLLM's names (`vllm:*`), so existing dashboards and scrapers work unchanged.

Latency histograms are observed by the server per request (arrival at the HTTP handler -> first token, between
outputs, -> finish). Engine-side numbers (running/waiting, cache usage, prefix-cache queries/hits, preemptions,
prompt/generation tokens) are read from `engine.stats()` at scrape time; counters are exposed with prometheus'
`_total` suffix, as vLLM does (`vllm:prompt_tokens_total`, ...).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)

_ENGINE_GAUGES = (("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "cache_usage"))
_ENGINE_COUNTERS = (("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                     "prefix_cache_queries"),
                    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                     "prefix_cache_hits"),
                    ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
                    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
                    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"))


class _EngineCollector:
    """Reads `engine.stats()` on every scrape."""

    def __init__(self, engine, model_name: str):
        self._engine = engine
        self._model_name = model_name

    def collect(self):
        stats = self._engine.stats()
        for name, doc, field in _ENGINE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], float(getattr(stats, field)))
            yield family
        for name, doc, field in _ENGINE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], float(getattr(stats, field)))
            yield family
        if stats.router_expert_tokens:  # router load of MoE models (kimi-jax's own names; vLLM has none)
            family = CounterMetricFamily("kimi_jax:router_expert_tokens",
                                         "Routed (token, choice) pairs per expert, summed over MoE layers.",
                                         labels=["model_name", "expert"])
            for expert, count in enumerate(stats.router_expert_tokens):
                family.add_metric([self._model_name, str(expert)], float(count))
            yield family
            gauge = GaugeMetricFamily("kimi_jax:router_imbalance",
                                      "Mean over MoE layers of the busiest expert's load over the mean expert load.",
                                      labels=["model_name"])
            gauge.add_metric([self._model_name], stats.router_imbalance)
            yield gauge
        compiles = GaugeMetricFamily("kimi_jax:compiles_after_warm_up",
                                     "XLA compilations while serving, other than warm-up's (0).",
                                     labels=["model_name"])
        compiles.add_metric([self._model_name], float(getattr(stats, "compiles_after_warm_up", 0)))
        yield compiles
        pending = GaugeMetricFamily("kimi_jax:warm_up_executables_pending",
                                    "Step executables a progressive warm-up has not finished compiling (0: none "
                                    "left, or the warm-up stopped).", labels=["model_name"])
        pending.add_metric([self._model_name], float(getattr(stats, "executables_pending", 0)))
        yield pending
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:  # speculative decoding, in vLLM's names
            yield from self._spec_families(spec)

    def _spec_families(self, spec):
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Verification rows with at least one draft.", spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
                ("kimi_jax:spec_decode_num_paused_steps",
                 "Request steps without drafts: the request's recent drafts were mostly rejected.",
                 spec.num_paused_steps)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], float(value))
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens per draft position.", labels=["model_name", "position"])
        for position, count in enumerate(spec.accepted_per_pos):
            family.add_metric([self._model_name, str(position)], float(count))
        yield family


class RequestTimer:
    """Latency observations of one request; feed it every engine output, then `finish`."""

    def __init__(self, metrics: "ServerMetrics"):
        self._metrics = metrics
        self._arrival = time.monotonic()
        self._last_token_time: float | None = None
        self._num_tokens = 0

    def on_output(self, num_tokens: int) -> None:
        """`num_tokens`: tokens generated so far over all sequences of the request."""
        if num_tokens <= self._num_tokens:
            return
        now = time.monotonic()
        if self._last_token_time is None:
            self._metrics.ttft.labels(self._metrics.model_name).observe(now - self._arrival)
        else:
            self._metrics.itl.labels(self._metrics.model_name).observe(now - self._last_token_time)
        self._last_token_time = now
        self._num_tokens = num_tokens

    def finish(self, finish_reason: str | None) -> None:
        self._metrics.e2e.labels(self._metrics.model_name).observe(time.monotonic() - self._arrival)
        self._metrics.success.labels(self._metrics.model_name, finish_reason or "abort").inc()


class ServerMetrics:
    """One registry per app (tests start several apps in one process)."""

    def __init__(self, engine, model_name: str):
        disable_created_metrics()  # no `*_created` series, like vLLM
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             ["model_name"], buckets=E2E_BUCKETS, registry=self.registry)
        self.success = Counter("vllm:request_success", "Count of finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        for histogram in (self.ttft, self.itl, self.e2e):  # series exported from the start, at count 0
            histogram.labels(model_name)
        self.registry.register(_EngineCollector(engine, model_name))

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
