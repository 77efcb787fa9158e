"""Time one decode step of a model per layout, and how much of it the collectives take; write JSON.

    # two H200s (nvidia-h200-x2): TP2 against EP2 on the 4-layer K3 slice
    python -m sharding.experiments.decode_layouts --model k3-slice --layouts TP2,EP2 --batch 16 --context 4096 \\
        --out decode_layouts_h200x2.json
    # CPU, 8 simulated devices (the numbers say nothing about GPUs; the script is checked end to end)
    python -m sharding.experiments.decode_layouts --cpu-devices 8 --model tiny --layouts TP2,EP2,DCP2,TP4

Layout names: ``TPn`` (``--tensor-parallel-size n``), ``TEPn`` (the same with ``--enable-expert-parallel``),
``EPn`` (n ranks of the ``expert`` axis with the experts split over them: vLLM's ``--data-parallel-size n
--enable-expert-parallel``; attention replicated), ``DCPn`` (``--decode-context-parallel-size n``; alone it implies
``TPn``), joined by ``x`` (``TP4xDCP2``).

Per layout: the model (random weights, created directly in its shards) and a zeroed cache are placed on the first
devices, ``batch`` sequences of ``context`` cached tokens decode one token per step (pages striped over the DCP
ranks as the engine stripes them), and the jitted step (forward, LM head, argmax; cache donated) is timed over
``--steps`` launches after warm-up. Collective time comes from a profiler trace of ``--trace-steps`` launches: the
device time of events named after the step's collective HLO instructions (all-reduce, all-gather, all-to-all,
reduce-scatter, collective-permute, read from the compiled HLO) or of NCCL kernels, per device and step. The JSON
also carries the collectives' counts and bytes per step from the HLO, tokens/s, and whether every layout decoded
the same greedy tokens as the first one (bf16 on GPU: the sums' order differs between layouts, so a token can
differ where two logits nearly tie; ``max_logit_diff`` says by how much the logits moved).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time


def parse_layout(name: str):
    """``TP4xDCP2`` -> MeshShape."""
    from sharding.mesh import MeshShape

    tp = dcp = ep = 1
    expert_parallel = False
    for part in name.upper().split("X"):
        m = re.fullmatch(r"(TEP|TP|EP|DCP)(\d+)", part)
        if not m:
            raise ValueError(f"layout {name!r}: {part!r} is not TPn, TEPn, EPn or DCPn")
        kind, n = m.group(1), int(m.group(2))
        if kind in ("TP", "TEP"):
            tp, expert_parallel = n, expert_parallel or kind == "TEP"
        elif kind == "EP":
            ep, expert_parallel = n, True
        else:
            dcp = n
    tp = max(tp, dcp)
    if tp % dcp:
        raise ValueError(f"layout {name!r}: DCP{dcp} must divide TP{tp}")
    return MeshShape(tensor=tp // dcp, dcp=dcp, expert=ep, expert_parallel=expert_parallel)


def build_model(cfg, mesh, expert_parallel: bool, dtype, seed: int = 0):
    """A random model created directly in its shards on ``mesh`` (no whole copy on one device)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    from kimi_jax.model import KimiModel
    from sharding.mesh import MeshShape
    from sharding.place import param_specs, relayout_conv

    build = lambda: KimiModel(cfg, dtype=dtype, rngs=nnx.Rngs(seed))  # noqa: E731
    abstract = nnx.eval_shape(build)
    specs = param_specs(abstract, MeshShape.of(mesh, expert_parallel=expert_parallel))
    graphdef, state = nnx.split(abstract)
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    names = [".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path
                      if getattr(k, "name", None) != "value") for path, _ in paths]
    shardings = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state),
                                             [NamedSharding(mesh, specs[n]) for n in names])
    values = jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)()
    model = nnx.merge(graphdef, values)
    relayout_conv(model, MeshShape.of(mesh).tensor_parallel if mesh.size > 1 else 1)
    return model


def striped_tables(batch: int, pages: int, num_blocks: int, dcp: int):
    """Block tables [batch, pages]: page j of a sequence on DCP rank j % dcp (block 0 of each rank unused)."""
    import numpy as np

    per_rank = num_blocks // dcp
    j = np.arange(pages)
    local = 1 + np.arange(batch)[:, None] * (-(-pages // dcp)) + j[None, :] // dcp
    assert local.max() < per_rank, "cache too small for the tables"
    return ((j % dcp)[None, :] * per_rank + local).astype(np.int32)


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")


def hlo_collectives(hlo: str) -> tuple[dict[str, str], dict[str, dict]]:
    """(instruction name -> collective kind, kind -> {count, bytes}) from a compiled module's HLO text."""
    sizes = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1}
    names, stats = {}, {}
    pattern = re.compile(r"%?([\w.\-]+) = ([^=]*?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
    for line in hlo.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        name, shape, kind = m.group(1), m.group(2), m.group(3)
        names[name] = kind
        total = 0
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * sizes.get(dt, 4)
        entry = stats.setdefault(kind, dict(count=0, bytes=0))
        entry["count"] += 1
        entry["bytes"] += total
    return names, stats


def traced_collective_seconds(run_steps, collective_names: dict[str, str], steps: int, devices: int,
                              folder: str) -> tuple[float | None, str, float]:
    """(seconds per step and device spent in collectives, their source, wall seconds per traced step) from a
    perfetto trace of ``run_steps()``. The share of a step is taken against the traced step's own wall time:
    tracing slows the step, so the untraced median would overstate it."""
    import glob
    import gzip
    import json
    import shutil

    import jax

    shutil.rmtree(folder, ignore_errors=True)
    jax.profiler.start_trace(folder, create_perfetto_trace=True)
    try:
        start = time.perf_counter()
        run_steps()
        traced_step_s = (time.perf_counter() - start) / steps
    finally:
        jax.profiler.stop_trace()
    files = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return None, "no trace", traced_step_s
    with gzip.open(files[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    by_op = by_nccl = 0.0
    for e in events:
        if "dur" not in e:
            continue
        name = str(e.get("name", ""))
        base = name.split(":")[-1].strip()
        if base in collective_names or base.replace("-done", "-start") in collective_names:
            by_op += float(e["dur"])
        elif "nccl" in name.lower():
            by_nccl += float(e["dur"])
    micros, source = (by_nccl, "nccl kernels") if by_nccl else (by_op, "collective ops")
    return micros * 1e-6 / (steps * devices), source, traced_step_s


def run_layout(name: str, args, cfg, dtype) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from kimi_jax.model import compute_logits, forward, use_serving_byte_order
    from kimi_jax.step import StepInputs
    from pallas_kernels.impl import resolve_impl
    from sharding.mesh import make_mesh
    from sharding.parallel import parallel_for
    from sharding.place import zero_cache

    shape = parse_layout(name)
    mesh = make_mesh(shape)
    model = build_model(cfg, mesh, shape.expert_parallel, dtype)
    fast = jax.default_backend() == "gpu" and resolve_impl(args.impl) == "pallas"
    order = use_serving_byte_order(model, args.mxfp4_byte_order, fast_kernels=fast,
                                   width_shards=1 if shape.expert_parallel else shape.tensor_parallel)
    parallel = parallel_for(mesh, expert_parallel=shape.expert_parallel, capacity_factor=args.capacity_factor)
    pages = -(-(args.context + args.steps + args.trace_steps + 4) // args.block_size)
    per_rank = 1 + args.batch * -(-pages // shape.dcp)
    num_blocks = per_rank * shape.dcp
    cache = zero_cache(cfg, mesh, num_blocks=num_blocks, block_size=args.block_size, num_slots=args.batch + 1,
                       dtype=dtype)
    tables = striped_tables(args.batch, pages, num_blocks, shape.dcp)
    graphdef, state = nnx.split(model)
    impl = args.impl

    def step_fn(state, cache, tokens, context):
        m = nnx.merge(graphdef, state)
        n = tokens.shape[0]
        step = StepInputs(token_ids=tokens, cu_seqlens=jnp.arange(n + 1, dtype=jnp.int32), context_lens=context,
                          block_tables=jnp.asarray(tables), state_slots=jnp.arange(1, n + 1, dtype=jnp.int32),
                          logits_indices=jnp.arange(n, dtype=jnp.int32),
                          checkpoint_positions=jnp.full((n, 0), -1, jnp.int32),
                          checkpoint_slots=jnp.zeros((n, 0), jnp.int32), decode_only=True)
        hidden, cache = forward(m, cache, step, impl=impl, parallel=parallel)
        logits = compute_logits(m, hidden)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, cache

    jitted = jax.jit(step_fn, donate_argnums=(1,))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, args.batch), jnp.int32)
    context = np.full(args.batch, args.context, np.int32)
    compiled = jitted.lower(state, cache, tokens, context).compile()
    names, stats = hlo_collectives(compiled.as_text())
    decoded, first_logits = [], None
    position = [args.context]

    def launch(n: int):
        nonlocal cache, tokens
        for _ in range(n):
            tokens, logits, cache = compiled(state, cache, tokens, np.full(args.batch, position[0], np.int32))
            position[0] += 1
        return logits

    for _ in range(args.check_tokens):  # the greedy tokens every layout must agree on (also the warm-up)
        logits = launch(1)
        if first_logits is None:
            first_logits = np.asarray(logits, np.float32)
        decoded.append(np.asarray(tokens).tolist())
    jax.block_until_ready(cache)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        launch(1)
        jax.block_until_ready(tokens)
        times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    collective_s, source, traced_step_s = traced_collective_seconds(lambda: jax.block_until_ready(launch(args.trace_steps)),
                                                     names, args.trace_steps, mesh.size,
                                                     os.path.join(args.trace_dir, name))
    return dict(layout=name, mesh=shape.label(), devices=mesh.size, impl=resolve_impl(impl), mxfp4_byte_order=order,
                device_kind=mesh.devices.flat[0].device_kind, batch=args.batch, context=args.context,
                step_ms=step_s * 1e3, step_ms_p10_p90=[float(np.percentile(times, q)) * 1e3 for q in (10, 90)],
                tokens_per_s=args.batch / step_s,
                collective_ms=None if collective_s is None else collective_s * 1e3,
                collective_share=None if collective_s is None else collective_s / traced_step_s,
                collective_source=source, collectives_per_step=stats, greedy_tokens=decoded,
                first_logits=first_logits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sharding.experiments.decode_layouts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="k3-slice",
                        help="a preset name, or a folder with a config.json (random weights either way)")
    parser.add_argument("--layouts", default="TP2,EP2", help="comma-separated layout names (see above)")
    parser.add_argument("--batch", type=int, default=16, help="sequences decoding together")
    parser.add_argument("--context", type=int, default=4096, help="cached tokens per sequence")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per MLA page (default 64 GPU, 16 CPU)")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per layout")
    parser.add_argument("--trace-steps", type=int, default=5, help="decode steps under the profiler")
    parser.add_argument("--check-tokens", type=int, default=4, help="greedy steps compared across layouts")
    parser.add_argument("--dtype", default=None, help="parameter dtype (default bfloat16 GPU, float32 CPU)")
    parser.add_argument("--impl", default=None, help="op implementation (default: pallas on GPU, reference CPU)")
    parser.add_argument("--capacity-factor", type=float, default=None, help="EP dispatch capacity (None: exact)")
    parser.add_argument("--mxfp4-byte-order", default="auto", help="as the engine's flag (auto: the kernels' order)")
    parser.add_argument("--cpu-devices", type=int, default=None, help="simulate this many CPU devices")
    parser.add_argument("--trace-dir", default="/tmp/kimi_jax_decode_layouts", help="profiler traces")
    parser.add_argument("--out", default="decode_layouts.json", help="JSON results")
    args = parser.parse_args(argv)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}")
        os.environ["JAX_PLATFORMS"] = "cpu"
    import json

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kimi_jax.presets import get_preset

    gpu = jax.default_backend() == "gpu"
    args.block_size = args.block_size or (64 if gpu else 16)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    from kimi_jax.config import ModelConfig

    if os.path.isdir(args.model):
        cfg = ModelConfig.from_json_file(os.path.join(args.model, "config.json"))
    else:
        cfg = get_preset(args.model)
    results = []
    for name in args.layouts.split(","):
        print(f"[decode_layouts] {name} ...", file=sys.stderr, flush=True)
        results.append(run_layout(name.strip(), args, cfg, dtype))
        r = results[-1]
        share = "n/a" if r["collective_share"] is None else f"{100 * r['collective_share']:.1f}%"
        print(f"[decode_layouts] {name}: {r['step_ms']:.3f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
              f"collectives {share} ({r['collective_source']})", file=sys.stderr, flush=True)
    first = results[0]
    for r in results:
        r["tokens_equal_to_first"] = r["greedy_tokens"] == first["greedy_tokens"]
        scale = float(np.abs(first["first_logits"]).max())
        r["max_logit_diff"] = float(np.abs(r["first_logits"] - first["first_logits"]).max() / scale)
    for r in results:
        del r["first_logits"]
    with open(args.out, "w") as f:
        json.dump(dict(model=args.model, dtype=str(dtype), backend=jax.default_backend(), results=results), f,
                  indent=1)
    print(json.dumps([{k: r[k] for k in ("layout", "step_ms", "tokens_per_s", "collective_share",
                                         "tokens_equal_to_first", "max_logit_diff")} for r in results]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
