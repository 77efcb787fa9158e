"""`kimi-jax serve` flags (mirroring `vllm serve` where the meaning is the same) and the server entry points.

Engine flags (--max-model-len, --max-num-seqs, --max-num-batched-tokens, --block-size, --enable-prefix-caching,
--prefix-cache-retention-interval, --kv-cache-dtype, --mxfp4-byte-order, --gpu-memory-utilization, --seed,
--speculative-config) and the parallelism flags (--tensor-parallel-size, --data-parallel-size, --enable-expert-parallel,
--decode-context-parallel-size, --num-hosts / --host-rank / --coordinator-address) are defined here so
`kimi-jax serve --help` lists them all, and are read by whoever builds the engine; `run_server` reads the HTTP
ones.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import uvicorn

from serve.engine.config import KV_CACHE_DTYPES, MXFP4_BYTE_ORDERS, WARM_UP_MODES
from serve.openai.app import build_app
from serve.openai.config import ServerConfig
from serve.openai.constraints import guidance_tokenizer
from serve.openai.disagg_args import add_disagg_args
from serve.openai.shutdown import DrainingServer

PARSER_FORMATS = {"kimi_k3": "k3", "kimi_k2": "k2"}


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", nargs="?", default="tiny",
                        help="a preset (default: 'tiny', the shipped trained model) or a checkpoint folder")
    http = parser.add_argument_group("HTTP server")
    http.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--served-model-name", nargs="+", default=None,
                      help="names clients use in `model` (default: the MODEL argument); the first is reported")
    http.add_argument("--api-key", default=os.environ.get("KIMI_JAX_API_KEY"),
                      help="require `Authorization: Bearer KEY` on /v1/* (default: $KIMI_JAX_API_KEY, else none)")
    http.add_argument("--protect-metrics", action="store_true", help="/metrics requires the API key too")
    http.add_argument("--request-timeout", type=float, default=None,
                      help="seconds a request may run before it is stopped with a 408 (default: no limit)")
    http.add_argument("--max-waiting-requests", type=int, default=None,
                      help="sequences that may wait for admission; beyond, a 503 with Retry-After")
    http.add_argument("--max-waiting-tokens", type=int, default=None,
                      help="prompt tokens that may wait for admission; beyond, a 503 with Retry-After")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="on SIGTERM, seconds open streams may run on before they are ended (default: 30)")
    http.add_argument("--uvicorn-log-level", default="info",
                      choices=["critical", "error", "warning", "info", "debug", "trace"])
    chat = parser.add_argument_group("chat format and parsers")
    chat.add_argument("--chat-format", choices=["k3", "k2"], default=None,
                      help="prompt rendering and output parsing (default: from the parsers, else the tokenizer)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='allow tool_choice="auto" (the default when a request declares tools)')
    chat.add_argument("--tool-call-parser", choices=sorted(PARSER_FORMATS), default=None,
                      help="the chat format's tool-call syntax (kimi_k3 for K3 XTML); needed by "
                           "--enable-auto-tool-choice")
    chat.add_argument("--reasoning-parser", choices=sorted(PARSER_FORMATS), default=None,
                      help="return the thinking channel as `reasoning_content` (default: no split, the thinking "
                           "text is part of `content`)")
    chat.add_argument("--allowed-local-media-path", default=None,
                      help="let image_url parts name file: URLs below this folder (default: data URLs only)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + completion)")
    engine.add_argument("--max-num-seqs", type=int, default=None,
                        help="most sequences in one step (default: 16 on CPU, 128 on GPU)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one step, the chunked-prefill budget (default: 256 CPU, 4096 GPU)")
    engine.add_argument("--block-size", type=int, default=None,
                        help="tokens per MLA page, the prefix-match unit (default: 16 on CPU, 64 on GPU); a multiple "
                             "of 64 lets long-context decode on a GPU take the Mosaic-GPU MLA kernel")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="share MLA pages and restore KDA checkpoints across requests (default: on)")
    engine.add_argument("--prefix-cache-retention-interval", type=int, default=0,
                        help="also checkpoint KDA state every this many tokens (0: prompt ends and shared-prefix "
                             "junctions only)")
    engine.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="MLA page dtype (auto: the model's); fp8 = e4m3 with one f32 scale per token, "
                             "half the cache bytes")
    engine.add_argument("--mxfp4-byte-order", choices=list(MXFP4_BYTE_ORDERS), default="auto",
                        help="MXFP4 expert bytes as served (auto: re-laid at start into the word order, or pair "
                             "halves where widths do not fit, when the Pallas kernels run on a GPU; checkpoint: as "
                             "loaded)")
    engine.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                        help="fraction of each GPU's memory the engine may use: weights, both cache pools and a "
                             "reserve for step temporaries; the pools get what is left (default: 0.9)")
    engine.add_argument("--token-buckets", type=_positive_int, nargs="+", default=None, metavar="T",
                        help="step token counts compiled at start-up; a step is padded to the smallest that holds it "
                             "(default on GPU: 16, 64, 256, ... up to --max-num-batched-tokens)")
    engine.add_argument("--seq-buckets", type=_positive_int, nargs="+", default=None, metavar="N",
                        help="step sequence counts compiled at start-up (default on GPU: 1, 4, 16, ... up to "
                             "--max-num-seqs)")
    engine.add_argument("--page-buckets", type=_positive_int, nargs="+", default=None, metavar="P",
                        help="block-table widths in pages compiled at start-up (default on GPU: 16, 64, 256, ... up "
                             "to the pages of --max-model-len); fewer buckets of any kind start faster, more pad less")
    engine.add_argument("--warm-up", choices=list(WARM_UP_MODES), default="progressive",
                        help="progressive: serve as soon as the largest buckets are compiled (every step fits them) "
                             "and compile the others in the background, each used once ready; full: serve once "
                             "every bucket is compiled (several hosts: always full)")
    engine.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA compile option for the engine's GPU executables, e.g. "
                             "xla_gpu_enable_triton_gemm=false (repeatable)")
    engine.add_argument("--dtype", default="auto", help="parameter dtype (auto: float32 on CPU, bfloat16 on GPU)")
    engine.add_argument("--seed", type=int, default=0, help="engine random seed")
    engine.add_argument("--speculative-config", type=_speculative_config, default=None,
                        help='speculative decoding as vllm serve takes it, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or \'{"method": "dspark", '
                             '"num_speculative_tokens": 7, "model": DIR}\' (DIR from python -m '
                             'kimi_jax.training.train_drafter)')
    add_parallel_args(parser)
    add_disagg_args(parser)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_parallel_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parallelism flags, as ``vllm serve`` names them (``sharding.layout`` says what each does here)."""
    par = parser.add_argument_group("parallelism (sharding.layout)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="devices of one replica; weights (heads, FFN widths, vocabulary) split over them")
    par.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                     help="independent replicas behind one server, requests balanced by load and prefix; with "
                          "--enable-expert-parallel the DP ranks instead join one replica's expert group")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="routed experts split over the replica's devices (E/tp each, tokens by all-to-all) "
                          "instead of every device holding a slice of every expert")
    par.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1,
                     help="a divisor of --tensor-parallel-size: MLA latent pages split along the sequence over "
                          "that many of the TP ranks, partial attention merged by log-sum-exp (cache capacity "
                          "grows with it)")
    par.add_argument("--expert-capacity-factor", type=float, default=None,
                     help="expert-parallel dispatch buffer: capacity-factor times the balanced share per expert "
                          "owner, pairs past it dropped (default: exact, no pair dropped)")
    hosts = parser.add_argument_group("several hosts (jax.distributed)")
    hosts.add_argument("--num-hosts", type=int, default=None,
                       help="processes of one replica across hosts (0: JAX's cluster discovery); host 0 serves HTTP")
    hosts.add_argument("--host-rank", type=int, default=None, help="this process's rank, 0 .. num-hosts - 1")
    hosts.add_argument("--coordinator-address", default=None, help="host:port of rank 0's coordinator service")
    return parser


def _chat_format(args: argparse.Namespace, tokenizer) -> str:
    """--chat-format, else the one both parser flags name, else the tokenizer's special-token layout."""
    named = {PARSER_FORMATS[p] for p in (args.tool_call_parser, args.reasoning_parser) if p is not None}
    if len(named) > 1:
        raise ValueError("--tool-call-parser and --reasoning-parser name different chat formats")
    if args.chat_format is not None:
        if named and named != {args.chat_format}:
            raise ValueError(f"--chat-format {args.chat_format} conflicts with the parser flags")
        return args.chat_format
    if named:
        return named.pop()
    return "k3" if "<|open|>" in tokenizer.special_tokens else "k2"


def server_config_from_args(args: argparse.Namespace, engine) -> ServerConfig:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return ServerConfig(served_model_names=tuple(args.served_model_name or [args.model]), model_root=args.model,
                        chat_format=_chat_format(args, engine.tokenizer), api_key=args.api_key,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        split_reasoning=args.reasoning_parser is not None,
                        request_timeout_s=args.request_timeout, protect_metrics=args.protect_metrics,
                        allowed_local_media_path=args.allowed_local_media_path)


def _speculative_config(text: str):
    """argparse type of --speculative-config: refused before the model loads when a field is unknown or wrong."""
    from serve.engine.spec_config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def admission_args(args: argparse.Namespace) -> dict:
    """AsyncEngine's admission limits set on the command line (the rest keep their defaults)."""
    limits = dict(max_waiting_requests=args.max_waiting_requests, max_waiting_tokens=args.max_waiting_tokens)
    return {k: v for k, v in limits.items() if v is not None}


def build_server(args: argparse.Namespace, engine) -> uvicorn.Server:
    """The uvicorn server for `kimi-jax serve` (stop it with `server.should_exit = True`)."""
    app = build_app(engine, server_config_from_args(args, engine))
    guidance_tokenizer(engine.tokenizer)  # built once (about 1 s at 164K vocab), not on the first JSON request
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return DrainingServer(config, engine, timeout_s=args.shutdown_timeout)


async def serve_http(args: argparse.Namespace, engine) -> None:
    """Serve until interrupted, on the running event loop (for engines whose loop must be shared)."""
    await build_server(args, engine).serve()


def run_server(args: argparse.Namespace, engine) -> None:
    """Blocking entry point of `kimi-jax serve` once the engine is built."""
    asyncio.run(serve_http(args, engine))
