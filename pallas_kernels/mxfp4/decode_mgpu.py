"""MXFP4 grouped GEMM for decode-sized row counts as a Mosaic-GPU (Hopper warpgroup) kernel.

Why: the Triton kernel streams K3's experts at about 28% of copy bandwidth at decode sizes (BENCHMARKS.md,
session 12). It decodes a ``[block_n, block_k]`` tile in registers and then hands it to the MMA, which in
Triton means a round trip through shared memory into the MMA's operand layout: two bytes written and read per
weight against half a byte fetched from HBM. Here, as in Marlin, the decoded weights are the ``wgmma``'s
register A operand directly: the pair-halves bytes (:func:`kimi_jax.quant.mxfp4.to_pair_halves`) are loaded
from shared memory in the layout whose upcast to 16 bits is the ``wgmma`` A layout, so a byte's low nibble
(column j of one MX block) and high nibble (column j of the next) land where the two K=32 products need them.

Orientation (decode): ``acc [64, BM] = W_tile [64, K] @ x_tile^T`` for 64 output columns of one expert and a tile
of ``BM`` (16) rows of that expert; the grid is (row tiles, N / 64) and each CTA streams its expert's K by TMA
through ``stages`` shared-memory stages (``plgpu.emit_pipeline``). Per 64 K columns: one ``[64, 32]`` byte tile,
two E2M1 decodes (exact, as :func:`pallas_kernels.mxfp4.kernel._e2m1_to_bf16`), each multiplied by its block's
E8M0 scale broadcast over the row (a power of two: bf16-exact unless it leaves bf16's normal range, the same
rounding as the Triton kernel), and two K=32 ``wgmma`` against ``x``'s matching 32 columns.

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kimi_jax.quant.mxfp4 import to_pair_halves
from pallas_kernels.impl import on_gpu
from pallas_kernels.mxfp4.tiles import make_tile_schedule

ROWS_N = 64  # output columns per CTA: one warpgroup's wgmma M
BLOCK_M = 16  # activation rows per tile: the wgmma N
MX_BLOCK = 32
GROUP = 2 * MX_BLOCK  # K columns per pair-halves byte group (32 bytes per row)


def prepare_weights(packed: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Checkpoint-order ``packed [E, N, K/2]``, ``scales [E, N, K/32]`` -> this kernel's ``[E, K/64, N, 32]``
    pair-halves bytes and ``[E, K/32, N]`` scales."""
    num_experts, n, half_k = packed.shape
    if (2 * half_k) % GROUP or n % ROWS_N:
        raise ValueError(f"K={2 * half_k} must be a multiple of {GROUP} and N={n} of {ROWS_N}")
    pairs = to_pair_halves(packed).reshape(num_experts, n, half_k // MX_BLOCK, MX_BLOCK)
    return jnp.transpose(pairs, (0, 2, 1, 3)), jnp.transpose(scales, (0, 2, 1))


def _e2m1_bits(codes: jax.Array) -> jax.Array:
    """uint16 E2M1 codes (0..15) -> exact bf16 values (the Triton kernel's decode)."""
    mag = codes & 7
    bits = jnp.where(mag >= 2, (mag << 6) + 0x3F00, mag * 0x3F00) | ((codes & 8) << 12)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def _e8m0_bf16(scales: jax.Array) -> jax.Array:
    """uint8 E8M0 exponents -> bf16 ``2**(s - 127)`` (code 0 is the bf16 subnormal 2**-127)."""
    s = scales.astype(jnp.uint16)
    return lax.bitcast_convert_type(jnp.where(s == 0, jnp.uint16(0x40), s << 7), jnp.bfloat16)


def _kernel(sched_gmem, packed_gmem, scales_gmem, x_gmem, o_gmem, *dec_smem, num_experts, block_k, stages):
    tile, n_tile = lax.axis_index("tile"), lax.axis_index("n")
    group = sched_gmem[0, tile]
    expert = jnp.clip(group, 0, num_experts - 1)

    def step(acc_ref, _, packed_smem, scales_smem, x_smem):
        for g in range(block_k // GROUP):  # static
            codes = packed_smem[g].astype(jnp.uint16)  # [64, 32]: byte j = column j of blocks 2g and 2g + 1
            for half in range(2):
                block = 2 * g + half
                w = _e2m1_bits((codes & 0xF) if half == 0 else (codes >> 4))
                w = w * lax.broadcast_in_dim(_e8m0_bf16(scales_smem[block]), w.shape, [0])
                if dec_smem:  # the interpreter's wgmma reads A from shared memory only
                    dec_smem[0][...] = w
                    plgpu.commit_smem()
                    w = dec_smem[0]
                plgpu.wgmma(acc_ref, w, x_smem.at[block].T)
        plgpu.wgmma_wait(0)

    def run(acc_ref):
        plgpu.emit_pipeline(
            functools.partial(step, acc_ref), grid=(x_gmem.shape[1] * MX_BLOCK // block_k,),
            max_concurrent_steps=stages,
            in_specs=[
                plgpu.BlockSpec((None, block_k // GROUP, ROWS_N, MX_BLOCK), lambda k: (expert, k, n_tile, 0),
                                transforms=_transforms(MX_BLOCK, 8)),
                plgpu.BlockSpec((None, block_k // MX_BLOCK, ROWS_N), lambda k: (expert, k, n_tile)),
                plgpu.BlockSpec((None, block_k // MX_BLOCK, BLOCK_M, MX_BLOCK), lambda k: (tile, k, 0, 0),
                                transforms=_transforms(MX_BLOCK, 16)),
            ])(packed_gmem, scales_gmem, x_gmem)
        return acc_ref[...]

    @pl.when((group >= 0) & (group < num_experts))
    def _():
        acc = pl.run_scoped(run, plgpu.ACC((ROWS_N, BLOCK_M), jnp.float32))
        o_gmem.at[tile, pl.ds(n_tile * ROWS_N, ROWS_N)][...] = acc.astype(o_gmem.dtype)


def _transforms(minor: int, bits: int):
    """Shared-memory tiling + swizzle for a wgmma operand whose minor dimension holds ``minor`` elements."""
    swizzle = plgpu.find_swizzle(minor * bits, "operand")
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


@functools.partial(jax.jit, static_argnames=("block_k", "stages", "interpret"))
def mxfp4_grouped_matmul_mgpu(x: jax.Array, packed: jax.Array, scales: jax.Array, group_sizes: jax.Array, *,
                              block_k: int = 256, stages: int = 4, interpret: bool | None = None) -> jax.Array:
    """``x [M, K]`` bf16 rows sorted by expert, ``packed [E, K/64, N, 32]`` / ``scales [E, K/32, N]`` from
    :func:`prepare_weights`, ``group_sizes [E]`` -> ``[M, N]`` in ``x.dtype`` (fp32 accumulation; rows at or
    past ``sum(group_sizes)`` are zero), as :func:`pallas_kernels.mxfp4.mxfp4_grouped_matmul` on the checkpoint
    bytes. ``block_k``: K columns per pipeline step (a multiple of 64 dividing K); ``stages``: shared-memory
    stages in flight. ``interpret``: the Mosaic-GPU interpreter (default: when no GPU is present)."""
    num_rows, dim_k = x.shape
    num_experts, groups, dim_n, group_bytes = packed.shape if packed.ndim == 4 else (0, 0, 0, 0)
    if group_bytes != MX_BLOCK or groups * GROUP != dim_k or scales.shape != (num_experts, dim_k // MX_BLOCK, dim_n):
        raise ValueError(f"packed [E, K/64, N, 32] and scales [E, K/32, N] from prepare_weights expected for K={dim_k}; "
                         f"got {packed.shape} and {scales.shape}")
    if block_k % GROUP or dim_k % block_k or group_sizes.shape != (num_experts,):
        raise ValueError(f"block_k={block_k} must be a multiple of {GROUP} dividing K={dim_k}; group_sizes [E]")
    schedule = make_tile_schedule(group_sizes, num_rows, BLOCK_M)  # [3, T]: expert, first row, end row
    rows = schedule[1][:, None] + jnp.arange(BLOCK_M)[None, :]  # [T, BM]
    x_tiles = x.astype(jnp.bfloat16)[jnp.minimum(rows, num_rows - 1)]  # [T, BM, K]
    x_tiles = jnp.transpose(x_tiles.reshape(-1, BLOCK_M, dim_k // MX_BLOCK, MX_BLOCK), (0, 2, 1, 3))
    interpret = not on_gpu() if interpret is None else interpret
    num_tiles = schedule.shape[1]
    kernel = functools.partial(_kernel, num_experts=num_experts, block_k=block_k, stages=stages)
    dec_smem = [plgpu.SMEM((ROWS_N, MX_BLOCK), jnp.bfloat16, transforms=_transforms(MX_BLOCK, 16))] if interpret else []
    tiles_out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_tiles, dim_n, BLOCK_M), x.dtype),
        grid=(num_tiles, dim_n // ROWS_N), grid_names=("tile", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dec_smem,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(schedule, packed, scales, x_tiles)
    valid = (rows < schedule[2][:, None]) & (schedule[0][:, None] >= 0) & (schedule[0][:, None] < num_experts)
    target = jnp.where(valid, rows, num_rows).reshape(-1)  # invalid rows go past the end and are dropped
    return jnp.zeros((num_rows, dim_n), x.dtype).at[target].set(
        jnp.transpose(tiles_out, (0, 2, 1)).reshape(-1, dim_n), mode="drop")
