"""H200 benchmark of MLA attention: absorbed paged decode, absorbed / un-absorbed prefill, vs XLA and roofline.

Run on the GPU machine: ``PYTHONPATH=. python3 pallas_kernels/mla/bench.py`` (writes ``$OUT/mla_bench.json``).
One run measures, in order: the copy bandwidth and bf16 matmul rate (the roofline ceilings), correctness of
every kernel against the fp32 XLA reference, a decode tiling sweep per head count, 8K-token prefill (absorbed
and un-absorbed) over 0 / 32K cached tokens, then the decode grid (H x batch x context, XLA reference at batch
16, fp8 cache at 32K), the short-cache decode tilings with 16-token pages (batch 1 and 16 over 560 / 4096
tokens, H=32) and the absorption kernels against XLA's einsums (``--sections short_decode,absorb`` for those);
``--sections mgpu`` times the Mosaic-GPU decode kernel (``decode_mgpu``) against the Triton one at long contexts.
Items past ``--budget-s`` are skipped (listed as such). K3 shapes: R=512, K_rope=64,
K_nope=V=128, block_size=64, scale=192**-0.5. Without the ``sweep`` section the decode grid uses
``choose_tiling``'s defaults. Prefill times every tiling at 0 cached tokens and the two fastest of each form at
32K. The JSON is rewritten after every row (a timeout keeps what was measured).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bench_checks
from pallas_kernels.bench_timing import copy_bandwidth, kernel_split_us
from pallas_kernels.mla import MLADecodeConfig, MLADecodeMGPUConfig, MLAPrefillConfig
from pallas_kernels.mla.attention import mla_paged_attention_pallas
from pallas_kernels.mla.prefill import mla_prefill_attention_pallas
from pallas_kernels.mla.reference import (
    mla_paged_attention_reference,
    mla_prefill_attention_reference,
    quantize_latent_fp8,
)

R, K_ROPE, K_NOPE, V_DIM, BLOCK_SIZE = 512, 64, 128, 128, 64
W = R + K_ROPE
SCALE = (K_NOPE + K_ROPE) ** -0.5
HEADS, BATCHES, CONTEXTS = (12, 32, 96), (16, 64, 1), (4096, 32768, 131072)  # most wanted first
SWEEP_BATCH, SWEEP_CONTEXT, PREFILL_HEADS, PREFILL_NEW, PREFILL_CACHED = 16, 32768, 96, 8192, (0, 32768)
MATMUL_N = 8192  # ceiling: 8192^3 bf16 matmul


def time_call(fn, *args, target_s: float = 0.25, max_reps: int = 50) -> float:
    """Seconds per call: one warm-up (compile), one timed call to size the loop, then a pipelined loop that
    keeps only the last output alive (earlier ones are freed as they complete)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    reps = int(min(max_reps, max(3, target_s / max(once, 1e-6))))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def ceilings() -> dict:
    """Measured device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate."""
    copy_bw = copy_bandwidth()  # donated buffers: a fresh 4 GiB output per call measured 1.77 TB/s
    a = jax.random.normal(jax.random.key(1), (MATMUL_N, MATMUL_N), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (MATMUL_N, MATMUL_N), jnp.bfloat16)
    mm_s = time_call(jax.jit(lambda a, b: a @ b), a, b)
    return {"copy_bytes_per_s": copy_bw, "bf16_matmul_flops_per_s": 2 * MATMUL_N**3 / mm_s}


def make_cache(key, context_lens, *, dtype=jnp.bfloat16, block_size=BLOCK_SIZE):
    """Pages for requests of the given lengths, pages shuffled over the pool (block 0 scratch)."""
    context_lens = np.asarray(context_lens, np.int32)
    pages_per_seq = -(-context_lens // block_size)
    max_pages = int(pages_per_seq.max())
    num_blocks = 1 + int(pages_per_seq.sum())
    k_pages, k_perm = jax.random.split(key)
    pages = jax.random.normal(k_pages, (num_blocks, block_size, W), dtype)
    perm = np.asarray(jax.random.permutation(k_perm, num_blocks - 1)) + 1
    tables = np.zeros((len(context_lens), max_pages), np.int32)
    start = 0
    for n, count in enumerate(pages_per_seq):
        tables[n, :count] = perm[start : start + count]
        start += count
    return pages, jnp.asarray(tables), jnp.asarray(context_lens)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def to_fp8_cache(pages):
    rows, scales = quantize_latent_fp8(pages.reshape(-1, W))
    return rows.reshape(pages.shape), scales.reshape(pages.shape[:2])


def check_correctness(results: dict) -> None:
    """Mixed decode / spec / chunked-prefill batch with K3 shapes, bf16 and fp8, plus un-absorbed prefill."""
    key = jax.random.key(10)
    context_lens, q_lens = [5000, 1, 300, 2047, 777], [1, 1, 4, 8, 200]
    pages, tables, ctx = make_cache(key, context_lens)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    for num_heads in (HEADS[0], HEADS[-1]):
        q = jax.random.normal(jax.random.key(num_heads), (int(cu[-1]) + 3, num_heads, W), jnp.bfloat16)
        want = mla_paged_attention_reference(q, pages, tables, ctx, cu, scale=SCALE, kv_lora_rank=R)
        got = mla_paged_attention_pallas(q, pages, tables, ctx, cu, scale=SCALE, kv_lora_rank=R)
        real = int(cu[-1])  # padding rows carry lse NO_KEY_LSE, which would swamp the norm
        results[f"absorbed_H{num_heads}"] = {
            "o_rel_err": rel_err(got[0], want[0]),
            "lse_rel_err": rel_err(got[1][:real], want[1][:real]),
            "padding_rows_zero": bool(jnp.all(got[0][real:] == 0)),
        }
        pages8, scales8 = to_fp8_cache(pages)
        want8 = mla_paged_attention_reference(
            q, pages8, tables, ctx, cu, scale=SCALE, kv_lora_rank=R, page_scales=scales8
        )
        got8 = mla_paged_attention_pallas(q, pages8, tables, ctx, cu, scale=SCALE, kv_lora_rank=R, page_scales=scales8)
        results[f"absorbed_fp8_H{num_heads}"] = {
            "o_rel_err_vs_fp8_ref": rel_err(got8[0], want8[0]),
            "o_rel_err_vs_bf16_ref": rel_err(got8[0], want[0]),
        }
    num_heads, kv_lens, q_lens = HEADS[-1], [2300, 64], [300, 64]
    keys = jax.random.split(jax.random.key(11), 4)
    num_keys, num_tokens = sum(kv_lens), sum(q_lens)
    q = jax.random.normal(keys[0], (num_tokens, num_heads, K_NOPE + K_ROPE), jnp.bfloat16)
    k_nope = jax.random.normal(keys[1], (num_keys, num_heads, K_NOPE), jnp.bfloat16)
    k_pe = jax.random.normal(keys[2], (num_keys, K_ROPE), jnp.bfloat16)
    v = jax.random.normal(keys[3], (num_keys, num_heads, V_DIM), jnp.bfloat16)
    cu_q = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    cu_kv = jnp.asarray(np.concatenate([[0], np.cumsum(kv_lens)]), jnp.int32)
    want = mla_prefill_attention_reference(q, k_nope, k_pe, v, cu_q, cu_kv, scale=SCALE)
    got = mla_prefill_attention_pallas(q, k_nope, k_pe, v, cu_q, cu_kv, scale=SCALE)
    results[f"unabsorbed_H{num_heads}"] = {"o_rel_err": rel_err(got[0], want[0]), "lse_rel_err": rel_err(got[1], want[1])}


def check_failures(correctness: dict) -> list[str]:
    """The failed checks of :func:`check_correctness`: a crash, or a relative error over 2e-2 (bf16 queries and
    pages, the fp8 cache against its own dequantised reference; fp8 against bf16 is only reported)."""
    if "error" in correctness or not correctness:
        return [f"checks crashed: {correctness.get('error', 'no results')}"]
    return bench_checks.over(correctness, lambda path: None if "vs_bf16_ref" in path else 2e-2)


def decode_roofline(batch, context, num_heads, ceil, *, bytes_per_row=2 * W + 0.0) -> tuple[float, float, float]:
    """(bytes, flops, roofline seconds) of one absorbed decode call (1 query token per request)."""
    nbytes = batch * context * bytes_per_row + batch * num_heads * (W + R) * 2
    flops = 2.0 * batch * num_heads * context * (W + R)
    return nbytes, flops, max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["bf16_matmul_flops_per_s"])


def decode_fn(variant, fp8=False):
    def run(q, pages, tables, ctx, cu, scales=None):
        return mla_paged_attention_pallas(
            q, pages, tables, ctx, cu, scale=SCALE, kv_lora_rank=R, page_scales=scales,
            config=MLADecodeConfig(**variant),
        )

    return jax.jit(run)


DECODE_VARIANTS = {
    12: [dict(block_h=16, block_k=64, num_warps=4), dict(block_h=16, block_k=32, num_warps=4),
         dict(block_h=16, block_k=64, num_warps=4, num_stages=3)],
    32: [dict(block_h=32, block_k=64, num_warps=4), dict(block_h=32, block_k=32, num_warps=4),
         dict(block_h=16, block_k=64, num_warps=4), dict(block_h=32, block_k=64, num_warps=8)],
    96: [dict(block_h=64, block_k=64, num_warps=8), dict(block_h=64, block_k=32, num_warps=8),
         dict(block_h=32, block_k=64, num_warps=4), dict(block_h=32, block_k=32, num_warps=4),
         dict(block_h=32, block_k=64, num_warps=8)],
}  # fmt: skip


_SAVE = [lambda: None]  # main() installs the JSON writer: every row is saved as soon as it is measured


def guarded(row: dict, measure) -> dict:
    """Run ``measure(row)``; a compile / runtime failure is recorded in the row instead of ending the run."""
    try:
        measure(row)
    except Exception as e:
        row["error"] = repr(e)[:300]
    print(row, flush=True)
    _SAVE[0]()
    return row


def run_sweep(report: dict, heads=HEADS) -> dict:
    """Tiling sweep at one decode shape -> {H: (best compiling variant, us)}; each row also records how far its
    output lies from the default tiling's (``max_abs_diff_o``, ``max_abs_diff_lse``)."""
    best, report["sweep"] = {}, []
    pages, tables, ctx = make_cache(jax.random.key(1), [SWEEP_CONTEXT] * SWEEP_BATCH)
    cu = jnp.arange(SWEEP_BATCH + 1, dtype=jnp.int32)
    for num_heads in heads:
        q = jax.random.normal(jax.random.key(num_heads), (SWEEP_BATCH, num_heads, W), jnp.bfloat16)
        o_default, lse_default = decode_fn({})(q, pages, tables, ctx, cu)
        for variant in DECODE_VARIANTS[num_heads]:

            def measure(row, variant=variant, o_default=o_default, lse_default=lse_default):
                fn = decode_fn(variant)  # one jit: a second decode_fn(variant) would compile again
                o, lse = fn(q, pages, tables, ctx, cu)
                row["max_abs_diff_o"] = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_default.astype(jnp.float32))))
                row["max_abs_diff_lse"] = float(jnp.max(jnp.abs(lse - lse_default)))
                row["us"] = time_call(fn, q, pages, tables, ctx, cu) * 1e6
                if num_heads not in best or row["us"] < best[num_heads][1]:
                    best[num_heads] = (variant, row["us"])

            report["sweep"].append(guarded({"H": num_heads, **variant}, measure))
    return best


def run_prefill(report: dict, ceil: dict, over) -> None:
    """8K new tokens over 0 / 32K cached: absorbed kernel vs up-projection + un-absorbed kernel vs XLA."""
    report["prefill"] = []
    num_heads, new = PREFILL_HEADS, PREFILL_NEW
    mm_rate = ceil["bf16_matmul_flops_per_s"]
    absorbed_tiles = [(16, 4, 4), (8, 8, 4), (16, 8, 8), (32, 4, 8)]
    unabsorbed_tiles = [(64, 64), (128, 64), (128, 32)]

    def fastest(form, keys, tiles):
        """After the first context: keep the two tilings that were fastest there (saves the budget at 32K)."""
        done = {tuple(r[k] for k in keys): r["ms"] for r in report["prefill"] if r.get("form") == form and "ms" in r}
        return sorted(tiles, key=lambda t: done.get(t, float("inf")))[:2] if done else tiles

    for cached in PREFILL_CACHED:
        if over():
            report["skipped"].append(f"prefill cached={cached}")
            continue
        total = cached + new
        pairs = new * cached + new * (new + 1) / 2
        pages, tables, ctx = make_cache(jax.random.key(7 + cached), [total])
        cu = jnp.asarray([0, new], jnp.int32)
        q = jax.random.normal(jax.random.key(8), (new, num_heads, W), jnp.bfloat16)
        flops_abs = 2 * pairs * num_heads * (W + R)
        for bq, bh, warps in (absorbed_tiles if cached == PREFILL_CACHED[0] else
                              fastest("absorbed", ("block_q", "block_h", "num_warps"), absorbed_tiles)):

            def measure(row, bq=bq, bh=bh, warps=warps):
                config = MLADecodeConfig(block_q=bq, block_h=bh, num_warps=warps, num_splits=1)
                fn = jax.jit(lambda *a: mla_paged_attention_pallas(*a, scale=SCALE, kv_lora_rank=R, config=config))
                sec = time_call(fn, q, pages, tables, ctx, cu, target_s=0.5, max_reps=5)
                row.update(ms=sec * 1e3, TFLOPs=flops_abs / sec / 1e12, pct_mm=100 * flops_abs / sec / mm_rate)

            row = {"form": "absorbed", "cached": cached, "block_q": bq, "block_h": bh, "num_warps": warps}
            report["prefill"].append(guarded(row, measure))
        # Un-absorbed: gather the context latent, up-project with kv_b (XLA), then the flash kernel.
        kv_b = jax.random.normal(jax.random.key(9), (R, num_heads * (K_NOPE + V_DIM)), jnp.bfloat16) * R**-0.5
        q_mha = jax.random.normal(jax.random.key(10), (new, num_heads, K_NOPE + K_ROPE), jnp.bfloat16)

        @jax.jit
        def up_project(pages, tables):
            rows = pages[tables[0]].reshape(-1, W)[:total]
            kv = (rows[:, :R] @ kv_b).reshape(total, num_heads, K_NOPE + V_DIM)
            return kv[..., :K_NOPE], rows[:, R:], kv[..., K_NOPE:]

        k_nope, k_pe, v = up_project(pages, tables)
        up_sec = time_call(up_project, pages, tables, target_s=0.2, max_reps=5)
        cu_kv = jnp.asarray([0, total], jnp.int32)
        flops_mha = 2 * pairs * num_heads * (K_NOPE + K_ROPE + V_DIM)
        for bq, bk in (unabsorbed_tiles if cached == PREFILL_CACHED[0] else
                       fastest("unabsorbed", ("block_q", "block_k"), unabsorbed_tiles)):

            def measure(row, bq=bq, bk=bk):
                fn = jax.jit(lambda *a: mla_prefill_attention_pallas(
                    *a, scale=SCALE, config=MLAPrefillConfig(block_q=bq, block_k=bk)))
                sec = time_call(fn, q_mha, k_nope, k_pe, v, cu, cu_kv, target_s=0.5, max_reps=10)
                row.update(ms=sec * 1e3, TFLOPs=flops_mha / sec / 1e12, pct_mm=100 * flops_mha / sec / mm_rate,
                           total_ms=(sec + up_sec) * 1e3)

            row = {"form": "unabsorbed", "cached": cached, "block_q": bq, "block_k": bk, "up_project_ms": up_sec * 1e3}
            report["prefill"].append(guarded(row, measure))
        if cached == 0 and not over():

            def measure_refs(row):
                ref = jax.jit(lambda *a: mla_paged_attention_reference(*a, scale=SCALE, kv_lora_rank=R))
                row["absorbed_ms"] = time_call(ref, q, pages, tables, ctx, cu, target_s=0.0, max_reps=1) * 1e3
                ref = jax.jit(lambda *a: mla_prefill_attention_reference(*a, scale=SCALE))
                row["unabsorbed_ms"] = time_call(ref, q_mha, k_nope, k_pe, v, cu, cu_kv, target_s=0.0, max_reps=1) * 1e3

            report["prefill"].append(guarded({"form": "xla_reference", "cached": cached}, measure_refs))
        del pages, k_nope, v


def run_decode(report: dict, ceil: dict, best: dict, over, save) -> None:
    """The decode grid with each head count's best variant; XLA reference at the sweep batch, fp8 at its context."""
    report["decode"] = []
    for batch in BATCHES:
        for context in CONTEXTS:
            if over():
                report["skipped"].append(f"decode B={batch} ctx={context}")
                continue
            pages, tables, ctx = make_cache(jax.random.key(batch + context), [context] * batch)
            cu = jnp.arange(batch + 1, dtype=jnp.int32)
            fp8 = to_fp8_cache(pages) if context == SWEEP_CONTEXT and batch >= SWEEP_BATCH else None
            for num_heads in [h for h in HEADS if h in best]:
                q = jax.random.normal(jax.random.key(num_heads), (batch, num_heads, W), jnp.bfloat16)
                nbytes, flops, roof = decode_roofline(batch, context, num_heads, ceil)

                def measure(row, q=q, variant=best[num_heads][0], roof=roof, num_heads=num_heads):
                    sec = time_call(decode_fn(variant), q, pages, tables, ctx, cu)
                    row.update(us=sec * 1e6, cache_TBps=batch * context * 2 * W / sec / 1e12, pct_roof=100 * roof / sec)
                    if context == CONTEXTS[0] and jax.devices()[0].platform == "gpu":
                        # 4K contexts took ~200 us whatever the bytes: the kernel, or the ops around it?
                        row["kernel_us"] = kernel_split_us(decode_fn(variant), (q, pages, tables, ctx, cu))
                    if fp8 is not None:
                        _, _, roof8 = decode_roofline(batch, context, num_heads, ceil, bytes_per_row=W + 4.0)
                        sec8 = time_call(decode_fn(variant), q, fp8[0], tables, ctx, cu, fp8[1])
                        row.update(fp8_us=sec8 * 1e6, fp8_roof_us=roof8 * 1e6, fp8_pct_roof=100 * roof8 / sec8)
                    if batch == SWEEP_BATCH and not over():
                        ref = jax.jit(lambda *a: mla_paged_attention_reference(*a, scale=SCALE, kv_lora_rank=R))
                        row["xla_ref_us"] = time_call(ref, q, pages, tables, ctx, cu, target_s=0.1, max_reps=3) * 1e6

                row = {"H": num_heads, "B": batch, "ctx": context, "bytes": nbytes, "flops": flops, "roof_us": roof * 1e6}
                report["decode"].append(guarded(row, measure))
            del pages, fp8
            save()


def run_mgpu(report: dict, ceil: dict, over, heads=HEADS) -> None:
    """Long-context decode: the Mosaic-GPU warpgroup kernel (accumulator chunks of 64 / 128 columns, one wave of
    KV splits or two) against the Triton kernel's default tiling, same inputs, for each of ``heads``; the first case
    of each H also checks that every Mosaic-GPU variant agrees with the Triton kernel."""
    from pallas_kernels.mla.decode_mgpu import default_splits, mla_decode_mgpu

    report["mgpu"] = []
    for num_heads in heads:
        # table_x > 1: the block table is that many times wider than the context (scratch page 0 past it), as in
        # the engine, whose page buckets run ahead of the contexts
        for batch, context, table_x in ((16, 32768, 1), (64, 32768, 1), (16, 131072, 1), (1, 131072, 1),
                                        (16, 32768, 4)):
            if over():
                report["skipped"].append(f"mgpu H={num_heads} B={batch} ctx={context} table x{table_x}")
                continue
            pages, tables, ctx = make_cache(jax.random.key(batch + context), [context] * batch)
            tables = jnp.pad(tables, ((0, 0), (0, (table_x - 1) * tables.shape[1])))
            cu = jnp.arange(batch + 1, dtype=jnp.int32)
            q = jax.random.normal(jax.random.key(num_heads), (batch, num_heads, W), jnp.bfloat16)
            nbytes, _, roof = decode_roofline(batch, context, num_heads, ceil)
            triton = decode_fn({})
            one_wave = default_splits(batch, -(-num_heads // 64), tables.shape[1] * BLOCK_SIZE // 64)
            variants = {f"mgpu_chunk{c}_splits{n}": jax.jit(
                lambda q, p, t, ctx, c=c, n=n: mla_decode_mgpu(q, p, t, ctx, scale=SCALE,
                                                               config=MLADecodeMGPUConfig(chunk=c, splits=n)))
                for c, n in ((64, one_wave), (128, one_wave), (64, 2 * one_wave))}

            def measure(row, q=q, pages=pages, tables=tables, ctx=ctx, cu=cu, roof=roof, triton=triton,
                        variants=variants, batch=batch, context=context):
                for name, sec in [("triton", time_call(triton, q, pages, tables, ctx, cu))] + [
                        (name, time_call(fn, q, pages, tables, ctx)) for name, fn in variants.items()]:
                    row[f"{name}_us"] = sec * 1e6
                    row[f"{name}_cache_TBps"] = batch * context * 2 * W / sec / 1e12
                    row[f"{name}_pct_roof"] = 100 * roof / sec
                if not report["mgpu"] or report["mgpu"][-1]["H"] != row["H"]:
                    o_t, lse_t = triton(q, pages, tables, ctx, cu)
                    for name, fn in variants.items():
                        o_m, lse_m = fn(q, pages, tables, ctx)
                        row[f"{name}_max_abs_diff_o"] = float(jnp.max(jnp.abs(o_t.astype(jnp.float32)
                                                                              - o_m.astype(jnp.float32))))
                        row[f"{name}_max_abs_diff_lse"] = float(jnp.max(jnp.abs(lse_t - lse_m)))

            row = {"H": num_heads, "B": batch, "ctx": context, "table_x": table_x, "bytes": nbytes,
                   "roof_us": roof * 1e6}
            report["mgpu"].append(guarded(row, measure))
            del pages


def print_tables(report: dict) -> None:
    nan = float("nan")
    print("\n| H | B | ctx | pallas us | roof us | % roof | cache TB/s | XLA ref us | fp8 us | fp8 % roof |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report.get("decode", []):
        print(f"| {r['H']} | {r['B']} | {r['ctx']} | {r.get('us', nan):.0f} | {r['roof_us']:.0f} | "
              f"{r.get('pct_roof', nan):.0f} | {r.get('cache_TBps', nan):.2f} | {r.get('xla_ref_us', nan):.0f} | "
              f"{r.get('fp8_us', nan):.0f} | {r.get('fp8_pct_roof', nan):.0f} |")
    for r in report.get("prefill", []):
        print(r)
    if report.get("mgpu"):
        print("\n| H | B | ctx | table / ctx | Triton us | TB/s | best mgpu | us | TB/s | mgpu / Triton speed |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report.get("mgpu", []):
        times = {k[:-3]: v for k, v in r.items() if k.startswith("mgpu") and k.endswith("_us")}
        if "triton_us" not in r or not times:
            continue
        best = min(times, key=times.get)
        print(f"| {r['H']} | {r['B']} | {r['ctx']} | {r.get('table_x', 1)} | {r['triton_us']:.1f} | "
              f"{r['triton_cache_TBps']:.2f} | {best[5:]} | {times[best]:.1f} | {r[best + '_cache_TBps']:.2f} | "
              f"{r['triton_us'] / times[best]:.2f}x |")


SHORT_DECODE_CASES = ((1, 560), (1, 4096), (16, 560))  # (batch, cached tokens): the engine's decode at H=32
SHORT_DECODE_TILINGS = [(bh, ns) for bh in (16, 32) for ns in (1, 2, 4, 8, 16, 32)]  # (block_h, num_splits)
ABSORB_CASES = ((32, 1), (32, 16), (96, 1), (96, 16))  # (heads, query rows)


def run_short_decode(report: dict) -> None:
    """Decode over short caches with the engine's 16-token pages (Kimi-Linear, H=32): every (heads per
    program, splits) tiling against choose_tiling's pick; profiler device time of the kernel + merge."""
    report["short_decode"] = []
    for batch, context in SHORT_DECODE_CASES:
        pages, tables, ctx = make_cache(jax.random.key(context), [context] * batch, block_size=16)
        q = jax.random.normal(jax.random.key(1), (batch, 32, W), jnp.bfloat16)
        cu = jnp.arange(batch + 1, dtype=jnp.int32)
        for tiling in SHORT_DECODE_TILINGS + [None]:
            knobs = {} if tiling is None else dict(block_h=tiling[0], num_splits=tiling[1])

            def measure(row, knobs=knobs):
                fn = jax.jit(lambda *a: mla_paged_attention_pallas(*a, scale=SCALE, kv_lora_rank=R,
                                                                   config=MLADecodeConfig(**knobs)))
                row["us"] = sum(kernel_split_us(fn, (q, pages, tables, ctx, cu), repeats=10).values())

            report["short_decode"].append(guarded({"B": batch, "ctx": context, **(knobs or {"tiling": "auto"})},
                                                  measure))


def run_absorb(report: dict, ceil: dict) -> None:
    """The absorbed form's per-head up-projections at decode sizes: XLA's einsums against the Pallas kernels
    (profiler device time; roofline: W_UK or W_UV read once at the copy bandwidth)."""
    from pallas_kernels.mla import absorb_outputs_reference, absorb_queries_reference
    from pallas_kernels.mla.absorb import absorb_outputs_pallas, absorb_queries_pallas

    report["absorb"] = []
    for num_heads, rows in ABSORB_CASES:
        kv_b = jax.random.normal(jax.random.key(num_heads), (2, R, num_heads * (K_NOPE + V_DIM)), jnp.bfloat16)
        q = jax.random.normal(jax.random.key(rows), (rows, num_heads, K_NOPE + K_ROPE), jnp.bfloat16)
        o_lat = jax.random.normal(jax.random.key(rows + 1), (rows, num_heads, R), jnp.bfloat16)
        roof_us = R * num_heads * K_NOPE * 2 / ceil["copy_bytes_per_s"] * 1e6
        for name, args, xla, ours in (
                ("queries", (q, kv_b), lambda q, w: absorb_queries_reference(q, w, layer=1, k_nope=K_NOPE),
                 lambda q, w: absorb_queries_pallas(q, w, layer=1, k_nope=K_NOPE)),
                ("outputs", (o_lat, kv_b), lambda o, w: absorb_outputs_reference(o, w, layer=1, v_dim=V_DIM),
                 lambda o, w: absorb_outputs_pallas(o, w, layer=1, v_dim=V_DIM))):

            def measure(row, args=args, xla=xla, ours=ours):
                got, want = jax.jit(ours)(*args), jax.jit(xla)(*args)
                row["max_rel_err"] = rel_err(got, want)
                row["xla_us"] = sum(kernel_split_us(jax.jit(xla), args, repeats=10).values())
                row["pallas_us"] = sum(kernel_split_us(jax.jit(ours), args, repeats=10).values())

            report["absorb"].append(guarded({"form": name, "H": num_heads, "T": rows, "roof_us": roof_us}, measure))


SECTIONS = ("correctness", "sweep", "prefill", "decode", "short_decode", "absorb", "mgpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget-s", type=float, default=200.0, help="skip remaining items after this")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    parser.add_argument("--heads", type=int, nargs="+", default=HEADS,
                        help="head counts of the sweep and mgpu sections")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    sections = args.sections.split(",")
    t0 = time.perf_counter()
    over = lambda: time.perf_counter() - t0 > args.budget_s  # noqa: E731
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "skipped": []}

    def save():
        report["elapsed_s"] = time.perf_counter() - t0
        with open(os.path.join(args.out, "mla_bench.json"), "w") as f:
            json.dump(report, f, indent=1)

    _SAVE[0] = save

    ceil = report["ceilings"] = ceilings()
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 mm {ceil['bf16_matmul_flops_per_s'] / 1e12:.0f} TF/s",
          flush=True)
    save()
    if "correctness" in sections:
        report["correctness"] = guarded({}, check_correctness)
        save()
    best = {}
    if "sweep" in sections:
        best = run_sweep(report, args.heads)
        save()
    elif "decode" in sections:  # no sweep: choose_tiling's defaults (they encode the H200 sweep's winners)
        best = {num_heads: ({}, float("nan")) for num_heads in HEADS}
    if "prefill" in sections:
        run_prefill(report, ceil, over)
        save()
    if "decode" in sections:
        run_decode(report, ceil, best, over, save)
    if "short_decode" in sections:
        run_short_decode(report)
        save()
    if "absorb" in sections:
        run_absorb(report, ceil)
        save()
    if "mgpu" in sections:
        run_mgpu(report, ceil, over, args.heads)
        save()
    report["elapsed_s"] = time.perf_counter() - t0
    save()
    print_tables(report)
    print("best variants:", best, "skipped:", report["skipped"], f"{report['elapsed_s']:.0f}s")
    if "correctness" in sections:
        bench_checks.finish("mla bench", check_failures(report["correctness"]))


if __name__ == "__main__":
    main()
