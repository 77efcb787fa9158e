"""Decode throughput and host overhead of the engine on a random model of a preset's shape (benchmark).

For each batch size B: B requests with random prompts are prefilled, then (all of them decoding) K engine
steps are timed. Reported per step: engine wall time, device time of the same compiled step launched back to
back with no host work (``ModelRunner.time_step``), the serial host work that leaves the device idle
(update + schedule + launch, and of the launch the executable call alone) and the host work overlapped with
the device (output processing), plus the
roofline: bytes a decode step must read (active weights, KDA state read + write, MLA latents) over the copy
bandwidth.

With ``--speculative-config`` (the server's JSON; ``dspark`` needs a drafter folder for this shape in its
``model``) the engine speculates: tok/s then counts every emitted token (accepted drafts included), and each row
adds the acceptance of its timed steps (mean acceptance length, rate per draft position) and how many of them
were verification steps. Speculation is off for batches of ``disable_by_batch_size`` or more, as when serving.

With ``--peer`` the transformers + FLA peer (:mod:`serve.bench.peer`) runs first, in a process of its own on
the same shape, batches and prompt length (its GPU memory is free again before ours is taken), and the table adds
its tok/s and our ratio to it.

    PYTHONPATH=. python3 -m serve.bench.decode --preset kimi-linear-48b --layers 4 --impl reference
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib

import numpy as np

COPY_BANDWIDTH = 4.3e12  # H200 measured copy bandwidth, bytes/s (spec SERVING.md 4.1)


def active_bytes(runner, batch: int, context: int) -> float:
    """Bytes one decode step of ``batch`` sequences of ``context`` tokens reads (expected distinct experts)."""
    cfg = runner.model_config
    sizes = dict(zip(runner.param_names, (p.nbytes for p in runner.params)))
    total = sum(sizes.values())
    expert = sum(b for name, b in sizes.items() if name.split(".")[0] == "moe" and name.split(".")[1][:2] in
                 ("w1", "w2", "w3"))
    embed = sizes.get("embed", 0)
    touched = 1.0 - (1.0 - cfg.num_experts_per_token / max(cfg.num_experts, 1)) ** batch
    weights = total - expert - embed + batch * embed / cfg.vocab_size + expert * touched
    plan = runner.plan
    state = 2 * batch * plan.bytes_per_slot
    latents = batch * context * plan.bytes_per_block / plan.block_size
    return weights + state + latents


def time_to_first_token(runner, cfg, args, rng, n: int) -> dict:
    """Seconds from add_request to the first sampled token of one prompt of ``n`` tokens on an idle engine (chunked
    by ``--prefill-chunk``), twice: the first run also pays one-off costs, the second is reported."""
    from serve.engine.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine.sampling_params import SamplingParams

    engine = LLMEngine(runner, config=EngineConfig(max_num_seqs=1, max_num_batched_tokens=args.prefill_chunk,
                                                   enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    seconds = []
    for attempt in range(2):
        prompt = rng.integers(0, cfg.vocab_size, n).tolist()
        start = time.perf_counter()
        engine.add_request(f"ttft-{attempt}", prompt, params)
        request = engine.scheduler.requests[f"ttft-{attempt}"]
        while request.num_output_tokens < 1:
            engine.step()
        seconds.append(time.perf_counter() - start)
        engine.abort_request(f"ttft-{attempt}")
        while engine.has_unfinished_requests():
            engine.step()
    return dict(prompt_len=n, chunk=args.prefill_chunk, first_run_s=seconds[0], ttft_s=seconds[1],
                prefill_tokens_per_s=n / seconds[1])


def _spec_counts(engine) -> tuple[int, int, list[int]]:
    """(verification rows with drafts, accepted drafts, accepted per position) so far; zeros without speculation."""
    s = engine.stats().spec_decode
    return (0, 0, []) if s is None else (s.num_drafts, s.num_accepted_tokens, list(s.accepted_per_pos))


def _acceptance(before: tuple, after: tuple) -> dict:
    """The acceptance of the steps between two ``_spec_counts``: mean acceptance length (1 + accepted drafts per
    row with drafts) and the acceptance rate per draft position."""
    rows, accepted = after[0] - before[0], after[1] - before[1]
    per_pos = [(b - a) / rows if rows else 0.0 for a, b in zip(before[2], after[2])]
    return dict(mean_acceptance_length=1.0 + accepted / rows if rows else 1.0, acceptance_per_position=per_pos)


def run_peer(args) -> dict:
    """The peer's run (:mod:`serve.bench.peer`) on the bench's shape in a child process: ``{batch: tok/s}`` under
    ``rows``, or the reason it gave none under ``error`` (a failed peer does not stop the bench)."""
    out = os.path.join(args.out, "peer")
    cmd = [sys.executable, "-m", "serve.bench.peer", "--preset", args.preset, "--layers", str(args.layers),
           "--batches", *map(str, args.batches), "--prompt-len", str(args.prompt_len), "--out", out]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout_s)
    except subprocess.TimeoutExpired:
        return dict(error=f"no result within {args.peer_timeout_s:.0f} s")
    if done.returncode != 0:
        return dict(error=f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-400:]}")
    with open(os.path.join(out, "bench_peer.json")) as f:
        report = json.load(f)
    return dict(rows={r["batch"]: r["tokens_per_s"] for r in report["rows"]}, kernels=report.get("kernels"),
                transformers=report.get("transformers"))


def main(argv: list[str] | None = None) -> None:
    from serve.engine.config import MXFP4_BYTE_ORDERS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="kimi-linear-48b")
    parser.add_argument("--layers", type=int, default=4, help="keep the preset's first N layers")
    parser.add_argument("--experts", type=int, default=0,
                        help="routed experts held (0: the preset's); e.g. 112 = K3's per-device share under EP8")
    parser.add_argument("--kda-split-v", type=int, default=-1,
                        help="KDA decode: split each state over programs of this many V columns (0: one fused "
                             "program per head; default: the tuned KDADecodeConfig.split_v)")
    parser.add_argument("--kda-fused-max-rows", type=int, default=-1,
                        help="KDA decode: steps with at most this many (sequence, value head) rows take the fused "
                             "one-launch kernel (default: the tuned KDADecodeConfig.fused_max_rows; 0: never)")
    parser.add_argument("--kda-mgpu-min-rows", type=int, default=-1,
                        help="KDA decode over fp32 state pools: steps with at least this many (sequence, value head) "
                             "rows take the Mosaic-GPU state update (default: the tuned "
                             "KDADecodeConfig.mgpu_min_rows; 0: never)")
    parser.add_argument("--kda-mgpu-one-launch", choices=("on", "off"), default=None,
                        help="KDA decode: the Mosaic-GPU path in one launch where H = HV (default: the tuned "
                             "KDADecodeConfig.mgpu_one_launch)")
    parser.add_argument("--skinny-rows", type=int, default=-1,
                        help="dense projections of steps with up to this many rows use the Pallas grouped GEMM "
                             "on the layer stack (0: XLA; default: kimi_jax.layers.common.SKINNY_MAX_ROWS)")
    parser.add_argument("--unabsorbed-min-rows", type=int, default=-1,
                        help="rows per sequence from which prefill steps take the un-absorbed MLA form "
                             "(kimi_jax.layers.mla.UNABSORBED_MIN_ROWS_PER_SEQ; 1000000: never, the A/B's base)")
    parser.add_argument("--fuse-shared-expert", action="store_true",
                        help="run the shared expert as one more row of the routed expert launches at decode "
                             "(kimi_jax.layers.ffn.FUSE_SHARED_EXPERT; bf16 experts without a latent projection)")
    parser.add_argument("--mxfp4-mgpu", action="store_true",
                        help="re-lay MXFP4 experts for the Mosaic-GPU decode kernel (kimi_jax.layers.ffn."
                             "use_mgpu_layout) before building the runner")
    parser.add_argument("--mxfp4-byte-order", choices=MXFP4_BYTE_ORDERS, default="auto",
                        help="EngineConfig.mxfp4_byte_order: MXFP4 experts as served (auto: the word order, or "
                             "pair halves where widths do not fit, under Pallas on a GPU; checkpoint: the loader's "
                             "order, the A/B's base)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--impl", default="reference")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64,
                        help="tokens per MLA page (default: the engine's GPU default, 64); multiples of 64 let long "
                             "decode steps take the Mosaic-GPU MLA kernel (16 was the earlier default)")
    parser.add_argument("--memory-gib", type=float, default=4.0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="> 0: sample (top_p 0.9), which takes the general step variant with the sampler's sort")
    parser.add_argument("--ttft-prompt-len", type=int, nargs="+", default=[],
                        help="also time the first token of one prompt of each of these lengths on an idle engine")
    parser.add_argument("--profile", action="store_true",
                        help="write jax.profiler traces of a few decode steps per batch under --out: the step "
                             "relaunched (trace_bN) and the engine loop (trace_engine_bN); and the step's "
                             "optimised HLO (step_hlo_bN.txt)")
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="add an XLA compile option to the engine's GPU executables (serve.engine.runner."
                             "GPU_COMPILER_OPTIONS), e.g. xla_gpu_autotune_level=0; repeatable")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding as `kimi-jax serve --speculative-config` takes it, e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    parser.add_argument("--repeat-span", type=int, default=0,
                        help="> 0: each prompt repeats a random span of this many tokens (n-gram lookup then finds "
                             "drafts); 0: random prompts")
    parser.add_argument("--peer", action="store_true",
                        help="first run the transformers + FLA peer on the same shape in its own process "
                             "(serve.bench.peer; Kimi-Linear presets, bf16) and add its tok/s to the table")
    parser.add_argument("--peer-timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    peer = None
    if args.peer:  # before this process takes any GPU memory
        peer = run_peer(args)
        print(f"peer: {json.dumps(peer)}", flush=True)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kimi_jax.layers import common
    from kimi_jax.model import KimiModel
    from kimi_jax.presets import get_preset
    from pallas_kernels import tuning
    from pallas_kernels.kda import KDADecodeConfig
    from serve.engine.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine import runner as runner_module
    from serve.engine.runner import ModelRunner
    from serve.engine.sampling_params import SamplingParams
    from serve.engine.spec_config import SpeculativeConfig
    from serve.bench.spec import repetition_prompts

    try:
        spec = None if args.speculative_config is None else SpeculativeConfig.from_json(args.speculative_config)
    except ValueError as e:
        parser.error(str(e))
    try:
        runner_module.add_gpu_compiler_options(args.xla_option)
    except ValueError as e:
        parser.error(str(e))

    tuning.override(KDADecodeConfig(split_v=args.kda_split_v if args.kda_split_v >= 0 else None,
                                    fused_max_rows=args.kda_fused_max_rows if args.kda_fused_max_rows >= 0 else None,
                                    mgpu_min_rows=args.kda_mgpu_min_rows if args.kda_mgpu_min_rows >= 0 else None,
                                    mgpu_one_launch=None if args.kda_mgpu_one_launch is None
                                    else args.kda_mgpu_one_launch == "on"))
    if args.skinny_rows >= 0:
        common.SKINNY_MAX_ROWS = args.skinny_rows
    if args.unabsorbed_min_rows >= 0:
        from kimi_jax.layers import mla

        mla.UNABSORBED_MIN_ROWS_PER_SEQ = args.unabsorbed_min_rows
    if args.fuse_shared_expert:
        from kimi_jax.layers import ffn

        ffn.FUSE_SHARED_EXPERT = True
    start = time.perf_counter()
    full = get_preset(args.preset)
    n = args.layers
    cfg = full.replace(num_layers=n, layer_types=full.layer_types[:n], mlp_types=full.mlp_types[:n],
                       num_experts=args.experts or full.num_experts)
    model = KimiModel(cfg, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    if args.mxfp4_mgpu and args.mxfp4_byte_order in ("pairs", "words"):
        parser.error(f"--mxfp4-byte-order {args.mxfp4_byte_order} and --mxfp4-mgpu are two layouts of the same "
                     "experts: pick one")
    if args.mxfp4_mgpu:
        from kimi_jax.layers.ffn import use_mgpu_layout

        use_mgpu_layout(model.moe)
    max_batch = max(args.batches)
    per_step = 1 + (spec.num_speculative_tokens if spec else 0)  # most tokens a step emits per request
    decode_tokens = per_step * (args.decode_steps + 4) + (max_batch * args.prompt_len) // args.prefill_chunk + 2
    max_model_len = args.prompt_len + decode_tokens + args.block_size

    def make_runner(max_len: int, seqs: tuple[int, ...], speculative: SpeculativeConfig | None) -> ModelRunner:
        """One page bucket (the longest request's pages), token bucket ``--prefill-chunk``, the given N buckets."""
        bs = args.block_size
        drafter = None
        if speculative is not None and speculative.method == "dspark":
            from kimi_jax.weights.drafter_io import load_drafter

            if speculative.model is None:
                parser.error("speculative_config.model: dspark needs a drafter folder for this model's shape")
            drafter = load_drafter(speculative.model, model)
        return ModelRunner(model, EngineConfig(
            max_model_len=max_len, max_num_seqs=max(seqs), max_num_batched_tokens=args.prefill_chunk,
            block_size=bs, enable_prefix_caching=False, token_buckets=(args.prefill_chunk,), seq_buckets=seqs,
            page_buckets=(-(-max_len // bs),), memory_budget_bytes=int(args.memory_gib * (1 << 30)),
            compile_threads=8, mxfp4_byte_order=args.mxfp4_byte_order, speculative_config=speculative),
            impl=args.impl, drafter=drafter)

    runner = make_runner(max_model_len, tuple(args.batches), spec)
    setup = time.perf_counter() - start
    print(f"{jax.devices()[0].device_kind}: {args.preset} x {n} layers {cfg.layer_types}, "
          f"{sum(p.nbytes for p in runner.params) / 1e9:.2f} GB params; setup {setup:.1f}s "
          f"(warm-up {runner.warm_up_seconds:.1f}s, {runner.num_executables} executables; largest step temporaries "
          f"{max(runner.step_temp_bytes.values()) / 1e9:.2f} GB)", flush=True)

    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batches:
        engine = LLMEngine(runner, config=EngineConfig(max_num_seqs=batch, max_num_batched_tokens=args.prefill_chunk,
                                                       enable_prefix_caching=False, speculative_config=spec))
        params = SamplingParams(temperature=args.temperature, top_p=0.9 if args.temperature else 1.0,
                                max_tokens=decode_tokens, ignore_eos=True, seed=0)
        if args.repeat_span:
            prompts = repetition_prompts(cfg.vocab_size, batch, args.prompt_len, args.repeat_span, seed=batch)
        else:
            prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(batch)]
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", prompts[i], params)
        requests = [engine.scheduler.requests[f"b{batch}-{i}"] for i in range(batch)]
        while not all(r.num_output_tokens >= 2 for r in requests):  # prefill done, every request decoding
            engine.step()
        engine.step()
        timings = []
        runner.launch_counts.clear()
        emitted_before = sum(r.num_output_tokens for r in requests)
        spec_before = _spec_counts(engine)
        t0 = time.perf_counter()
        calls = []
        for _ in range(args.decode_steps):
            engine.step()
            timings.append(engine.last_timing)
            calls.append(runner.last_call_seconds)
        wall = (time.perf_counter() - t0) / args.decode_steps
        emitted = (sum(r.num_output_tokens for r in requests) - emitted_before) / args.decode_steps
        acceptance = _acceptance(spec_before, _spec_counts(engine))
        digest = zlib.crc32(np.asarray([t for r in requests for t in r.output_token_ids], np.int64).tobytes())
        device = runner.time_step(args.decode_steps)
        if args.profile:  # the step relaunched back to back, then the engine's own loop
            with jax.profiler.trace(os.path.join(args.out, f"trace_b{batch}"), create_perfetto_trace=True):
                runner.time_step(3)
            with jax.profiler.trace(os.path.join(args.out, f"trace_engine_b{batch}"), create_perfetto_trace=True):
                for _ in range(4):
                    engine.step()
            with open(os.path.join(args.out, f"step_hlo_b{batch}.txt"), "w") as f:  # names the trace's kernels
                f.write(runner._last_launch[0].as_text())
        context = int(np.mean([r.num_tokens for r in requests]))
        roof = active_bytes(runner, batch, context) / COPY_BANDWIDTH
        serial = float(np.mean([t.update + t.schedule + t.launch for t in timings]))
        overlapped = float(np.mean([t.process for t in timings]))
        launch = float(np.mean([t.launch for t in timings]))
        greedy_launches = sum(n for key, n in runner.launch_counts.items() if key[4])
        ahead = float(np.mean([t.ahead for t in timings]))
        verify_launches = sum(n for key, n in runner.launch_counts.items() if len(key) == 6)
        spec_row = {} if spec is None else dict(tokens_per_step=emitted, verification_steps=verify_launches,
                                                **acceptance)
        rows.append(dict(batch=batch, tokens_per_s=emitted / wall, tokens_per_s_per_user=emitted / wall / batch,
                         step_ms=wall * 1e3, device_ms=device * 1e3,
                         host_serial_ms=serial * 1e3, launch_ms=launch * 1e3,
                         executable_call_ms=float(np.mean(calls)) * 1e3, host_overlapped_ms=overlapped * 1e3,
                         ahead_fraction=ahead, greedy_variant_launches=greedy_launches,
                         host_overhead=max(0.0, wall - device) / wall, roofline_ms=roof * 1e3,
                         roofline_tokens_per_s=batch / roof, fraction_of_roofline=roof / wall,
                         output_tokens_crc32=digest, **spec_row))
        print(json.dumps(rows[-1]), flush=True)
        for r in requests:
            engine.abort_request(r.request_id)
        while engine.has_unfinished_requests():
            engine.step()

    ttft = []
    if args.ttft_prompt_len:
        ttft_runner = make_runner(max(args.ttft_prompt_len) + args.block_size, (1,), None)
        for n in args.ttft_prompt_len:
            ttft.append(time_to_first_token(ttft_runner, cfg, args, rng, n))
            print(json.dumps(dict(ttft=ttft[-1])), flush=True)

    peer_rows = (peer or {}).get("rows", {})
    for r in rows:
        if r["batch"] in peer_rows:
            r["peer_tokens_per_s"] = peer_rows[r["batch"]]
    print("\n| batch | decode tok/s | step ms | device ms | host serial ms | host overlapped ms | host overhead "
          "| roofline ms | % of roofline | output crc32 | peer tok/s | x peer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        theirs = r.get("peer_tokens_per_s")
        print(f"| {r['batch']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | {r['device_ms']:.2f} | "
              f"{r['host_serial_ms']:.2f} | {r['host_overlapped_ms']:.2f} | {r['host_overhead']:.1%} | "
              f"{r['roofline_ms']:.3f} | {r['fraction_of_roofline']:.1%} | {r['output_tokens_crc32']:08x} | "
              + (f"{theirs:.1f} | {r['tokens_per_s'] / theirs:.1f}x |" if theirs else "- | - |"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump(dict(args=vars(args), setup_s=setup, warm_up_s=runner.warm_up_seconds, rows=rows, ttft=ttft,
                       peer=peer, step_temp_bytes={str(k): v for k, v in runner.step_temp_bytes.items()}), f,
                  indent=1)


if __name__ == "__main__":
    main()
