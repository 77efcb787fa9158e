"""Public MXFP4 / bf16 GEMMs: one call site each, implementation chosen by ``impl``."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.impl import resolve_impl
from pallas_kernels.mxfp4.decode_mgpu import mxfp4_grouped_matmul_mgpu, restore_weights
from pallas_kernels.mxfp4.kernel import (
    PAIRS_FORMATS,
    SHARED_EXPERT,
    grouped_gemm_concat_pallas,
)
from pallas_kernels.mxfp4.quant import FROM_BYTE_ORDER, dequantize
from pallas_kernels.mxfp4.reference import (
    grouped_matmul_reference,
    mxfp4_matmul_reference,
    rows_matmul_reference,
)


def _fit(tile: int, dim: int) -> int:
    """Largest power of two <= ``tile`` dividing ``dim``."""
    while dim % tile:
        tile //= 2
    return tile


SPLIT_K_BELOW_PROGRAMS = 128  # about one program per SM of the H200


def tile_config(num_rows: int, num_experts: int, dim_n: int, dim_k: int, weight_format: str,
                widths: tuple[int, ...] | None = None) -> dict:
    """Kernel tiles for a problem size (static shapes): the fastest configs of the H200 sweep in bench.py,
    shrunk to powers of two that divide ``K`` and ``N`` (every one of ``widths`` when several weight matrices
    share the launch; ``dim_n`` is their sum)."""
    rows_per_expert = num_rows / num_experts
    pairs = weight_format in PAIRS_FORMATS
    if rows_per_expert <= 16 and weight_format == "mxfp4_words":
        # Word decode, x as the MMA's A operand. K3 gate + up, narrow scales, H200 (session 17 sweep): 8 / 64 /
        # 256 tokens over 56 experts and 256 over 112: 50.5 / 247.7 / 313.2 / 601.6 us against 51.9 / 258.8 /
        # 330.3 / 642.6 us for the pair-halves pick below (and 66.6 / 325.4 / 414.3 / 801.2 us for pair halves).
        # From 2 rows per expert, 2 warps (each 32 of the 64 columns, so x's fragments feed twice the MMAs):
        # 256 tokens over 56 / 112 experts (4.3 / 4.9 rows each) 305.3-307.0 / 572.8-573.4 us against
        # 317.2-318.8 / 606.6-606.9 with 4 warps; at 4 / 8 tokens (0.05 / 0.2 rows) 4 warps are ahead (34.1 /
        # 75.1 against 35.8 / 78.2 us), at 64 (1.2 rows) within 1% (231.0-232.4 against 229.4-230.1; session 18).
        # No size between 1.2 and 4.3 rows per expert was timed.
        cfg = dict(block_m=16, block_n=64, block_k=512, num_warps=2 if rows_per_expert >= 2 else 4, num_stages=2)
    elif rows_per_expert <= 16 and pairs:
        # Pair-halves decode: 256-column K steps, x as the MMA's A operand. K3 gate + up on the H200 (session 16),
        # 8 / 64 / 256 tokens over 56 experts: 66.3 / 324.8 / 413.4 us against 88.0 / 469.8 / 605.4 us for the
        # checkpoint order's tiling below.
        cfg = dict(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)
    elif rows_per_expert <= 16:  # decode: one row tile per expert, the weight tile as the MMA's register operand
        cfg = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, weights_lhs=True)
    elif rows_per_expert <= 32 and weight_format == "mxfp4_words":
        # 1024 tokens over 56 experts (18 rows each), H200 session 17: 429.6 us against 518.1 for 64-row tiles
        cfg = dict(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=3)
    elif rows_per_expert <= 64:  # (the word order reads its scales 128 columns at a time)
        cfg = dict(block_m=64, block_n=128, block_k=128 if weight_format == "mxfp4_words" else 64, num_warps=4,
                   num_stages=3)
    elif weight_format == "mxfp4_words":  # K3 gate + up, 8192 tokens over 56 experts: 1412 us (36% of bf16 matmul)
        cfg = dict(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=2)
    elif pairs:  # K3 gate + up, 8192 tokens over 56 experts: 1845 us (28% of bf16 matmul) against 2390 us below
        cfg = dict(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
    else:
        cfg = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
    cfg = {**cfg, "block_n": _fit(cfg["block_n"], math.gcd(*(widths or (dim_n,)))),
           "block_k": _fit(cfg["block_k"], dim_k)}
    # Too few (expert, column-tile) programs to fill the GPU: split K over the smallest divisor of the K steps
    # that reaches SPLIT_K_BELOW_PROGRAMS programs (or over every step). H200 device times (BENCHMARKS.md,
    # session 5): one row of N=4096 (64 programs) 8.5 us whole, 7.9 split in 2; N=2304, K=4096 (36 programs)
    # 11.7 / 9.1 / 8.4 us in 1 / 2 / 4; 8 experts of N=1024 (128 programs) 11.2 whole, 12.5 split in 2.
    programs = min(num_rows, num_experts) * (dim_n // cfg["block_n"])
    steps = dim_k // cfg["block_k"]
    if cfg.get("weights_lhs") and steps <= 8:
        # Short K loops fill a 4-deep pipeline for little work: one MoE down projection at decode (8 rows of
        # 8 experts, K=1024, N=2304) 14.1 -> 11.5 us with 3 stages on the H200 (session 8 probe; 2 stages 13.4).
        cfg["num_stages"] = 3
    if 0 < programs < SPLIT_K_BELOW_PROGRAMS and steps > 1:  # (no rows: nothing to split)
        want = -(-SPLIT_K_BELOW_PROGRAMS // programs)
        cfg["split_k"] = next((d for d in range(want, steps) if steps % d == 0), steps)
    return cfg


def mgpu_tile_config(num_rows: int, num_experts: int, widths: tuple[int, ...]) -> dict:
    """Tiles of the Mosaic-GPU MXFP4 kernel for a problem size: 16-row tiles and one compute warpgroup per CTA
    at decode (at most 16 rows per expert on average), otherwise 128-row tiles and, where every width allows,
    two warpgroups (the row tile is then streamed half as often). A first guess: the H200 sweep
    (``BENCH_SUITE=mgpu``) has not run yet."""
    if num_rows <= 16 * num_experts:
        return dict(block_m=16, wgs=1)
    return dict(block_m=128, wgs=2 if all(n % 128 == 0 for n in widths) else 1)


def _flatten_layers(layer: int | None, *weights: jax.Array) -> tuple[tuple[jax.Array, ...], int]:
    """Stacked ``[L, E, ...]`` weights -> their ``[L*E, ...]`` bitcasts and the offset of ``layer``'s experts
    (a slice ``w[layer]`` fed to the kernel would be copied by XLA on every call). The offset is passed to the
    kernel as data, so all layers share one compiled kernel."""
    if layer is None:
        return weights, 0
    num_layers, num_experts = weights[0].shape[:2]
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer} out of range for {num_layers} stacked layers")
    return tuple(w.reshape(num_layers * num_experts, *w.shape[2:]) for w in weights), layer * num_experts


def mxfp4_grouped_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, group_sizes: jax.Array, *,
                         layer: int | None = None, impl: str | None = None) -> jax.Array:
    """``x [M, K]`` bf16 rows sorted by expert, ``packed [E, N, K/2]`` uint8, ``scales [E, N, K/32]`` uint8
    (compressed-tensors layout), ``group_sizes [E]`` int32 -> ``x @ W_e.T`` ``[M, N]`` in ``x.dtype``.
    With ``layer`` (a Python int), packed / scales are stacked ``[L, E, ...]`` and layer ``layer`` is used.

    fp32 accumulation; rows at or past ``sum(group_sizes)`` (which must be ``<= M``) are zero.
    """
    return mxfp4_grouped_matmul_concat(x, ((packed, scales),), group_sizes, layer=layer, impl=impl)


BYTE_ORDERS = {"checkpoint": "mxfp4", "pairs": "mxfp4_pairs", "words": "mxfp4_words", "mgpu": "mgpu"}
"""Byte order of packed MXFP4 weights -> the grouped kernel's ``weight_format``: the compressed-tensors order,
the pair-halves order of :func:`pallas_kernels.mxfp4.quant.to_pair_halves`, the word order of
:func:`pallas_kernels.mxfp4.quant.to_word_order`, or the Mosaic-GPU decode kernel's layout
(:func:`pallas_kernels.mxfp4.decode_mgpu.prepare_weights`: ``packed [E, K/64, N, 32]``, ``scales [E, K/32,
N]``)."""


def mxfp4_grouped_matmul_concat(x: jax.Array, matrices: Sequence[tuple[jax.Array, jax.Array]],
                                group_sizes: jax.Array | None = None, *, row_experts: jax.Array | None = None,
                                layer: int | None = None, impl: str | None = None,
                                byte_order: str = "checkpoint", narrow_scales: bool = False) -> jax.Array:
    """:func:`mxfp4_grouped_matmul` against several ``(packed, scales)`` matrices of the same K (e.g. the gate
    and up projections): their products side by side, ``[M, sum N_i]``, from one kernel launch.

    Instead of ``group_sizes`` (rows sorted by expert), ``row_experts [M]`` int32 may name each output row's
    expert (rows in any order, each row its own tile, x's rows each used by ``M / len(x)`` consecutive output
    rows; for a few decode rows, see :func:`grouped_matmul_concat`).

    ``byte_order``: ``"checkpoint"``, or ``"pairs"`` for ``packed`` in the pair-halves order (K a multiple of
    64; the kernel's ``"mxfp4_pairs"`` format), ``"words"`` for the word order (K a multiple of 128;
    ``narrow_scales``: every scale code is at most 128, see :func:`pallas_kernels.mxfp4.kernel.scales_are_narrow`),
    or ``"mgpu"`` for the Mosaic-GPU kernel's layout (see ``BYTE_ORDERS``)."""
    if byte_order not in BYTE_ORDERS:
        raise ValueError(f"byte_order must be one of {sorted(BYTE_ORDERS)}, got {byte_order!r}")
    groups, per_row = _groups(group_sizes, row_experts, x)
    if byte_order == "mgpu":
        if resolve_impl(impl) == "reference":
            matrices = [restore_weights(p, s) for p, s in matrices]
            byte_order = "checkpoint"
        else:
            flat, offset = _flatten_layers(layer, *(a for m in matrices for a in m))
            flat = tuple(zip(flat[0::2], flat[1::2]))
            if per_row:  # every (token, expert) row its own 8-row tile
                return mxfp4_grouped_matmul_mgpu(x, flat, None, offset, row_experts=groups, block_m=8)
            cfg = mgpu_tile_config(x.shape[0], groups.shape[0], tuple(s.shape[-1] for _, s in matrices))
            return mxfp4_grouped_matmul_mgpu(x, flat, groups, offset, **cfg)
    if resolve_impl(impl) == "reference":
        pick = (lambda a: a) if layer is None else (lambda a: a[layer])
        unpair = FROM_BYTE_ORDER.get(byte_order, lambda a: a)
        product, x = (rows_matmul_reference, _repeat_rows(x, groups)) if per_row else (grouped_matmul_reference, x)
        return jnp.concatenate([product(x, jnp.swapaxes(dequantize(unpair(pick(p)), pick(s), jnp.float32), 1, 2),
                                        groups) for p, s in matrices], axis=-1)
    flat, offset = _flatten_layers(layer, *(a for m in matrices for a in m))
    matrices = tuple(zip(flat[0::2], flat[1::2]))
    widths = tuple(p.shape[1] for p, _ in matrices)
    rows = groups.shape[0] if per_row else x.shape[0]
    cfg = tile_config(rows, rows if per_row else groups.shape[0], sum(widths), x.shape[1], BYTE_ORDERS[byte_order],
                      widths)
    return grouped_gemm_concat_pallas(x, matrices, groups, offset, weight_format=BYTE_ORDERS[byte_order],
                                      per_row=per_row, narrow_scales=narrow_scales, **cfg)


def _groups(group_sizes: jax.Array | None, row_experts: jax.Array | None, x: jax.Array) -> tuple[jax.Array, bool]:
    """Exactly one of the two row-to-expert maps -> (it, whether it is per row)."""
    if (group_sizes is None) == (row_experts is None):
        raise ValueError("pass exactly one of group_sizes and row_experts")
    if row_experts is not None and row_experts.shape[0] % x.shape[0]:
        raise ValueError(f"row_experts has {row_experts.shape[0]} rows, not a multiple of x's {x.shape[0]}")
    return (group_sizes, False) if row_experts is None else (row_experts, True)


def _repeat_rows(x: jax.Array, row_experts: jax.Array) -> jax.Array:
    """x's rows each repeated for ``len(row_experts) / len(x)`` consecutive output rows."""
    return jnp.repeat(x, row_experts.shape[0] // x.shape[0], axis=0)


def mxfp4_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, *, impl: str | None = None) -> jax.Array:
    """``x [M, K]`` bf16, ``packed [N, K/2]`` uint8, ``scales [N, K/32]`` uint8 -> ``x @ W.T`` ``[M, N]`` (W4A16).

    ``impl="pallas"`` is the exact bf16 decode fused by XLA into its GEMM (``dequantize(..., bfloat16)`` then a
    bf16 dot with fp32 accumulation): on the H200 it measured 38.8 us at M=64, K=7168, N=2048 against 90 us
    for the best config of our Triton kernel (bench.py ``dense_case``); the kernel stays reachable as
    ``mxfp4_grouped_matmul`` with one group.
    """
    if resolve_impl(impl) == "reference":
        return mxfp4_matmul_reference(x, packed, scales)
    w = dequantize(packed, scales, jnp.bfloat16)
    return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
                   layer: int | None = None, impl: str | None = None) -> jax.Array:
    """bf16 grouped GEMM: ``x [M, K]`` rows sorted by expert, ``w [E, K, N]`` (``[E, N, K]`` with
    ``transpose_rhs``, the torch ``[out, in]`` layout), ``group_sizes [E]`` -> ``[M, N]`` in ``x.dtype``.
    With ``layer`` (a Python int), ``w`` is stacked ``[L, E, ...]`` and layer ``layer`` is used.

    Same contract as ``jax.lax.ragged_dot`` (rows past ``sum(group_sizes)`` are zero) without its dense-masked
    GPU lowering.
    """
    return grouped_matmul_concat(x, (w,), group_sizes, transpose_rhs=transpose_rhs, layer=layer, impl=impl)


def grouped_matmul_concat(x: jax.Array, ws: Sequence[jax.Array], group_sizes: jax.Array | None = None, *,
                          row_experts: jax.Array | None = None, transpose_rhs: bool = False,
                          layer: int | None = None, impl: str | None = None, sum_splits: bool = True,
                          shared: Sequence[jax.Array] = ()) -> jax.Array:
    """:func:`grouped_matmul` against several weights of the same K and leading shape: ``[M, sum N_i]``, the
    products side by side, from one kernel launch (Pallas).

    Instead of ``group_sizes`` (rows sorted by expert), ``row_experts [M]`` int32 may name each output row's
    expert: rows in any order, ``x[m // r] @ w[row_experts[m]]`` with ``r = M / len(x)`` (each x row feeds r
    consecutive output rows, e.g. a token's k expert choices, without materialising the repeat), each row its
    own tile. At decode (a few (token, expert) pairs) this saves the sort, gather, group counting and scatter
    around the call; an expert named by several rows is read once per row, so it suits only a few rows.

    ``sum_splits=False``: ``[M, P, sum N_i]``, partial products that sum to the result (the kernel's split-K
    parts, float32; ``P = 1`` on the reference path), for a consumer that adds them itself.

    ``shared`` (with ``row_experts`` and ``layer``): the shared expert's stacked weights ``[L, K, N_i]`` (``[L,
    N_i, K]`` with ``transpose_rhs``), one per entry of ``ws``; rows whose expert is ``SHARED_EXPERT`` (-1) use
    layer ``layer`` of them, in the same launch as the routed rows."""
    groups, per_row = _groups(group_sizes, row_experts, x)
    if shared and (not per_row or layer is None or len(shared) != len(ws)):
        raise ValueError("shared needs row_experts, layer and one shared matrix per routed matrix")
    if resolve_impl(impl) == "reference":
        pick = (lambda a: a) if layer is None else (lambda a: a[layer])
        if shared:  # the shared expert as one more expert row, after the routed ones
            ws = [jnp.concatenate([pick(w), v[layer][None]]) for w, v in zip(ws, shared)]
            pick = lambda a: a  # noqa: E731
            groups = jnp.where(groups == SHARED_EXPERT, ws[0].shape[0] - 1, groups)
        product, x = (rows_matmul_reference, _repeat_rows(x, groups)) if per_row else (grouped_matmul_reference, x)
        out = jnp.concatenate([product(x, jnp.swapaxes(pick(w), 1, 2) if transpose_rhs else pick(w), groups)
                               for w in ws], axis=-1)
        return out if sum_splits else out[:, None, :]
    extra = dict(shared=tuple((v,) for v in shared), shared_offset=layer) if shared else {}
    ws, offset = _flatten_layers(layer, *ws)
    widths = tuple(w.shape[1] if transpose_rhs else w.shape[2] for w in ws)
    dim_k = ws[0].shape[2] if transpose_rhs else ws[0].shape[1]
    rows = groups.shape[0] if per_row else x.shape[0]
    cfg = tile_config(rows, rows if per_row else groups.shape[0], sum(widths), dim_k, "bf16", widths)
    return grouped_gemm_concat_pallas(x, tuple((w,) for w in ws), groups, offset,
                                      weight_format="bf16_nk" if transpose_rhs else "bf16", per_row=per_row,
                                      sum_splits=sum_splits, **cfg, **extra)
