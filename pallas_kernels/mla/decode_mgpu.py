"""Absorbed MLA decode over the paged latent cache as a Mosaic-GPU (Hopper warpgroup) kernel.

Why: the Triton kernel's 32-row ``mma.sync`` tile holds its 32 x 512 fp32 accumulator and the queries in
registers (255 per thread by ``ptxas -v``, 2 CTAs per SM), so at H >= 32 too few loads are in flight and
long-context decode reads the cache at 47-56% of copy bandwidth (batch 16, 32K context: H=32 341 us, H=96 814
us; its 64-row, 8-warp tile takes ``wgmma`` but spills). Here, as in FlashMLA, one CTA takes 64 query rows
(the heads of one decode token, or the (token, head) rows of a few verified tokens, zero-padded to a multiple of
64) and three warpgroups:

* a memory warpgroup streams 64 cache rows (``[64, 576]`` bf16) per step through TMA into a ring
  of shared-memory stages, gathering pages through the block table (its index map reads the table in global
  memory);
* two compute warpgroups each compute the scores ``S = Q K^T`` (``wgmma``, Q resident in shared memory, K^T read
  transposed from the stage) and the same online softmax, and each accumulates ``P V`` for its own half of the
  512 latent columns (V is the stage's first 512 columns), so the fp32 accumulator is split 2 x ``[64, 256]``
  and nobody spills. ``P`` is the wgmma's register A operand (its K, the 64 keys of a step, must be a multiple
  of 64; under the interpreter, which takes A from shared memory only, P goes through shared memory).

Shared memory (:func:`smem_bytes`, checked against the device's): Q 72 KB + two stages of 72 KB = 216 KB of the
H200's 227 KB; the partial outputs are stored from registers straight to global memory. The context is split over ``splits`` CTAs per (token, head block); each
writes fp32 partials (o, natural-log lse) that :func:`pallas_kernels.mla.reference.merge_partials` merges. Grid:
(sequences, head blocks, splits). ``jax.export`` for CUDA runs Mosaic-GPU's layout inference on the CPU, so the
GPU lowering is tested here too (a 32-key step failed it: its P tile needs a 64-byte swizzle).

Limits: at H=96 the kernel reads the cache at 42-44% of copy bandwidth. The heads need 2176 FLOPs per (head, key)
for 1152 bytes per key (181 FLOP/byte, against the H200's ridge of about 180); as executed (two 64-row CTAs whose
two warpgroups each form the same scores) 370 FLOP/byte, 677 TFLOP/s at batch 16, 32K. Executing fewer did not
help (BENCHMARKS.md, MLA attention): warpgroup 0 alone forming the scores and handing P and the rescales to
warpgroup 1 through shared memory (1.53x fewer FLOPs; it fits once the cross-warp reduction scratch is dropped) was
1.14-1.17x slower at H=32 and H=96; each warpgroup forming the scores over half of the 576 columns and the two
adding the halves through shared memory (1.53x fewer, 32-key stages) 1.24x slower at H=96; one CTA for all 96 rows
(1.73x fewer) 2.0x slower. The timings point to each warpgroup's chain per step (S ``wgmma``, wait, softmax,
``P V``) as the limit: two independent warpgroups overlap their chains, an exchange between them serialises them.

Contract: :func:`pallas_kernels.mla.reference.mla_paged_attention_reference` for decode and speculative
verification (the same number of query tokens for every sequence, causal among them), bf16 pages,
``block_size`` a multiple of 64 (one step is 64 keys of one page), R + K_rope = 576 with R = 512. Each
sequence's context (not its table's capacity: the engine's page buckets run ahead of it) is split evenly over the
KV splits at run time, and each CTA's pipeline runs only its share's steps (a dynamic pipeline grid: the static
grid's surplus steps, which reloaded a tile from L2 and skipped the math, made a table 4x its context 2.2x
slower).
In the last tile the rows past the context are masked out of the softmax, so their values meet a zero
probability: they must be finite (the engine's pools are zero-initialised and freed pages keep finite latents;
its NaN-poisoning test mode takes the Triton kernel). :func:`pallas_kernels.mla.mla_paged_attention` routes
qualifying decode calls here on a GPU (``MGPU_DECODE``, ``mgpu_decode_fits``).
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
from pallas_kernels.mgpu import BARRIER_BYTES, fresh_int32_buffer, wgmma_operand_transforms
from pallas_kernels.mla.config import MLADecodeMGPUConfig
from pallas_kernels.mla.reference import NO_KEY_LSE, merge_partials

ROWS = 64  # query rows per CTA: one warpgroup's wgmma M
BLOCK_KV = 64  # keys per pipeline step
WIDTH = 576  # latent (512) + rope key (64) columns per cache row
RANK = 512


def _kernel(q_gmem, pages_gmem, tables_gmem, lens_gmem, o_gmem, lse_gmem, q_smem, q_barrier, *p_smem, layer, scale,
            tiles_per_page, tiles_per_split, num_splits, chunk, stages, q_len, num_heads):
    seq, head_block, split = lax.axis_index("seq"), lax.axis_index("hb"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    rows = pl.ds(head_block * ROWS, ROWS)
    context = lens_gmem[seq]
    # this sequence's tiles, split evenly over the splits: each CTA's pipeline runs only its share's steps
    per_split = (context + BLOCK_KV * num_splits - 1) // (BLOCK_KV * num_splits)
    first_tile = split * per_split
    context_tiles = (context + BLOCK_KV - 1) // BLOCK_KV
    num_steps = jnp.clip(jnp.minimum(per_split, context_tiles - first_tile), 0, tiles_per_split)
    num_pages, max_pages = pages_gmem.shape[1], tables_gmem.shape[1]
    half = RANK // 2
    log2e = math.log2(math.e)

    def page_block(step):  # block index of step's [BLOCK_KV, 576] rows: (layer, page, tile in page, 0)
        tile = first_tile + step  # step < num_steps: this split's own tiles of the context only
        page = tables_gmem[seq, jnp.minimum(tile // tiles_per_page, max_pages - 1)]
        return layer, jnp.clip(page, 0, num_pages - 1), lax.rem(tile, tiles_per_page), 0

    def step_body(idx, k_smem, carry):
        (step,) = idx
        start = (first_tile + step) * BLOCK_KV
        *accs, m, l = carry

        def scores(s_ref):
            plgpu.wgmma(s_ref, q_smem, k_smem.T)
            return s_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((ROWS, BLOCK_KV), jnp.float32))
        token = start + lax.broadcasted_iota(jnp.int32, (ROWS, BLOCK_KV), 1)
        # row r is query token (head_block * 64 + r) // H of the sequence's q_len, which sees the keys before
        # context - q_len + 1 + that index (padding rows past q_len * H see them all)
        query = (head_block * ROWS + lax.broadcasted_iota(jnp.int32, (ROWS, BLOCK_KV), 0)) // num_heads
        visible = context - q_len + 1 + jnp.minimum(query, q_len - 1)
        s = jnp.where(token < visible, s * (scale * log2e), -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        probabilities = p.astype(jnp.bfloat16)
        if p_smem:  # the interpreter's wgmma reads A from shared memory only
            p_smem[0][wg] = probabilities
            plgpu.commit_smem()
            probabilities = p_smem[0].at[wg]

        def values(c):  # V for this warpgroup's columns [wg * 256 + c * chunk, + chunk)
            return k_smem.at[:, pl.ds(wg * half + c * chunk, chunk)]

        accs = [a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in accs]
        if p_smem:  # the interpreter has no accumulator initialised from registers: a product per chunk, added
            def product(c, acc_ref):
                plgpu.wgmma(acc_ref, probabilities, values(c))
                return acc_ref[...]
            accs = [a + pl.run_scoped(functools.partial(product, c), plgpu.ACC((ROWS, chunk), jnp.float32))
                    for c, a in enumerate(accs)]
        else:  # every chunk's P V accumulates in place, issued back to back, one wait for all
            def products(acc_refs):
                for c, acc_ref in enumerate(acc_refs):
                    plgpu.wgmma(acc_ref, probabilities, values(c))
            accs = list(pl.run_state(products)(tuple(plgpu.ACC.init(a) for a in accs)))
        return (*accs, m_new, l)

    def compute(run_pipeline):
        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(q_gmem.at[seq, rows], q_smem, q_barrier)

        plgpu.barrier_wait(q_barrier)
        zero = jnp.zeros((ROWS, chunk), jnp.float32)
        init = (*([zero] * (half // chunk)), jnp.full((ROWS,), -jnp.inf, jnp.float32), jnp.zeros((ROWS,), jnp.float32))
        *accs, m, l = run_pipeline(init)
        empty = l == 0.0
        inv = 1.0 / jnp.where(empty, 1.0, l)
        for c, acc in enumerate(accs):  # straight from registers: no shared memory is left for staging
            o_gmem.at[split, seq, rows, pl.ds(wg * half + c * chunk, chunk)][...] = (
                acc * lax.broadcast_in_dim(jnp.where(empty, 0.0, inv), acc.shape, [0]))

        @pl.when(wg == 0)
        def _():
            lse_gmem.at[split, seq, rows][...] = jnp.where(empty, NO_KEY_LSE,
                                                           (m + jnp.log2(jnp.where(empty, 1.0, l))) / log2e)

    plgpu.emit_pipeline_warp_specialized(
        step_body, grid=(num_steps,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((None, None, BLOCK_KV, WIDTH), page_block,
                                  transforms=wgmma_operand_transforms(WIDTH))],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages, compute_context=compute)(pages_gmem)


def default_splits(num_seqs: int, head_blocks: int, tiles: int, num_sms: int | None = None) -> int:
    """KV splits per (sequence, head block): as many as one wave of CTAs holds (one CTA per SM; ``num_sms``
    default: the tuned config's), at most one per tile. Rounding up instead would start a second, nearly empty
    wave (batch 16: 17 splits = 272 CTAs = three waves, the last of 8), and every split also writes a 128 KB fp32
    partial that the merge reads back."""
    num_sms = num_sms or tuning.tuned(MLADecodeMGPUConfig).num_sms
    return max(1, min(tiles, num_sms // (num_seqs * head_blocks)))


def smem_bytes(stages: int) -> int:
    """Shared memory the kernel allocates: Q ``[64, 576]`` bf16, ``stages`` cache tiles ``[64, 576]`` bf16, and
    the barriers (Q's, and each stage's two)."""
    return 2 * ROWS * WIDTH + stages * 2 * BLOCK_KV * WIDTH + (1 + 2 * stages) * BARRIER_BYTES


@functools.partial(jax.jit, static_argnames=("scale", "q_len", "layer", "config", "interpret"))
def mla_decode_mgpu(q: jax.Array, pages: jax.Array, block_tables: jax.Array, context_lens: jax.Array, *,
                    scale: float, q_len: int = 1, layer: int | None = None, config: MLADecodeMGPUConfig | None = None,
                    interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Decode / verification attention: q ``[N * q_len, H, 576]`` (``q_len`` consecutive query tokens per
    sequence, the last ones of its context, causal among themselves) over ``pages [B, bs, 576]`` bf16 (``[L, B,
    bs, 576]`` with ``layer``), ``block_tables [N, P]``, ``context_lens [N]`` (new tokens included) -> (o_lat
    ``[N * q_len, H, 512]`` in q.dtype, lse ``[N * q_len, H]`` f32), as
    :func:`pallas_kernels.mla.reference.mla_paged_attention_reference` with ``cu_q_lens = q_len * arange(N +
    1)``. A CTA's 64 rows are ``q_len * H`` (token, head) rows of one sequence. ``config``: KV splits, cache
    stages and accumulator chunk (:class:`~pallas_kernels.mla.config.MLADecodeMGPUConfig`; None fields tuned);
    ValueError when the stages do not fit the device's shared memory. ``interpret``: the Mosaic-GPU interpreter
    (default: when no GPU is present)."""
    if layer is None:
        pages, layer = pages[None], 0
    num_tokens, num_heads, width = q.shape
    num_seqs = block_tables.shape[0]
    if q_len < 1 or num_tokens != num_seqs * q_len:
        raise ValueError(f"q has {num_tokens} tokens, not q_len={q_len} for each of the {num_seqs} sequences")
    _, _, block_size, _ = pages.shape
    if width != WIDTH or pages.shape[-1] != WIDTH or pages.dtype != jnp.bfloat16:
        raise ValueError(f"q [N, H, {WIDTH}] and bf16 pages [.., bs, {WIDTH}] expected; got q {q.shape}, pages "
                         f"{pages.dtype}{list(pages.shape)}")
    cfg = tuning.resolve(MLADecodeMGPUConfig, config)
    splits, stages, chunk = cfg.splits, cfg.stages, cfg.chunk
    if block_size % BLOCK_KV or (RANK // 2) % chunk or chunk % 64:
        raise ValueError(f"block_size {block_size} must be a multiple of {BLOCK_KV} and chunk {chunk} 64 or 128")
    tiles_per_page = block_size // BLOCK_KV
    tiles = block_tables.shape[1] * tiles_per_page
    head_blocks = -(-(q_len * num_heads) // ROWS)
    splits = splits or default_splits(num_seqs, head_blocks, tiles, cfg.num_sms)
    tuning.check_smem("mla_decode_mgpu", smem_bytes(stages), f"stages={stages}")
    tiles_per_split = -(-tiles // splits)
    rows = head_blocks * ROWS
    q_rows = q.astype(jnp.bfloat16).reshape(num_seqs, q_len * num_heads, WIDTH)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, rows - q_len * num_heads), (0, 0)))
    kernel = functools.partial(_kernel, layer=layer, scale=float(scale), tiles_per_page=tiles_per_page,
                               tiles_per_split=tiles_per_split, num_splits=splits, chunk=chunk, stages=stages,
                               q_len=q_len, num_heads=num_heads)
    interpret = not on_gpu() if interpret is None else interpret
    p_smem = [plgpu.SMEM((2, ROWS, BLOCK_KV), jnp.bfloat16, transforms=wgmma_operand_transforms(BLOCK_KV))
              ] if interpret else []
    o_parts, lse_parts = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((splits, num_seqs, rows, RANK), jnp.float32),
                  jax.ShapeDtypeStruct((splits, num_seqs, rows), jnp.float32)),
        grid=(num_seqs, head_blocks, splits), grid_names=("seq", "hb", "split"), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=[plgpu.SMEM((ROWS, WIDTH), jnp.bfloat16, transforms=wgmma_operand_transforms(WIDTH)),
                       plgpu.Barrier(num_barriers=1), *p_smem],
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q_rows, pages, fresh_int32_buffer(block_tables), fresh_int32_buffer(context_lens))
    o, lse = merge_partials(o_parts[:, :, :q_len * num_heads], lse_parts[:, :, :q_len * num_heads])
    return o.astype(q.dtype).reshape(num_tokens, num_heads, RANK), lse.reshape(num_tokens, num_heads)
