"""`kimi-jax bench serve`: load generator for OpenAI-compatible servers (vLLM's `bench serve` metrics)."""

from serve.bench.serve_bench import add_bench_args, main, run_benchmark

__all__ = ["add_bench_args", "main", "run_benchmark"]
