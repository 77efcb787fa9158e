"""MXFP4 grouped GEMM as a Mosaic-GPU (Hopper warpgroup) kernel: decode row counts first, prefill too.

Why: the Triton kernel streams K3's experts at about 28% of copy bandwidth at decode sizes (BENCHMARKS.md, MXFP4
grouped GEMM). It decodes a ``[block_n, block_k]`` tile in registers and then hands it to the MMA, which in
Triton means a round trip through shared memory into the MMA's operand layout: two bytes written and read per
weight against half a byte fetched from HBM. Here, as in Marlin, the decoded weights are the ``wgmma``'s
register A operand directly: the pair-halves bytes (:func:`pallas_kernels.mxfp4.quant.to_pair_halves`) are loaded
from shared memory in the layout whose upcast to 16 bits is the ``wgmma`` A layout, so a byte's low nibble
(column j of one MX block) and high nibble (column j of the next) land where the two K=32 products need them.

Orientation: ``acc [64, BM] = W_tile [64, K] @ x_tile^T`` per compute warpgroup, for 64 output columns of one
expert and a tile of ``BM`` (``block_m``, 8 to 256) rows of that expert. The grid is (row tiles, N / (64 wgs));
a CTA has ``wgs`` compute warpgroups (64 output columns each, sharing the row tile) and a memory warpgroup that
streams the expert's K by TMA through ``stages`` shared-memory stages (``plgpu.emit_pipeline_warp_specialized``).
Per 64 K columns: one ``[64, 32]`` byte tile, two exact E2M1 decodes (:mod:`pallas_kernels.mxfp4.decode`), each
multiplied by its block's E8M0 scale broadcast over the row (a power of two: bf16-exact unless it leaves bf16's
normal range, the same rounding as the Triton kernel), and two K=32 ``wgmma`` against ``x``'s matching 32
columns.

Layouts, made once by :func:`prepare_weights` (a load-time re-layout; the checkpoint bytes stay the loader's
input): packed ``[E, K/64, N, 32]`` (every (expert, 64-column group, 64-row tile) a contiguous 2 KB TMA box) and
scales ``[E, K/32, N]``. Per call, ``x``'s rows are gathered into row tiles ``[T, K/32, BM, 32]`` (rows past a
tile's end repeat the last row; their outputs are dropped) and the ``[T, N, BM]`` tile outputs (in ``x.dtype``) are
scattered back to ``[M, N]``.

Under the Mosaic-GPU interpreter (CPU tests) ``wgmma`` takes A from shared memory only, so there the decoded
tile goes through a shared-memory scratch first. Not the default path until measured on the H200.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tuning
from pallas_kernels.impl import on_gpu
from pallas_kernels.mgpu import BARRIER_BYTES, wgmma_operand_transforms
from pallas_kernels.mxfp4.config import MXFP4MGPUConfig
from pallas_kernels.mxfp4.decode import e2m1_to_bf16, e8m0_to_bf16
from pallas_kernels.mxfp4.quant import from_pair_halves, to_pair_halves
from pallas_kernels.mxfp4.tiles import make_tile_schedule

ROWS_N = 64  # output columns per CTA: one warpgroup's wgmma M
MX_BLOCK = 32
GROUP = 2 * MX_BLOCK  # K columns per pair-halves byte group (32 bytes per row)
BLOCK_MS = (8, 16, 32, 64, 128, 256)  # rows per tile = the wgmma N


def prepare_weights(packed: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Checkpoint-order ``packed [..., N, K/2]``, ``scales [..., N, K/32]`` -> this kernel's ``[..., K/64, N, 32]``
    pair-halves bytes and ``[..., K/32, N]`` scales (leading axes: experts, or layers and experts)."""
    *lead, n, half_k = packed.shape
    if (2 * half_k) % GROUP or n % ROWS_N:
        raise ValueError(f"K={2 * half_k} must be a multiple of {GROUP} and N={n} of {ROWS_N}")
    pairs = to_pair_halves(packed).reshape(*lead, n, half_k // MX_BLOCK, MX_BLOCK)
    return jnp.moveaxis(pairs, -2, -3), jnp.swapaxes(scales, -1, -2)


def restore_weights(packed: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`prepare_weights`: the checkpoint-order bytes and scales."""
    *lead, groups, n, _ = packed.shape
    pairs = jnp.moveaxis(packed, -3, -2).reshape(*lead, n, groups * MX_BLOCK)
    return from_pair_halves(pairs), jnp.swapaxes(scales, -1, -2)


def _kernel(sched_gmem, x_gmem, *refs, part_tiles, num_weight_rows, block_k, stages, wgs, interpret):
    *w_refs, o_gmem = refs[:-1] if interpret else refs
    dec_smem = refs[-1] if interpret else None
    tile, n_tile, wg = lax.axis_index("tile"), lax.axis_index("n"), lax.axis_index("wg")
    row = sched_gmem[tile]  # weight row (expert + offset) of this row tile; -1: no rows of a real expert
    mine = pl.ds(wg * ROWS_N, ROWS_N)  # this compute warpgroup's 64 of the CTA's weight rows

    def step(_, packed_smem, scales_smem, x_smem, acc_ref):
        for g in range(block_k // GROUP):  # static
            codes = packed_smem[g, mine].astype(jnp.uint16)  # [64, 32]: byte j = column j of blocks 2g, 2g + 1
            for half in range(2):
                block = 2 * g + half
                w = e2m1_to_bf16((codes & 0xF) if half == 0 else (codes >> 4))
                w = w * lax.broadcast_in_dim(e8m0_to_bf16(scales_smem[block, mine]), w.shape, [0])
                if interpret:  # the interpreter's wgmma reads A from shared memory only
                    dec_smem[wg] = w
                    plgpu.commit_smem()
                    w = dec_smem.at[wg]
                plgpu.wgmma(acc_ref, w, x_smem.at[block].T)
        plgpu.wgmma_wait(0)
        return acc_ref

    def pipeline(packed_gmem, scales_gmem, first):
        expert, local_tile = jnp.clip(row, 0, num_weight_rows - 1), n_tile - first

        def compute(run_pipeline):
            acc = pl.run_scoped(lambda acc_ref: run_pipeline(acc_ref)[...],
                                plgpu.ACC((ROWS_N, x_gmem.shape[2]), jnp.float32))
            o_gmem.at[tile, pl.ds(n_tile * wgs * ROWS_N + wg * ROWS_N, ROWS_N)][...] = acc.astype(o_gmem.dtype)

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(x_gmem.shape[1] * MX_BLOCK // block_k,), memory_registers=40, wg_axis="wg",
            num_compute_wgs=wgs, max_concurrent_steps=stages, compute_context=compute,
            in_specs=[
                plgpu.BlockSpec((None, block_k // GROUP, wgs * ROWS_N, MX_BLOCK),
                                lambda k: (expert, k, local_tile, 0), transforms=wgmma_operand_transforms(MX_BLOCK, 8)),
                plgpu.BlockSpec((None, block_k // MX_BLOCK, wgs * ROWS_N), lambda k: (expert, k, local_tile)),
                plgpu.BlockSpec((None, block_k // MX_BLOCK, x_gmem.shape[2], MX_BLOCK), lambda k: (tile, k, 0, 0),
                                transforms=wgmma_operand_transforms(MX_BLOCK, 16)),
            ])(packed_gmem, scales_gmem, x_gmem)

    first = 0
    for part, tiles in enumerate(part_tiles):  # static: one pipeline per weight matrix
        pl.when((row >= 0) & (n_tile >= first) & (n_tile < first + tiles))(
            functools.partial(pipeline, *w_refs[2 * part:2 * part + 2], first))
        first += tiles


def smem_bytes(block_k: int, block_m: int, stages: int, wgs: int) -> int:
    """Shared memory the pipeline allocates: per stage the ``[block_k / 64, wgs * 64, 32]`` weight bytes, their
    ``[block_k / 32, wgs * 64]`` scales and x's ``[block_k / 32, block_m, 32]`` bf16 columns, and two barriers."""
    per_stage = (block_k // GROUP) * wgs * ROWS_N * MX_BLOCK + (block_k // MX_BLOCK) * wgs * ROWS_N + (
        block_k // MX_BLOCK) * block_m * MX_BLOCK * 2
    return stages * (per_stage + 2 * BARRIER_BYTES)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def mxfp4_grouped_matmul_mgpu(x: jax.Array, matrices: Sequence[tuple[jax.Array, jax.Array]],
                              group_sizes: jax.Array | None = None, expert_offset: jax.Array | int = 0, *,
                              row_experts: jax.Array | None = None, config: MXFP4MGPUConfig | None = None,
                              interpret: bool | None = None) -> jax.Array:
    """``x [M, K]`` bf16 rows sorted by expert times each of ``matrices``, ``(packed [E', K/64, N_i, 32], scales
    [E', K/32, N_i])`` from :func:`prepare_weights`, side by side -> ``[M, sum N_i]`` in ``x.dtype`` (fp32
    accumulation; rows at or past ``sum(group_sizes)`` are zero), as
    :func:`pallas_kernels.mxfp4.mxfp4_grouped_matmul_concat` on the checkpoint bytes. Group ``e`` of
    ``group_sizes [E]`` uses weight row ``expert_offset + e`` (traced; e.g. layer j of ``[L*E, ...]`` stacks).
    Instead of ``group_sizes``, ``row_experts [M']`` (ids in ``[0, E')`` after the offset) may name the expert of
    every output row, rows in any order, output row m from ``x[m // (M' / M)]`` (a decode step's (token, choice)
    pairs without a sort): every row is then its own tile (use ``block_m=8``), and an expert named by several rows
    is streamed once per row.
    ``config`` (:class:`~pallas_kernels.mxfp4.config.MXFP4MGPUConfig`, None fields tuned): ``block_k``: K columns
    per pipeline step (a multiple of 64 dividing K; default the largest of 256, 128, 64
    that divides K); ``block_m``: rows per tile, the wgmma's N (one of ``BLOCK_MS``: 8 or 16 at decode, where most
    experts get one or two rows; 128 or 256 at prefill, where the decode of a weight tile is shared by that many
    rows); ``stages``: shared-memory stages in flight; ``wgs``: compute warpgroups per CTA, each 64 output columns
    (1 or 2; 2 halves how often a row tile is streamed, for prefill, and needs every ``N_i`` a multiple of 128).
    Fewer stages are taken where they do not fit the device's shared memory (:func:`smem_bytes`).
    ``interpret``: the Mosaic-GPU interpreter (default: when no GPU is present)."""
    num_rows, dim_k = x.shape
    if (group_sizes is None) == (row_experts is None) or (row_experts is not None
                                                           and row_experts.shape[0] % num_rows):
        raise ValueError("pass exactly one of group_sizes and row_experts (whose length a multiple of x's rows)")
    num_experts = 1 if group_sizes is None else group_sizes.shape[0]
    widths = []
    for packed, scales in matrices:
        weight_rows, groups, dim_n, group_bytes = packed.shape if packed.ndim == 4 else (0, 0, 0, 0)
        if (group_bytes != MX_BLOCK or groups * GROUP != dim_k or weight_rows < num_experts
                or scales.shape != (weight_rows, dim_k // MX_BLOCK, dim_n) or weight_rows != matrices[0][0].shape[0]):
            raise ValueError(f"packed [E', K/64, N, 32] and scales [E', K/32, N] from prepare_weights expected for "
                             f"K={dim_k}, E'>={num_experts}; got {packed.shape} and {scales.shape}")
        widths.append(dim_n)
    cfg = tuning.resolve(MXFP4MGPUConfig, config)
    block_k = cfg.block_k or next((b for b in (256, 128, GROUP) if dim_k % b == 0), GROUP)
    block_m, wgs = cfg.block_m, cfg.wgs
    if any(n % (wgs * ROWS_N) for n in widths) or wgs not in (1, 2):
        raise ValueError(f"wgs={wgs} must be 1 or 2, with every N in {widths} a multiple of {wgs * ROWS_N}")
    if block_k % GROUP or dim_k % block_k or block_m not in BLOCK_MS:
        raise ValueError(f"block_k={block_k} must be a multiple of {GROUP} dividing K={dim_k}; block_m={block_m} one "
                         f"of {BLOCK_MS}")
    stages = tuning.fit("mxfp4_grouped_matmul_mgpu", cfg.stages, lambda n: smem_bytes(block_k, block_m, n, wgs),
                        range(cfg.stages - 1, 0, -1), what=f"block_k={block_k}, block_m={block_m}, wgs={wgs}")
    offset = jnp.asarray(expert_offset, jnp.int32)
    in_tile = jnp.arange(block_m)[None, :]
    if row_experts is None:
        schedule = make_tile_schedule(group_sizes, num_rows, block_m)  # [3, T]: expert, first row, end row
        real = (schedule[0] >= 0) & (schedule[0] < num_experts)
        weight_row = jnp.where(real, schedule[0] + offset, -1)
        source = schedule[1][:, None] + in_tile  # [T, BM]: x row of every tile row
        valid = (source < schedule[2][:, None]) & real[:, None]
        num_out, out_rows = num_rows, source
    else:  # every output row its own tile: row 0 holds it, the other rows repeat it and are dropped
        num_out = row_experts.shape[0]
        weight_row = row_experts.astype(jnp.int32) + offset
        out_rows = jnp.arange(num_out)[:, None] + 0 * in_tile
        source, valid = out_rows // (num_out // num_rows), in_tile == 0
    x_tiles = x.astype(jnp.bfloat16)[jnp.minimum(source, num_rows - 1)]  # [T, BM, K]
    x_tiles = jnp.transpose(x_tiles.reshape(-1, block_m, dim_k // MX_BLOCK, MX_BLOCK), (0, 2, 1, 3))
    interpret = not on_gpu() if interpret is None else interpret
    num_tiles, dim_n = weight_row.shape[0], sum(widths)
    kernel = functools.partial(_kernel, part_tiles=tuple(n // (wgs * ROWS_N) for n in widths),
                               num_weight_rows=matrices[0][0].shape[0], block_k=block_k, stages=stages, wgs=wgs,
                               interpret=interpret)
    dec_smem = [plgpu.SMEM((wgs, ROWS_N, MX_BLOCK), jnp.bfloat16, transforms=wgmma_operand_transforms(MX_BLOCK, 16))
                ] if interpret else []
    tiles_out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_tiles, dim_n, block_m), x.dtype),
        grid=(num_tiles, dim_n // (wgs * ROWS_N)), grid_names=("tile", "n"), num_threads=wgs + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dec_smem,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(weight_row, x_tiles, *(a for m in matrices for a in m))
    target = jnp.where(valid, out_rows, num_out).reshape(-1)  # invalid rows go past the end and are dropped
    return jnp.zeros((num_out, dim_n), x.dtype).at[target].set(
        jnp.transpose(tiles_out, (0, 2, 1)).reshape(-1, dim_n), mode="drop")
