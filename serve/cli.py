"""``kimi-jax`` command line: ``generate`` (one-off prompts), ``serve`` (OpenAI server), ``bench serve``."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a continuation of one or more prompts")
    p.add_argument("model", nargs="?", default="tiny", help="preset name or checkpoint folder (default: tiny)")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable); default: a short Python prompt")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="parameter dtype (float32 is fastest on CPU)")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    import kimi_jax
    from serve.progress import ProgressBar
    from kimi_jax.tokenizer import load_tokenizer

    start = time.perf_counter()
    lm = kimi_jax.load(args.model, dtype=args.dtype, seed=args.seed,
                       progress=ProgressBar("loading weights", unit="parameters"))
    tokenizer = load_tokenizer(args.model if os.path.isdir(args.model) else "tiny")
    if tokenizer.vocab_size > lm.config.vocab_size:
        raise SystemExit(f"tokenizer has {tokenizer.vocab_size} ids but the model only {lm.config.vocab_size}")
    prompts = args.prompt or ['def fibonacci(n):\n    """Return the']
    ids = [tokenizer.encode(p) for p in prompts]
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    start = time.perf_counter()
    outs = lm.generate(ids, max_new_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, stop_token_ids=list(tokenizer.eos_token_ids))
    new_tokens = sum(len(o) - len(i) for o, i in zip(outs, ids))
    for prompt, prompt_ids, out in zip(prompts, ids, outs):
        print(prompt + tokenizer.decode(out[len(prompt_ids):], skip_special_tokens=True))
        print("-" * 40)
    print(f"{new_tokens} tokens in {time.perf_counter() - start:.1f}s (first call includes compilation)",
          file=sys.stderr)
    return 0


def _add_serve(sub) -> None:
    from serve.openai.cli_args import add_serve_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default model: the shipped tiny model)")
    add_serve_args(p)
    p.set_defaults(func=_serve)


def engine_args_from_cli(args: argparse.Namespace) -> dict:
    """EngineConfig fields set on the command line (None = platform default), and on a GPU the executable cache
    folder beside the compilation cache."""
    from pallas_kernels.impl import on_gpu

    fields = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                  enable_prefix_caching=args.enable_prefix_caching,
                  prefix_cache_retention_interval=args.prefix_cache_retention_interval,
                  kv_cache_dtype=args.kv_cache_dtype, mxfp4_byte_order=args.mxfp4_byte_order,
                  gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
                  token_buckets=_sizes(args, "token_buckets"), seq_buckets=_sizes(args, "seq_buckets"),
                  page_buckets=_sizes(args, "page_buckets"),
                  speculative_config=getattr(args, "speculative_config", None),
                  warm_up=getattr(args, "warm_up", None))
    cache = compile_cache_folder()
    if cache and on_gpu():  # XLA's CPU executables can name functions another process lacks: JAX's cache only
        fields["executable_cache_dir"] = os.path.join(cache, "executables")
    return {k: v for k, v in fields.items() if v is not None}


def _sizes(args: argparse.Namespace, name: str) -> tuple[int, ...] | None:
    sizes = getattr(args, name, None)
    return tuple(sizes) if sizes else None


def _serve(args: argparse.Namespace) -> int:
    from serve.engine.async_engine import AsyncEngine
    from serve.engine.data_parallel import build_engine
    from serve.openai.cli_args import admission_args, run_server
    from serve.openai.disagg_args import check_disagg_args
    from sharding.layout import ParallelConfig, init_distributed

    start = time.perf_counter()
    try:
        kv_config = check_disagg_args(args)
    except ValueError as e:
        raise SystemExit(f"kimi-jax serve: {e}") from None
    if args.role == "proxy":  # no engine: it forwards to the prefill and decode replicas
        from serve.openai.proxy import run_proxy

        run_proxy(args)
        return 0
    try:
        parallel = ParallelConfig.of(args)
        init_distributed(parallel)  # before anything else touches a JAX backend
    except ValueError as e:
        raise SystemExit(f"kimi-jax serve: {e}") from None
    import jax

    from serve.engine.runner import add_gpu_compiler_options

    try:
        add_gpu_compiler_options(args.xla_option)
    except ValueError as e:
        raise SystemExit(f"kimi-jax serve: --xla-option: {e}") from None
    leader = jax.process_index() == 0
    print(f"[kimi-jax] loading {args.model} and compiling the step buckets ...", file=sys.stderr, flush=True)
    try:
        engine = build_engine(args.model, dtype=args.dtype, seed=args.seed, progress=leader, parallel=parallel,
                              capacity_factor=args.expert_capacity_factor, **engine_args_from_cli(args))
    except ValueError as e:  # an impossible layout: the reason and the planner's suggestions
        raise SystemExit(f"kimi-jax serve: {e}") from None
    runner = engine.runner
    if not leader:  # another host of a multi-host replica: replay host 0's launches until it stops
        print(f"[kimi-jax] host {jax.process_index()} ready, following host 0", file=sys.stderr, flush=True)
        runner.follow()
        return 0
    connector = table = None
    if args.role is not None or args.cpu_offload_gb > 0:
        from serve.openai.disagg import build_connector

        try:
            connector, table = build_connector(engine, role=args.role, cpu_offload_gb=args.cpu_offload_gb,
                                               config=kv_config)
        except ValueError as e:
            raise SystemExit(f"kimi-jax serve: {e}") from None
    replicas = getattr(engine, "num_replicas", 1)
    print(f"[kimi-jax] ready in {time.perf_counter() - start:.1f}s: {runner.shape.label()} on "
          f"{runner.mesh.size} device(s) x {replicas} replica(s), {jax.process_count()} host(s); "
          f"{runner.num_executables} executables compiled in {runner.warm_up_seconds:.1f}s"
          f"{_still_compiling(runner)}; {runner.plan.describe()}", file=sys.stderr, flush=True)
    if runner.executable_cache is not None:
        print(f"[kimi-jax] {runner.executable_cache.summary()}", file=sys.stderr, flush=True)
    if runner.compile_seconds:
        print(f"[kimi-jax] {runner.compile_summary()}", file=sys.stderr, flush=True)
    for replica_runner in _runners(engine):  # a progressive warm-up says when it is done
        replica_runner.on_warm_up_done = lambda message: print(f"[kimi-jax] {message}", file=sys.stderr, flush=True)
    try:
        if connector is None:
            run_server(args, AsyncEngine(engine, **admission_args(args)))
        else:
            from serve.openai.disagg import run_kv_server

            run_kv_server(args, AsyncEngine(engine, **admission_args(args)), connector, table, kv_config)
    finally:
        for replica_runner in _runners(engine):
            replica_runner.stop_warm_up()
        runner.stop_followers()
    return 0


def _runners(engine) -> list:
    """The runner of every replica (a data-parallel engine has one per replica)."""
    return [replica.runner for replica in getattr(engine, "engines", [engine])]


def _still_compiling(runner) -> str:
    """', N more compiling in the background' during a progressive warm-up, else ''."""
    pending = runner.num_pending_executables
    return f", {pending} more compiling in the background (smaller buckets, each used once ready)" if pending else ""


def _add_bench(sub) -> None:
    from serve.bench import add_bench_args
    from serve.bench.soak import add_soak_args

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("serve", help="load generator against an OpenAI-compatible endpoint")
    add_bench_args(p)
    p.set_defaults(func=_bench_serve)
    p = bench.add_parser("soak", help="concurrent streams with random disconnects, checked against greedy output")
    add_soak_args(p)
    p.set_defaults(func=_bench_soak)


def _bench_serve(args: argparse.Namespace) -> int:
    from serve.bench import main as bench_main

    bench_main(args)
    return 0


def _bench_soak(args: argparse.Namespace) -> int:
    from serve.bench.soak import main as soak_main

    return soak_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimi-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    return parser


def compile_cache_folder() -> str | None:
    """``KIMI_JAX_COMPILE_CACHE`` (default ``~/.cache/kimi_jax/jit``); None when it is empty or "off"."""
    folder = os.environ.get("KIMI_JAX_COMPILE_CACHE", os.path.expanduser("~/.cache/kimi_jax/jit"))
    return folder if folder and folder != "off" else None


def _enable_compile_cache() -> None:
    """Persist XLA executables across runs: JAX's compilation cache in the folder, and the engine's step executables
    in its ``executables`` subfolder (``serve.engine.executable_cache``: a restart skips tracing and lowering too)."""
    folder = compile_cache_folder()
    if folder:
        import jax

        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("generate", "serve"):
        _enable_compile_cache()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
