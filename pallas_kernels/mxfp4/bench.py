"""H200 benchmark: MXFP4 grouped W4A16 GEMM vs bf16 grouped GEMMs at Kimi K3 expert shapes.

Run: ``PYTHONPATH=. python3 pallas_kernels/mxfp4/bench.py`` (JSON to ``$OUT/mxfp4_bench.json``;
``BENCH_SUITE=decode`` for the decode-sized cases only; ``BENCH_SUITE=pairs`` for the K3 decode cases and one
8K-token prefill case in the checkpoint byte order against the pair-halves order, no bf16; ``BENCH_SUITE=mgpu``
for the K3 decode cases and the 8K-token prefill case through the Mosaic-GPU kernel (``decode_mgpu.py``,
``MGPU_CFGS`` / ``MGPU_PREFILL_CFGS``) against the Triton kernel's default tiling in both byte orders).
Rows per step: T tokens x top-16 routing over 896 experts, counted on E local experts (uniform random routing),
so ``M ~= T * 16 * E / 896``. Roofline bytes = packed + scale bytes of the experts that received a row.
Measures the copy bandwidth and the bf16 matmul rate in the same process. Each case times a short tiling sweep
per format (``SWEEPS``) plus ``tile_config``'s default, and the same tilings on the pair-halves byte order
(``mxfp4_pairs``, :func:`pallas_kernels.mxfp4.quant.to_pair_halves`; its inline-PTX decode, and ``mxfp4_pairs_jnp``
with the jnp decode) and the word order (``mxfp4_words``, :func:`pallas_kernels.mxfp4.quant.to_word_order`, with narrow
scales where they are; x-as-A tilings only); past ``BENCH_DEADLINE_S`` only the defaults. Then
Kimi-Linear's per-row expert GEMMs at batch-1 decode (pipeline depth). The JSON is rewritten after every case.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bench_checks
from pallas_kernels.bench_timing import copy_bandwidth, kernel_split_us, timed
from pallas_kernels.mxfp4.config import GroupedGemmConfig, MXFP4MGPUConfig
from pallas_kernels.mxfp4.decode_mgpu import mxfp4_grouped_matmul_mgpu, prepare_weights
from pallas_kernels.mxfp4.kernel import (
    grouped_gemm_concat_pallas,
    grouped_gemm_pallas,
    scales_are_narrow,
)
from pallas_kernels.mxfp4.ops import tile_config
from pallas_kernels.mxfp4.quant import to_pair_halves, to_word_order
from pallas_kernels.mxfp4.reference import (
    grouped_matmul_reference,
    mxfp4_grouped_matmul_reference,
)

TOTAL_EXPERTS, TOP_K, LATENT, WIDTH = 896, 16, 3584, 3072
REPS = 8
DEADLINE_S = float(os.environ.get("BENCH_DEADLINE_S", 230))
SUITE = os.environ.get("BENCH_SUITE", "full")  # "decode": decode-sized cases only; "pairs": K3 decode, MXFP4 only
MGPU_CFGS = {f"k{bk}s{st}m{bm}w{wgs}": dict(block_k=bk, stages=st, block_m=bm, wgs=wgs)
             for bk, st, bm, wgs in ((256, 4, 16, 1), (256, 6, 16, 1), (512, 3, 16, 1), (512, 4, 16, 1),
                                     (256, 4, 8, 1), (512, 4, 8, 1), (256, 4, 16, 2), (256, 4, 8, 2), (512, 3, 8, 2))}
"""Mosaic-GPU decode kernel configs: K columns per pipeline step, shared-memory stages, rows per tile, compute
warpgroups per CTA (64 output columns each)."""
MGPU_PREFILL_CFGS = {f"k{bk}s{st}m{bm}w{wgs}": dict(block_k=bk, stages=st, block_m=bm, wgs=wgs)
                     for bk, st, bm, wgs in ((64, 4, 128, 1), (128, 3, 256, 1), (64, 4, 128, 2), (64, 4, 256, 2),
                                             (128, 3, 256, 2))}
"""The same kernel at prefill row counts (one decoded weight tile shared by 128 or 256 rows)."""
START = time.time()

ALL_CFGS = {
    "m16n64k256w4s4": dict(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4),
    "m16n128k256w4s4": dict(block_m=16, block_n=128, block_k=256, num_warps=4, num_stages=4),
    "m16n64k128w4s4L": dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, weights_lhs=True),
    "m16n128k256w8s3L": dict(block_m=16, block_n=128, block_k=256, num_warps=8, num_stages=3, weights_lhs=True),
    "m16n32k512w4s3": dict(block_m=16, block_n=32, block_k=512, num_warps=4, num_stages=3),
    "m64n128k64w4s3": dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
    "m128n128k64w8s3": dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    "m128n256k64w8s3": dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
    "m64n128k128w8s4": dict(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=4),
    # split-K (decode: a few experts' tiles alone cannot fill 132 SMs)
    "m16n64k128w4s4L_k2": dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, weights_lhs=True,
                               split_k=2),
    "m16n64k128w4s4L_k3": dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, weights_lhs=True,
                               split_k=3),
    "m16n64k128w4s4L_k4": dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, weights_lhs=True,
                               split_k=4),
    "m16n128k128w4s4_k2": dict(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, split_k=2),
    "m16n128k128w4s4_k4": dict(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, split_k=4),
}
# Tilings swept per format and regime (plus tile_config's default): the configs that won, or came within 5%,
# somewhere in a full 9-config sweep (BENCHMARKS.md, MXFP4 grouped GEMM; kept short so the whole grid fits one
# call).
SWEEPS = {
    ("decode", "mxfp4"): ("m16n64k256w4s4", "m16n32k512w4s3", "m16n64k128w4s4L", "m16n64k128w4s4L_k2",
                          "m16n64k128w4s4L_k3", "m16n64k128w4s4L_k4"),
    ("decode", "bf16"): ("m16n128k256w4s4", "m16n128k256w8s3L", "m16n64k128w4s4L", "m16n64k128w4s4L_k2",
                         "m16n64k128w4s4L_k3", "m16n128k128w4s4_k2", "m16n128k128w4s4_k4"),
    ("prefill", "mxfp4"): ("m64n128k64w4s3", "m128n256k64w8s3"),
    ("prefill", "bf16"): ("m64n128k64w4s3", "m128n128k64w8s3", "m128n256k64w8s3"),
    ("down", "mxfp4"): (),
    ("down", "bf16"): (),
}
DECODE_CFGS = {name: ALL_CFGS[name] for name in SWEEPS[("decode", "mxfp4")][:3]}  # dense probe
CHECKED_CFGS = {name: ALL_CFGS[name] for names in SWEEPS.values() for name in names}


def matmul_rate(m=8192, n=6144, k=3584):
    a = jnp.ones((REPS, m, k), jnp.bfloat16)
    b = jnp.ones((k, n), jnp.bfloat16)
    return 2 * m * n * k / timed(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
                                 (a, b))


def route(tokens, experts, rng, total=TOTAL_EXPERTS, top_k=TOP_K):
    """Local group sizes for ``tokens`` routed top-k of ``total`` experts, uniformly at random."""
    picks = np.argsort(rng.random((tokens, total)), axis=1)[:, :top_k]
    return np.bincount(picks.ravel(), minlength=total)[:experts].astype(np.int32)


def random_mxfp4(rng, experts, n, k):
    key = jax.random.key(int(rng.integers(1 << 30)))
    packed = jax.random.bits(key, (experts, n, k // 2), jnp.uint8)
    scales = jax.random.randint(key, (experts, n, k // 32), 118, 124).astype(jnp.uint8)
    return packed, scales


def random_bf16(rng, shape):
    return jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), shape, jnp.bfloat16)


def check_tolerance(path: str) -> float | None:
    """Per-row relative error bound of a check (the tests' 1e-2: exact decodes, bf16 output rounding); None for
    JAX's own Mosaic-GPU ragged dot, which is compared, not checked."""
    return None if path.startswith("bf16/mgpu_") else 1e-2


def check_correctness(rng):
    """Every config vs the float32 reference on a small ragged problem (zero groups, all codes, wide scales)."""
    results = {}
    e, n, k, m = 6, 256, 1536, 300  # K: 3, 6 or 12 steps of every swept block_k, so every split_k divides
    packed, scales = random_mxfp4(rng, e, n, k)
    scales = scales.at[0].set(jnp.asarray(rng.integers(0, 3, (n, k // 32)), jnp.uint8))  # 2**-127 .. 2**-125
    scales = scales.at[1].set(jnp.asarray(rng.integers(230, 236, (n, k // 32)), jnp.uint8))
    gs = jnp.array([40, 37, 0, 150, 0, 60], jnp.int32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    row_scale = jnp.where(jnp.arange(m) < 40, 2.0 ** 100, jnp.where(jnp.arange(m) < 77, 2.0 ** -100, 1.0))
    x = (x * row_scale[:, None]).astype(jnp.bfloat16)
    want = np.asarray(mxfp4_grouped_matmul_reference(x, packed, scales, gs), np.float32)
    w16 = jnp.asarray(rng.standard_normal((e, k, n)), jnp.bfloat16)
    want16 = np.asarray(grouped_matmul_reference(x[77:], w16, gs.at[:2].set(0)), np.float32)

    def rel(got, ref):  # per-row relative error (rows span 2**-100 .. 2**100)
        got = np.asarray(got, np.float32)
        return float(np.max(np.abs(got - ref).max(1) / np.maximum(np.abs(ref).max(1), 1e-30)))

    pairs, words = to_pair_halves(packed), to_word_order(packed)
    narrow = jnp.minimum(scales, 128)  # experts 0 and 2-5 as they are, expert 1's scales cut to 2**1
    want_narrow = np.asarray(mxfp4_grouped_matmul_reference(x, packed, narrow, gs), np.float32)
    checked = CHECKED_CFGS if SUITE != "mgpu" else {  # the Triton tilings the mgpu suite times
        name: ALL_CFGS[name] for name in ("m16n64k128w4s4L", "m16n64k256w4s4", "m128n256k64w8s3")}
    for name, cfg in checked.items():
        config = GroupedGemmConfig(**cfg)
        results[f"mxfp4/{name}"] = rel(grouped_gemm_pallas(x, (packed, scales), gs, weight_format="mxfp4",
                                                           config=config), want)
        results[f"mxfp4_pairs/{name}"] = rel(grouped_gemm_pallas(x, (pairs, scales), gs, weight_format="mxfp4_pairs",
                                                                 config=config), want)
        if words_tiling(cfg):
            results[f"mxfp4_words/{name}"] = rel(grouped_gemm_pallas(x, (words, scales), gs,
                                                                     weight_format="mxfp4_words", config=config), want)
            results[f"mxfp4_words_narrow/{name}"] = rel(grouped_gemm_pallas(  # the folded decode, codes <= 128
                x, (words, narrow), gs, weight_format="mxfp4_words", narrow_scales=True, config=config), want_narrow)
        if SUITE == "mgpu":
            continue
        results[f"mxfp4_pairs_jnp/{name}"] = rel(grouped_gemm_pallas(
            x, (pairs, scales), gs, weight_format="mxfp4_pairs_jnp", config=config), want)
        results[f"bf16/{name}"] = rel(grouped_gemm_pallas(x[77:], (w16,), gs.at[:2].set(0), weight_format="bf16",
                                                          config=config), want16)
    for name, fn in (mgpu_variants() if SUITE != "mgpu" else {}).items():
        try:
            results[f"bf16/{name}"] = rel(fn(x[77:], w16, gs.at[:2].set(0)), want16)
        except Exception as err:  # noqa: BLE001 - report and go on
            results[f"bf16/{name}"] = f"error: {type(err).__name__}: {str(err)[:200]}"
    prepared = prepare_weights(packed, scales)
    for name, cfg in {**MGPU_CFGS, **MGPU_PREFILL_CFGS}.items():
        try:
            results[f"mxfp4_mgpu/{name}"] = rel(mxfp4_grouped_matmul_mgpu(x, [prepared], gs,
                                                                          config=MXFP4MGPUConfig(**cfg)), want)
        except Exception as err:  # noqa: BLE001 - report and go on
            results[f"mxfp4_mgpu/{name}"] = f"error: {type(err).__name__}: {str(err)[:200]}"
    return results


def words_tiling(cfg):
    """Whether the word order runs at tiling ``cfg``: x as the MMA's A operand and 128-column K steps."""
    return not cfg.get("weights_lhs") and cfg["block_k"] % 128 == 0


def mgpu_variants():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    out = {}
    for bm, bn, bk in ((64, 128, 64), (128, 128, 64)):
        def fn(x, w, gs, bm=bm, bn=bn, bk=bk):  # the kernel needs M < 8 or a multiple of 8: pad rows
            xp = jnp.pad(x, ((0, -x.shape[0] % 8), (0, 0)))
            return ragged_dot_mgpu.ragged_dot(xp, w, group_sizes=gs, block_m=bm, block_n=bn, block_k=bk,
                                              max_concurrent_steps=4, grid_block_n=1)[:x.shape[0]]
        out[f"mgpu_m{bm}n{bn}k{bk}"] = fn
    return out


def with_default(names, default):
    """{name: cfg} of the swept names plus tile_config's ``default`` (a swept config equal to it is renamed
    ``name=default`` instead of being compiled twice)."""
    cfgs = {}
    for name in names:
        same = ALL_CFGS[name] == {**ALL_CFGS[name], **default} and len(ALL_CFGS[name]) == len(default)
        cfgs[f"{name}=default" if same else name] = ALL_CFGS[name]
    if not any(name.endswith("default") for name in cfgs):
        cfgs["default"] = default
    return cfgs


def past_deadline(name):
    """Past BENCH_DEADLINE_S only the default tiling is still timed (every case keeps one number)."""
    return time.time() - START > DEADLINE_S and not name.endswith("default")


def bench_case(rng, tokens, experts, n, k, regime, record, total=TOTAL_EXPERTS, top_k=TOP_K):
    gs_np = route(tokens, experts, rng, total, top_k)
    m = max(int(gs_np.sum()), 1)
    gs = jnp.asarray(gs_np)
    touched = int((gs_np > 0).sum())
    wbytes = touched * n * k * (0.5 + 1 / 32)
    flops = 2 * m * n * k
    xs = random_bf16(rng, (REPS, m, k))
    packed, scales = random_mxfp4(rng, experts, n, k)
    case = dict(tokens=tokens, experts=experts, rows=m, experts_touched=touched, n=n, k=k,
                weight_bytes_mxfp4=wbytes, weight_bytes_bf16=touched * n * k * 2, flops=flops, mxfp4={},
                mxfp4_pairs={}, mxfp4_pairs_jnp={}, mxfp4_words={}, bf16={}, mxfp4_mgpu={})
    pairs, words = to_pair_halves(packed), to_word_order(packed)
    narrow = dict(narrow_scales=True) if scales_are_narrow(scales) else {}
    mgpu_suite_cfgs = {}
    if SUITE == "mgpu":  # the Triton kernel's default tiling per byte order (and the old best pair-halves one) only
        if regime == "decode":
            mgpu_suite_cfgs["m16n64k256w4s4"] = ALL_CFGS["m16n64k256w4s4"]
        prepared = prepare_weights(packed, scales)
        for name, cfg in (MGPU_CFGS if regime == "decode" else MGPU_PREFILL_CFGS).items():
            try:
                case["mxfp4_mgpu"][name] = timed(lambda x, p, s, g, cfg=cfg: mxfp4_grouped_matmul_mgpu(
                    x, [(p, s)], g, config=MXFP4MGPUConfig(**cfg)), (xs, *prepared, gs))
            except Exception as err:  # noqa: BLE001
                case["mxfp4_mgpu"][name] = f"error: {type(err).__name__}: {str(err)[:200]}"
        del prepared
    for fmt, weights in (("mxfp4", packed), ("mxfp4_pairs", pairs), ("mxfp4_pairs_jnp", pairs),
                         ("mxfp4_words", words)):
        if SUITE == "mgpu" and fmt in ("mxfp4_pairs_jnp", "mxfp4_words"):
            continue
        extra = narrow if fmt == "mxfp4_words" else {}
        default = tile_config(m, experts, n, k, fmt)  # each format's own default tiling
        fmt_cfgs = ({**mgpu_suite_cfgs, "default": default} if SUITE == "mgpu"
                    else with_default(SWEEPS[(regime, "mxfp4")], default))
        for name, cfg in fmt_cfgs.items():
            if past_deadline(name) or (fmt == "mxfp4_words" and not words_tiling(cfg)):
                continue
            try:
                case[fmt][name] = timed(lambda x, p, s, g, cfg=cfg, fmt=fmt, extra=extra: grouped_gemm_pallas(
                    x, (p, s), g, weight_format=fmt, config=GroupedGemmConfig(**cfg), **extra),
                    (xs, weights, scales, gs))
            except Exception as err:  # noqa: BLE001
                case[fmt][name] = f"error: {type(err).__name__}: {str(err)[:200]}"
    del packed, scales, weights, pairs, words
    if SUITE in ("pairs", "mgpu"):
        record.append(case)
        return case
    w16 = random_bf16(rng, (experts, k, n))
    bf16_variants = {f"pallas_{name}": (lambda x, w, g, cfg=cfg: grouped_gemm_pallas(
        x, (w,), g, weight_format="bf16", config=GroupedGemmConfig(**cfg))) for name, cfg in with_default(
        SWEEPS[(regime, "bf16")], tile_config(m, experts, n, k, "bf16")).items()}
    if m < 8 or m % 8 == 0:  # ragged_dot_mgpu rejects other row counts
        bf16_variants.update(mgpu_variants())
    for name, fn in bf16_variants.items():
        if past_deadline(name):
            continue
        try:
            case["bf16"][name] = timed(fn, (xs, w16, gs))
        except Exception as err:  # noqa: BLE001
            case["bf16"][name] = f"error: {type(err).__name__}: {str(err)[:200]}"
    record.append(case)
    return case


def best(d):
    ok = {k: v for k, v in d.items() if isinstance(v, float)}
    return min(ok.items(), key=lambda kv: kv[1]) if ok else ("-", float("nan"))


def dense_case(rng):
    """Dense W4A16 at the spec's probe shape (M=64, K=7168, N=2048) vs bf16 weights and XLA dequant+dot."""
    from pallas_kernels.mxfp4.quant import dequantize
    m, k, n = 64, 7168, 2048
    xs = random_bf16(rng, (REPS, m, k))
    packed, scales = random_mxfp4(rng, 1, n, k)
    gs = jnp.array([m], jnp.int32)
    out = {}
    for name, cfg in DECODE_CFGS.items():
        out[f"pallas_{name}"] = timed(lambda x, p, s, g, cfg=cfg: grouped_gemm_pallas(
            x, (p, s), g, weight_format="mxfp4", config=GroupedGemmConfig(**cfg)), (xs, packed, scales, gs))
    out["xla_dequant_dot"] = timed(lambda x, p, s: jnp.dot(x, dequantize(p[0], s[0], jnp.bfloat16).T,
                                                           preferred_element_type=jnp.float32).astype(x.dtype),
                                   (xs, packed, scales))
    w = random_bf16(rng, (k, n))
    out["bf16_xla_dot"] = timed(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
                                (xs, w))
    out["weight_bytes_mxfp4"] = n * k * (0.5 + 1 / 32)
    return out


PER_ROW_LAUNCHES = 6  # launches per timed call, each on other experts: more weight bytes than the L2 holds


def per_row_case(name, widths, k, record):
    """Kimi-Linear's routed experts at batch-1 decode as the engine runs them: 8 (token, choice) rows, each its own
    expert (``per_row``), bf16. tile_config's pick against 3 and 4 pipeline stages; profiler device time per
    launch, copy-bandwidth share of the 8 experts' bytes."""
    key = jax.random.key(k)
    x = jax.random.normal(key, (1, k), jnp.bfloat16)
    weights = tuple((jax.random.normal(jax.random.fold_in(key, i), (256, k, n), jnp.bfloat16) * 0.02,)
                    for i, n in enumerate(widths))
    experts = [(jnp.arange(8, dtype=jnp.int32) * 5 + 41 * i) % 256 for i in range(PER_ROW_LAUNCHES)]
    default = tile_config(8, 8, sum(widths), k, "bf16", tuple(widths))
    row = dict(case=name, n=list(widths), k=k, weight_bytes=8 * k * sum(widths) * 2, default=default)
    for label, cfg in (("default", default), ("stages3", {**default, "num_stages": 3}),
                       ("stages4", {**default, "num_stages": 4})):
        def launches(x, weights, experts, cfg=tuple(cfg.items())):
            return [grouped_gemm_concat_pallas(x, weights, e, 0, weight_format="bf16", per_row=True,
                                               config=GroupedGemmConfig(**dict(cfg))) for e in experts]
        row[f"{label}_us"] = sum(kernel_split_us(jax.jit(launches), (x, weights, experts), 10).values()) / len(experts)
    record.append(row)
    print(row, flush=True)


def main():
    rng = np.random.default_rng(0)
    result = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    result["copy_bandwidth_Bps"] = copy_bandwidth()
    result["bf16_matmul_flops"] = matmul_rate()
    print(f"copy {result['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 matmul {result['bf16_matmul_flops'] / 1e12:.0f}"
          " TFLOP/s", flush=True)
    result["correctness_rel_err"], failures = bench_checks.run(check_correctness, rng)
    failures += bench_checks.over(result["correctness_rel_err"], check_tolerance)
    print(json.dumps(result["correctness_rel_err"], indent=0), flush=True)
    out_dir = os.environ.get("OUT", ".")

    def save():
        result["elapsed_s"] = time.time() - START
        with open(os.path.join(out_dir, "mxfp4_bench.json"), "w") as f:
            json.dump(result, f, indent=1)

    save()
    decode_only = SUITE in ("decode", "pairs", "mgpu")
    if not decode_only:
        try:
            result["dense_m64_k7168_n2048_s"] = dense_case(rng)
        except Exception as err:  # noqa: BLE001 - the grouped grid matters more
            result["dense_m64_k7168_n2048_s"] = f"error: {type(err).__name__}: {str(err)[:200]}"
        print(json.dumps(result["dense_m64_k7168_n2048_s"], indent=0), flush=True)
    cases = result["grouped"] = []
    plan = [(t, 56, "decode") for t in (1, 8, 64, 256)] + [(256, 112, "decode")]
    if not decode_only:
        plan += [(t, 56, "prefill") for t in (1024, 8192)] + [(8192, 112, "prefill")]
    elif SUITE in ("pairs", "mgpu"):  # one prefill case: the decode's instructions per weight bound the MMA too
        plan += [(8192, 56, "prefill")]
    for tokens, experts, regime in plan:  # gate+up fused: N = 2 * 3072, K = 3584
        bench_case(rng, tokens, experts, 2 * WIDTH, LATENT, regime, cases)
        save()
        print(f"done T={tokens} E={experts} at {time.time() - START:.0f}s", flush=True)
    if SUITE not in ("pairs", "mgpu"):
        for tokens in (64,) if decode_only else (64, 8192):  # down projection: N = 3584, K = 3072
            bench_case(rng, tokens, 56, LATENT, WIDTH, "down", cases)
            save()
        for tokens in (1, 16, 64):  # Kimi-Linear-48B experts as the engine calls them: w1 / w3 N=1024, K=2304
            bench_case(rng, tokens, 256, 1024, 2304, "decode", cases, total=256, top_k=8)
            save()
        per_row = result["per_row_decode"] = []
        per_row_case("Kimi-Linear w1+w3, 8 rows", (1024, 1024), 2304, per_row)
        per_row_case("Kimi-Linear w2, 8 rows", (2304,), 1024, per_row)
        save()
    bw, rate = result["copy_bandwidth_Bps"], result["bf16_matmul_flops"]
    print(f"\n{'T':>5} {'E':>4} {'M':>5} {'N':>5} {'K':>5} | {'mxfp4 us':>9} {'%copyBW':>7} {'%bf16mm':>7} "
          f"{'cfg':>18} | {'pairs us':>8} {'%copyBW':>7} {'cfg':>18} | {'words us':>8} {'%copyBW':>7} "
          f"{'%bf16mm':>7} {'cfg':>18} | {'mgpu us':>8} {'%copyBW':>7} {'cfg':>7} | {'bf16 us':>8} {'cfg':>18} | "
          f"{'speedup':>7}")
    for c in cases:
        (mn, mt), (pn, pt), (wn, wt), (gn, gt), (bn_, bt) = (
            best(c["mxfp4"]), best(c["mxfp4_pairs"]), best(c["mxfp4_words"]), best(c["mxfp4_mgpu"]), best(c["bf16"]))
        print(f"{c['tokens']:>5} {c['experts']:>4} {c['rows']:>5} {c['n']:>5} {c['k']:>5} | {mt * 1e6:>9.1f} "
              f"{100 * c['weight_bytes_mxfp4'] / mt / bw:>6.0f}% {100 * c['flops'] / mt / rate:>6.0f}% {mn:>18} | "
              f"{pt * 1e6:>8.1f} {100 * c['weight_bytes_mxfp4'] / pt / bw:>6.0f}% {pn:>18} | "
              f"{wt * 1e6:>8.1f} {100 * c['weight_bytes_mxfp4'] / wt / bw:>6.0f}% "
              f"{100 * c['flops'] / wt / rate:>6.0f}% {wn:>18} | "
              f"{gt * 1e6:>8.1f} {100 * c['weight_bytes_mxfp4'] / gt / bw:>6.0f}% {gn:>7} | "
              f"{bt * 1e6:>8.1f} {bn_:>18} | {bt / np.nanmin([mt, pt, wt, gt]):>6.2f}x")
    result["check_failures"] = failures
    save()
    bench_checks.finish("mxfp4 bench", failures)


if __name__ == "__main__":
    main()
