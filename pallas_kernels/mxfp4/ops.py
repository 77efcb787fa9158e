"""Public MXFP4 / bf16 GEMMs: one call site each, implementation chosen by ``impl``."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import tuning
from pallas_kernels.impl import resolve_impl
from pallas_kernels.mxfp4.config import GroupedGemmConfig, GroupedGemmTiling, MXFP4MGPUConfig
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


def _rule_applies(rule: dict, weight_format: str, rows_per_expert: float) -> bool:
    return (weight_format in rule.get("formats", (weight_format,))
            and rule.get("min_rows_per_expert", 0) <= rows_per_expert <= rule.get("max_rows_per_expert", math.inf))


def tile_config(num_rows: int, num_experts: int, dim_n: int, dim_k: int, weight_format: str,
                widths: tuple[int, ...] | None = None, tiling: GroupedGemmTiling | None = None) -> dict:
    """Kernel tiles for a problem size (static shapes) -> :class:`GroupedGemmConfig` fields: the first rule of
    the tuned table (:class:`~pallas_kernels.mxfp4.config.GroupedGemmTiling`) matching the format and the mean rows
    per expert, shrunk to powers of two that divide ``K`` and ``N`` (every one of ``widths`` when several weight
    matrices share the launch; ``dim_n`` is their sum); then the short-K stage count and, with too few (expert,
    column tile) programs to fill the GPU, a split of K over the smallest divisor of its steps that reaches
    ``split_k_below_programs`` programs (or over every step)."""
    table = tuning.resolve(GroupedGemmTiling, tiling)
    rows_per_expert = num_rows / num_experts
    rule = next(r for r in table.rules if _rule_applies(r, weight_format, rows_per_expert))
    cfg = dict(rule["tiles"])
    cfg = {**cfg, "block_n": _fit(cfg["block_n"], math.gcd(*(widths or (dim_n,)))),
           "block_k": _fit(cfg["block_k"], dim_k)}
    programs = min(num_rows, num_experts) * (dim_n // cfg["block_n"])
    steps = dim_k // cfg["block_k"]
    if cfg.get("weights_lhs") and steps <= table.short_k_steps:
        cfg["num_stages"] = table.short_k_stages
    if 0 < programs < table.split_k_below_programs and steps > 1:  # (no rows: nothing to split)
        want = -(-table.split_k_below_programs // programs)
        cfg["split_k"] = next((d for d in range(want, steps) if steps % d == 0), steps)
    return cfg


def mgpu_tile_config(num_rows: int, num_experts: int, widths: tuple[int, ...]) -> dict:
    """Tiles of the Mosaic-GPU MXFP4 kernel for a problem size (:class:`~pallas_kernels.mxfp4.config.MXFP4MGPUConfig`
    fields): ``decode_block_m``-row tiles and one compute warpgroup per CTA up to ``decode_rows_per_expert`` rows
    per expert on average, otherwise ``prefill_block_m``-row tiles and, where every width allows,
    ``prefill_wgs`` warpgroups (the row tile is then streamed half as often)."""
    cfg = tuning.tuned(MXFP4MGPUConfig)
    if num_rows <= cfg.decode_rows_per_expert * num_experts:
        return dict(block_m=cfg.decode_block_m, wgs=1)
    wide = all(n % (cfg.prefill_wgs * 64) == 0 for n in widths)
    return dict(block_m=cfg.prefill_block_m, wgs=cfg.prefill_wgs if wide else 1)


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
                return mxfp4_grouped_matmul_mgpu(x, flat, None, offset, row_experts=groups,
                                                 config=MXFP4MGPUConfig(block_m=8))
            cfg = mgpu_tile_config(x.shape[0], groups.shape[0], tuple(s.shape[-1] for _, s in matrices))
            return mxfp4_grouped_matmul_mgpu(x, flat, groups, offset, config=MXFP4MGPUConfig(**cfg))
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
                                      per_row=per_row, narrow_scales=narrow_scales, config=GroupedGemmConfig(**cfg))


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
                                      sum_splits=sum_splits, config=GroupedGemmConfig(**cfg), **extra)
