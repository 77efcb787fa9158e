"""Absorbed MLA decode for 65-96 (token, head) rows per sequence (K3's 96 heads unsharded) as a Mosaic-GPU kernel
that forms each score once and puts the heads on ``wgmma``'s N dimension for ``P V``.

Why: :mod:`pallas_kernels.mla.decode_mgpu` takes 64 rows per CTA, so 96 heads take two CTAs (the second half
padding), and inside each CTA both compute warpgroups form the same ``[64, keys]`` scores. Per key that executes
2 x 2 x 64 x 576 + 2 x 64 x 512 multiply-adds, 2.04x the 96 x (576 + 512) the heads need, and the kernel is bound
by them (90% of the bf16 ``wgmma`` rate, 43% of copy bandwidth at batch 16, 32K context). Here one CTA takes all
the rows:

* scores: warpgroup 0 forms rows ``[0, 64)`` and warpgroup 1 rows ``[rows - 64, rows)`` (``S = Q K^T``; at 96
  rows the middle 32 are formed by both, bit for bit alike, so their identical writes below are harmless); each
  keeps the online softmax of its rows and writes its ``P`` (bf16) and rescale factors to shared memory;
* values: after a barrier between the two, each warpgroup accumulates ``O^T = V^T P^T`` for its half of the 512
  latent columns (``V^T`` read transposed from the cache stage, ``P^T`` from shared memory), four ``[64, rows]``
  fp32 accumulators, rescaled per column (head).

That executes 2 x 64 x 576 + rows x 512 multiply-adds per key (1.73x fewer at 96 rows) and reads each key once.
Shared memory: Q ``[rows, 576]`` bf16 (110.6 KB at 96 rows), ``stages`` cache stages of 32 keys (36.9 KB each),
``P`` and the rescale factors (double-buffered by step parity, so one barrier per step suffices: a warpgroup
rewrites a buffer only after its own wait on the next step's scores, which the other warpgroup's ``P V`` of two
steps back precedes), the final row sums and the barriers: 2 stages fit the H200's 227 KB, 3 do not.

Measured (H100, batch 16, 32K context, 96 heads): 654 us against the 64-row kernel's 334 us, so it is not routed
to (BENCHMARKS.md, MLA attention).

Contract (as :mod:`pallas_kernels.mla.decode_mgpu`): decode and speculative verification, ``q_len`` causal query
tokens per sequence, bf16 pages with ``block_size`` a multiple of 32, R + K_rope = 576 with R = 512; rows past a
context in its last tile must be finite. Outputs: per-split fp32 partials merged by
:func:`pallas_kernels.mla.reference.merge_partials`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tuning
from pallas_kernels.impl import on_gpu
from pallas_kernels.mgpu_smem import BARRIER_BYTES, wgmma_operand_transforms
from pallas_kernels.mla.config import MLADecodeMGPUConfig
from pallas_kernels.mla.decode_mgpu import RANK, WIDTH, _fresh_index_buffer, default_splits
from pallas_kernels.mla.reference import NO_KEY_LSE, merge_partials

TILE = 64  # score rows per warpgroup: wgmma's M
MIN_ROWS, MAX_ROWS = TILE + 8, 96  # (token, head) rows per sequence this kernel takes (multiples of 8)
BLOCK_KV = 32  # keys per pipeline step
CHUNK = 64  # latent columns per O^T accumulator (wgmma's M)
STAGES = 2
# Q, the cache stages and P share one tiling: Mosaic-GPU's layout inference wants both wgmma operands tiled alike,
# and P's rows are BLOCK_KV bf16 = 64 bytes (a 64-byte swizzle)
TRANSFORMS = wgmma_operand_transforms(BLOCK_KV)
COLUMN = plgpu.Layout.WGMMA.reduce(0)  # a [n] vector broadcast over the rows of a wgmma accumulator


def _kernel(q_gmem, pages_gmem, tables_gmem, lens_gmem, o_gmem, lse_gmem, q_smem, p_smem, alpha_smem, inv_smem,
            q_barrier, ready, free, done, *, layer, scale, tiles_per_page, tiles_per_split, num_splits, q_len,
            num_heads, rows, stages, interpret):
    seq, split, wg = lax.axis_index("seq"), lax.axis_index("split"), lax.axis_index("wg")
    first_row = wg * (rows - TILE)  # warpgroup 0: rows [0, 64); 1: [rows - 64, rows)
    own_rows = pl.ds(first_row, TILE)
    context = lens_gmem[seq]
    per_split = (context + BLOCK_KV * num_splits - 1) // (BLOCK_KV * num_splits)
    first_tile = split * per_split
    context_tiles = (context + BLOCK_KV - 1) // BLOCK_KV
    num_steps = jnp.clip(jnp.minimum(per_split, context_tiles - first_tile), 0, tiles_per_split)
    num_pages, max_pages = pages_gmem.shape[1], tables_gmem.shape[1]
    half = RANK // 2
    log2e = math.log2(math.e)

    def page_block(step):  # block index of step's [BLOCK_KV, 576] rows: (layer, page, tile in page, 0)
        tile = first_tile + step
        page = tables_gmem[seq, jnp.minimum(tile // tiles_per_page, max_pages - 1)]
        return layer, jnp.clip(page, 0, num_pages - 1), lax.rem(tile, tiles_per_page), 0

    def columns(a, x):  # x [rows] broadcast over a's rows: a [CHUNK, rows] * x[None, :]
        return a * lax.broadcast_in_dim(x, a.shape, [1])

    def step_body(idx, k_smem, carry):
        (step,) = idx
        buffers = p_smem.shape[0]
        slot = lax.rem(step, buffers)
        start = (first_tile + step) * BLOCK_KV
        *accs, m, l = carry

        def scores(s_ref):
            plgpu.wgmma(s_ref, q_smem.at[own_rows], k_smem.T)
            return s_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((TILE, BLOCK_KV), jnp.float32))
        token = start + lax.broadcasted_iota(jnp.int32, (TILE, BLOCK_KV), 1)
        query = (first_row + lax.broadcasted_iota(jnp.int32, (TILE, BLOCK_KV), 0)) // num_heads
        visible = context - q_len + 1 + jnp.minimum(query, q_len - 1)
        s = jnp.where(token < visible, s * (scale * log2e), -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        if buffers == 1:  # the other warpgroup's P V of the previous step must be done with the buffer
            plgpu.barrier_arrive(free)
            plgpu.barrier_wait(free)
        p_smem.at[slot, own_rows][...] = p.astype(jnp.bfloat16)
        alpha_smem.at[slot, own_rows][...] = alpha
        plgpu.commit_smem()
        plgpu.barrier_arrive(ready.at[slot])
        plgpu.barrier_wait(ready.at[slot])
        alpha_all = plgpu.load(alpha_smem.at[slot], layout=COLUMN)
        accs = [columns(a, alpha_all) for a in accs]
        probs_t = p_smem.at[slot].T  # [BLOCK_KV, rows]

        def values_t(c):  # V^T for this warpgroup's latent columns [wg * 256 + c * CHUNK, + CHUNK): [CHUNK, BLOCK_KV]
            return k_smem.at[:, pl.ds(wg * half + c * CHUNK, CHUNK)].T

        if interpret:  # the interpreter has no accumulator initialised from registers: a product per chunk, added
            def product(c, acc_ref):
                plgpu.wgmma(acc_ref, values_t(c), probs_t)
                return acc_ref[...]
            accs = [a + pl.run_scoped(functools.partial(product, c), plgpu.ACC((CHUNK, rows), jnp.float32))
                    for c, a in enumerate(accs)]
        else:  # every chunk accumulates in place, issued back to back, one wait for all
            def products(acc_refs):
                for c, acc_ref in enumerate(acc_refs):
                    plgpu.wgmma(acc_ref, values_t(c), probs_t)
            accs = list(pl.run_state(products)(tuple(plgpu.ACC.init(a) for a in accs)))
        return (*accs, m_new, l)

    def compute(run_pipeline):
        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(q_gmem.at[seq], q_smem, q_barrier)

        plgpu.barrier_wait(q_barrier)
        zero = jnp.zeros((CHUNK, rows), jnp.float32)
        init = (*([zero] * (half // CHUNK)), jnp.full((TILE,), -jnp.inf, jnp.float32), jnp.zeros((TILE,), jnp.float32))
        *accs, m, l = run_pipeline(init)
        empty = l == 0.0
        inv_smem.at[own_rows][...] = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
        lse_gmem.at[split, seq, own_rows][...] = jnp.where(empty, NO_KEY_LSE,
                                                           (m + jnp.log2(jnp.where(empty, 1.0, l))) / log2e)
        plgpu.commit_smem()
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
        inv_all = plgpu.load(inv_smem, layout=COLUMN)
        for c, acc in enumerate(accs):  # straight from registers
            o_gmem.at[split, seq, pl.ds(wg * half + c * CHUNK, CHUNK)][...] = columns(acc, inv_all)

    plgpu.emit_pipeline_warp_specialized(
        step_body, grid=(num_steps,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((None, None, BLOCK_KV, WIDTH), page_block,
                                  transforms=TRANSFORMS)],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages, compute_context=compute)(pages_gmem)


def p_buffers(stages: int) -> int:
    """``P`` / rescale buffers: two (by step parity) with 2 stages; one with 3, the only way those fit."""
    return 2 if stages == 2 else 1


def smem_bytes(rows: int, stages: int = STAGES) -> int:
    """Shared memory the kernel allocates: Q ``[rows, 576]`` bf16, ``stages`` cache tiles ``[32, 576]`` bf16,
    :func:`p_buffers` ``P`` buffers ``[rows, 32]`` bf16 and rescale vectors ``[rows]`` f32, the reciprocal row
    sums ``[rows]`` f32, and the barriers (Q's, the per-step ones and the final one)."""
    buffers = p_buffers(stages)
    return (2 * rows * WIDTH + stages * 2 * BLOCK_KV * WIDTH + buffers * (2 * rows * BLOCK_KV + 4 * rows) + 4 * rows
            + (1 + buffers + 1 + 1 + 2 * stages) * BARRIER_BYTES)


def rows_fit(q_len: int, num_heads: int) -> bool:
    """Whether ``q_len`` tokens of ``num_heads`` heads make a row count this kernel takes (65-96; padded to 8)."""
    return MIN_ROWS - 8 < q_len * num_heads <= MAX_ROWS


@functools.partial(jax.jit, static_argnames=("scale", "q_len", "layer", "config", "interpret"))
def mla_decode_mgpu_wide(q: jax.Array, pages: jax.Array, block_tables: jax.Array, context_lens: jax.Array, *,
                         scale: float, q_len: int = 1, layer: int | None = None,
                         config: MLADecodeMGPUConfig | None = None,
                         interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Decode / verification attention with 65-96 (token, head) rows per sequence: q ``[N * q_len, H, 576]`` over
    ``pages [B, bs, 576]`` bf16 (``[L, B, bs, 576]`` with ``layer``), ``block_tables [N, P]``, ``context_lens [N]``
    -> (o_lat ``[N * q_len, H, 512]`` in q.dtype, lse ``[N * q_len, H]`` f32), as
    :func:`pallas_kernels.mla.decode_mgpu.mla_decode_mgpu`. ``config``: its ``splits``, ``num_sms`` and
    ``wide_stages`` (32-key stages, 2 or 3). ValueError on shapes outside the contract."""
    if layer is None:
        pages, layer = pages[None], 0
    num_tokens, num_heads, width = q.shape
    num_seqs = block_tables.shape[0]
    if q_len < 1 or num_tokens != num_seqs * q_len:
        raise ValueError(f"q has {num_tokens} tokens, not q_len={q_len} for each of the {num_seqs} sequences")
    if not rows_fit(q_len, num_heads):
        raise ValueError(f"q_len * num_heads = {q_len * num_heads} rows; this kernel takes {MIN_ROWS - 7}-{MAX_ROWS}")
    _, _, block_size, _ = pages.shape
    if width != WIDTH or pages.shape[-1] != WIDTH or pages.dtype != jnp.bfloat16:
        raise ValueError(f"q [N, H, {WIDTH}] and bf16 pages [.., bs, {WIDTH}] expected; got q {q.shape}, pages "
                         f"{pages.dtype}{list(pages.shape)}")
    if block_size % BLOCK_KV:
        raise ValueError(f"block_size {block_size} must be a multiple of {BLOCK_KV}")
    cfg = tuning.resolve(MLADecodeMGPUConfig, config)
    real_rows = q_len * num_heads
    rows = -(-real_rows // 8) * 8
    stages = cfg.wide_stages
    if stages not in (2, 3):
        raise ValueError(f"wide_stages must be 2 or 3, got {stages}")
    tuning.check_smem("mla_decode_mgpu_wide", smem_bytes(rows, stages), f"{rows} rows, {stages} stages")
    buffers = p_buffers(stages)
    tiles_per_page = block_size // BLOCK_KV
    tiles = block_tables.shape[1] * tiles_per_page
    splits = cfg.splits or default_splits(num_seqs, 1, tiles, cfg.num_sms)
    tiles_per_split = -(-tiles // splits)
    q_rows = q.astype(jnp.bfloat16).reshape(num_seqs, real_rows, WIDTH)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, rows - real_rows), (0, 0)))
    interpret = not on_gpu() if interpret is None else interpret
    kernel = functools.partial(_kernel, layer=layer, scale=float(scale), tiles_per_page=tiles_per_page,
                               tiles_per_split=tiles_per_split, num_splits=splits, q_len=q_len, num_heads=num_heads,
                               rows=rows, stages=stages, interpret=interpret)
    o_parts, lse_parts = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((splits, num_seqs, RANK, rows), jnp.float32),
                  jax.ShapeDtypeStruct((splits, num_seqs, rows), jnp.float32)),
        grid=(num_seqs, splits), grid_names=("seq", "split"), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=[plgpu.SMEM((rows, WIDTH), jnp.bfloat16, transforms=TRANSFORMS),
                       plgpu.SMEM((buffers, rows, BLOCK_KV), jnp.bfloat16, transforms=TRANSFORMS),
                       plgpu.SMEM((buffers, rows), jnp.float32), plgpu.SMEM((rows,), jnp.float32),
                       plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_arrivals=2, num_barriers=buffers),
                       plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=2)],
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q_rows, pages, _fresh_index_buffer(block_tables), _fresh_index_buffer(context_lens))
    o_parts = jnp.swapaxes(o_parts[..., :real_rows], -1, -2)  # [splits, N, rows, R]
    o, lse = merge_partials(o_parts, lse_parts[..., :real_rows])
    return o.astype(q.dtype).reshape(num_tokens, num_heads, RANK), lse.reshape(num_tokens, num_heads)
