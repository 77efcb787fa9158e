"""Time to first token of a long prompt served three ways on one engine with a CPU offload tier (benchmark).

On a random model of a preset's first ``--layers`` layers, with prefix caching and a ``--cpu-offload-gb`` host
tier (``KVConnector`` spilling device evictions to a ``HostKVStore``), each repeat serves one fresh random prompt
three times, in this order:
* recompute: device index and host tier emptied first, so nothing of the prompt is cached anywhere;
* device hit: the same prompt again; it resumes from the device's prompt-end checkpoint and pages;
* host hit: ``CacheManager.clear_prefix_cache()`` evicts every device entry through the same hook that pool
  pressure uses (spilling it to the host tier; the bench waits until those copies have landed), then the prompt
  again: its pages and checkpoint load from host memory.
Each run is verified from the engine's counters (the request's cached tokens, ``KVConnector.stats.hit_tokens``):
nothing cached for the recompute, none of the device hit from the host, all of the host hit from the host. A
failed check exits with status 2. The three first tokens (greedy) must match: a mismatch exits with status 3 on
the CPU, where the reference path is exact; on a GPU it is reported (the recompute's last token runs in a
prefill-chunk executable, the hits' in a decode one, so bf16 rounding may differ). Every executable is compiled
at start-up and one untimed round per prompt length runs first; a compilation inside a timed run exits with
status 4. Prints a table; writes ``offload_ttft.json`` under ``--out`` after every repeat.

    PYTHONPATH=. python3 -m serve.bench.offload_ttft --preset kimi-linear-48b --layers 8 --impl pallas
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import numpy as np

VARIANTS = ("recompute", "device_hit", "host_hit")


class CheckFailed(Exception):
    """A run did not come from the tier it was meant to (``code``: the exit status)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Run:
    """One timed request: seconds to its first token, that token, tokens cached at admission, and of those the
    ones restored from the host tier."""

    seconds: float
    token: int
    cached: int
    host_tokens: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="kimi-linear-48b")
    parser.add_argument("--layers", type=int, default=8, help="keep the preset's first N layers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--impl", default="reference")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=4096)
    parser.add_argument("--memory-gib", type=float, default=4.0, help="device pools (pages + KDA slots)")
    parser.add_argument("--cpu-offload-gb", type=float, default=8.0, help="host tier capacity")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="past this many seconds since start, skip the remaining repeats and prompt lengths "
                             "(0: no deadline)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if args.layers < 1 or args.repeats < 1 or args.block_size < 1 or args.prefill_chunk < 1:
        parser.error("--layers, --repeats, --block-size and --prefill-chunk must be >= 1")
    if min(args.prompt_lens) <= args.block_size:
        parser.error("--prompt-lens must be longer than --block-size (a hit resumes from full pages)")
    if args.cpu_offload_gb <= 0:
        parser.error("--cpu-offload-gb must be > 0: the host hit needs a host tier")
    return args


def build_engine(args: argparse.Namespace):
    """The engine (one sequence, one prefill-chunk token bucket, one page bucket per prompt length) with its
    host tier attached; every executable is compiled on return."""
    import jax.numpy as jnp
    from flax import nnx

    from kimi_jax.model import KimiModel
    from kimi_jax.presets import get_preset
    from serve.engine.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine.kv_connector import KVConnector, attach_connector
    from serve.engine.kv_store import HostKVStore
    from serve.engine.runner import ModelRunner

    full = get_preset(args.preset)
    n = args.layers
    cfg = full.replace(num_layers=n, layer_types=full.layer_types[:n], mlp_types=full.mlp_types[:n])
    model = KimiModel(cfg, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(args.seed))
    bs = args.block_size
    pages = tuple(sorted({-(-(length + bs) // bs) for length in args.prompt_lens}))
    # the hits' one remaining prompt token runs as a decode step ((1, 1, P) buckets), the recompute in chunks
    runner = ModelRunner(model, EngineConfig(
        max_model_len=max(args.prompt_lens) + bs, max_num_seqs=1, max_num_batched_tokens=args.prefill_chunk,
        block_size=bs, token_buckets=(args.prefill_chunk,), seq_buckets=(1,), page_buckets=pages,
        num_checkpoint_slots=4, memory_budget_bytes=int(args.memory_gib * (1 << 30)), compile_threads=8),
        impl=args.impl)
    engine = LLMEngine(runner)
    attach_connector(engine, KVConnector(HostKVStore(int(args.cpu_offload_gb * (1 << 30))), spill=True))
    return engine


def evict_device_copy(engine) -> None:
    """Evict every device prefix entry (each spills to the host tier) and wait until the copies have landed."""
    import jax

    cache = engine.scheduler.cache
    cache.clear_prefix_cache()
    jax.block_until_ready(cache.connector.store.arrays())


def empty_both_tiers(engine) -> None:
    """Drop every prefix entry of the device index and of the host tier (the recompute's starting point)."""
    import jax

    cache = engine.scheduler.cache
    cache.clear_prefix_cache()
    jax.block_until_ready(cache.connector.store.arrays())  # the spills' copies, before their entries go
    cache.connector.store.clear()


def first_token(engine, request_id: str, prompt: list[int]) -> Run:
    """Serve ``prompt`` for one greedy token on the idle engine, timed from ``add_request`` to that token."""
    from serve.engine.runner import backend_compile_count
    from serve.engine.sampling_params import SamplingParams

    connector = engine.scheduler.cache.connector
    host_before = connector.stats.hit_tokens["cpu"]
    compiles = backend_compile_count()
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    request = engine.scheduler.requests[request_id]
    while request.num_output_tokens < 1:
        engine.step()
    seconds = time.perf_counter() - start
    compiled = backend_compile_count() - compiles
    while engine.has_unfinished_requests():
        engine.step()
    if compiled:
        raise CheckFailed(f"{request_id}: {compiled} compilation(s) inside the timed run", 4)
    return Run(seconds, request.output_token_ids[0], request.num_cached_tokens,
               connector.stats.hit_tokens["cpu"] - host_before)


def serve_three_ways(engine, prompt: list[int], tag: str) -> dict[str, Run]:
    """The recompute, device-hit and host-hit runs of ``prompt``, each checked against the tier it is meant for."""
    empty_both_tiers(engine)
    runs = {"recompute": first_token(engine, f"{tag}-recompute", prompt)}
    runs["device_hit"] = first_token(engine, f"{tag}-device", prompt)
    evict_device_copy(engine)
    runs["host_hit"] = first_token(engine, f"{tag}-host", prompt)
    check(runs, tag)
    return runs


def check(runs: dict[str, Run], tag: str) -> None:
    """Raise CheckFailed unless each run was served from the tier its name says."""
    cold, device, host = runs["recompute"], runs["device_hit"], runs["host_hit"]
    problems = []
    if cold.cached or cold.host_tokens:
        problems.append(f"recompute found {cold.cached} cached tokens ({cold.host_tokens} from the host tier)")
    if not device.cached or device.host_tokens:
        problems.append(f"device hit: {device.cached} cached tokens, {device.host_tokens} of them from the host tier "
                        "(want > 0 and none)")
    if not host.host_tokens or host.host_tokens != host.cached:
        problems.append(f"host hit: {host.host_tokens} of {host.cached} cached tokens came from the host tier "
                        "(want all of them, > 0): the device copy was not evicted")
    if problems:
        raise CheckFailed(f"{tag}: " + "; ".join(problems), 2)


def summarize(length: int, rounds: list[dict[str, Run]]) -> dict:
    row = dict(prompt_len=length, repeats=len(rounds))
    for name in VARIANTS:
        times = [r[name].seconds for r in rounds]
        row[name] = dict(median_s=statistics.median(times), min_s=min(times), max_s=max(times), runs_s=times,
                         cached_tokens=[r[name].cached for r in rounds],
                         host_tier_tokens=[r[name].host_tokens for r in rounds])
    tokens = [[r[name].token for name in VARIANTS] for r in rounds]
    row["first_tokens"] = tokens
    row["first_tokens_identical"] = all(len(set(t)) == 1 for t in tokens)
    row["hits_identical"] = all(t[1] == t[2] for t in tokens)
    return row


def print_table(rows: list[dict]) -> None:
    print("\n| prompt | recompute ms | device hit ms | host hit ms | host-tier tokens | host hit vs recompute "
          "| first tokens identical |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[v]['median_s'] * 1e3:.2f} ({r[v]['min_s'] * 1e3:.2f}-{r[v]['max_s'] * 1e3:.2f})"
                 for v in VARIANTS]
        speedup = r["recompute"]["median_s"] / r["host_hit"]["median_s"]
        print(f"| {r['prompt_len']} | {' | '.join(cells)} | {r['host_hit']['host_tier_tokens'][0]} | "
              f"{speedup:.1f}x | {r['first_tokens_identical']} |")


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    import jax

    from serve.engine.runner import backend_compile_count

    engine = build_engine(args)
    runner = engine.runner
    setup = time.perf_counter() - start
    compiles_after_setup = backend_compile_count()
    strict = jax.default_backend() == "cpu"
    cfg = runner.model_config
    print(f"{jax.devices()[0].device_kind}: {args.preset} x {args.layers} layers {cfg.layer_types}; setup "
          f"{setup:.1f}s (warm-up {runner.warm_up_seconds:.1f}s, {runner.num_executables} executables)", flush=True)
    rng = np.random.default_rng(args.seed)
    result = dict(args=vars(args), device=str(jax.devices()[0].device_kind), setup_s=setup,
                  warm_up_s=runner.warm_up_seconds, executables=runner.num_executables, rows=[], skipped=[])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "offload_ttft.json")

    def write(status: str) -> None:
        result["status"] = status
        result["compiles_after_setup"] = backend_compile_count() - compiles_after_setup
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    def past_deadline() -> bool:
        return args.deadline_s > 0 and time.perf_counter() - start > args.deadline_s

    try:
        for length in args.prompt_lens:
            if past_deadline():
                result["skipped"].append(dict(prompt_len=length, reason="deadline"))
                print(f"deadline {args.deadline_s}s passed: prompt length {length} skipped", flush=True)
                continue
            prompt = rng.integers(0, cfg.vocab_size, length).tolist()
            serve_three_ways(engine, prompt, f"warm-{length}")  # untimed: one-off costs, checked all the same
            rounds = []
            for i in range(args.repeats):
                if i and past_deadline():
                    result["skipped"].append(dict(prompt_len=length, repeats_done=i, reason="deadline"))
                    print(f"deadline {args.deadline_s}s passed: {length} stops after {i} repeats", flush=True)
                    break
                prompt = rng.integers(0, cfg.vocab_size, length).tolist()
                rounds.append(serve_three_ways(engine, prompt, f"p{length}-{i}"))
                row = summarize(length, rounds)
                result["rows"] = [r for r in result["rows"] if r["prompt_len"] != length] + [row]
                write("running")
            print(json.dumps({k: row[k] for k in ("prompt_len", "first_tokens_identical", "hits_identical")}
                             | {v: row[v]["median_s"] for v in VARIANTS}), flush=True)
            if strict and not row["first_tokens_identical"]:
                raise CheckFailed(f"prompt {length}: first tokens differ across the three ways on the CPU "
                                  f"reference path: {row['first_tokens']}", 3)
    except CheckFailed as e:
        print(f"FAILED: {e}", flush=True)
        write(f"failed: {e}")
        return e.code
    finally:
        empty_both_tiers(engine)
    print_table(result["rows"])
    write("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
