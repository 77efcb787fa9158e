"""Pallas (Triton-style) absorbed MLA attention over a paged latent cache, for decode, chunked prefill and mixes.

Work split: the packed queries are cut into *query tiles* (up to ``block_q`` consecutive tokens of one sequence);
one program handles a tile x ``block_h`` heads (``block_q * block_h`` score rows, all sharing the single latent
K/V head) x one *KV split* (a share of the keys the tile can see). Every program streams its keys ``block_k`` at a
time, gathering cache rows through the block table (so ``block_k`` is independent of the page size), and keeps an
online softmax. With several splits, each writes (o, lse) partials that an XLA epilogue merges by log-sum-exp.
Rows that a key must not reach (other requests' pages, rows past the context) are never loaded (masked loads give
0), so NaN-poisoned pages cannot leak in. Semantics match
:func:`pallas_kernels.mla.reference.mla_paged_attention_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tuning
from pallas_kernels.impl import interpret_mode
from pallas_kernels.mla.config import MLADecodeConfig
from pallas_kernels.mla.reference import NO_KEY_LSE, merge_partials, query_positions

SHORT_KV_TOKENS = 32768
"""Decode batches with at most this many cached tokens in all (their whole latent cache, 576 x 2 B per token, in
the H200's L2) take the short-decode tiling, and never the Mosaic-GPU kernel."""


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _floor_pow2(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def choose_tiling(num_tokens: int, num_seqs: int, num_heads: int, max_context: int,
                  config: MLADecodeConfig | None = None) -> dict:
    """Static tiling heuristic -> dict(block_q, block_h, block_k, num_splits, num_warps, num_stages), from the
    constants of ``config`` (tuned; see :class:`~pallas_kernels.mla.config.MLADecodeConfig`).

    block_q follows the mean query tokens per sequence (1 for decode, up to 16 for prefill); block_h fills the
    rest of a ``target_rows`` tile (at least 16 rows: the Triton dot minimum). Small tiles stream
    ``small_block_k`` keys per step, larger ones ``large_block_k``. Splits are added until about
    ``target_programs`` programs are in flight, keeping >= 4 key blocks per split. Short decode (one query per
    sequence, at most ``SHORT_KV_TOKENS`` cached tokens in the batch): ``short_block_h`` heads per program and
    splits of at least ``short_split_keys`` keys, toward ``short_kv_programs`` programs; the keys a second head
    block reads again come from L2. Fields set in ``config`` replace the heuristic's picks."""
    cfg = tuning.resolve(MLADecodeConfig, config)
    if num_tokens == num_seqs and num_seqs * max_context <= SHORT_KV_TOKENS:
        block_h = cfg.short_block_h
        programs = num_tokens * -(-num_heads // block_h)
        max_splits = min(cfg.short_kv_max_splits, max(1, max_context // cfg.short_split_keys))
        num_splits = max(1, min(_next_pow2(-(-cfg.short_kv_programs // programs)), _floor_pow2(max_splits)))
        auto = dict(block_q=1, block_h=block_h, block_k=cfg.small_block_k, num_splits=num_splits,
                    num_warps=cfg.num_warps, num_stages=cfg.small_stages)
    else:
        block_h = min(_next_pow2(num_heads), cfg.target_rows)
        block_q = max(1, min(_next_pow2(-(-num_tokens // max(num_seqs, 1))), cfg.target_rows // block_h, 16))
        block_h = max(block_h, 16 // block_q)
        small = block_q * block_h <= cfg.small_rows
        block_k = cfg.small_block_k if small else cfg.large_block_k
        num_tiles = min(num_tokens, -(-num_tokens // block_q) + num_seqs)
        programs = num_tiles * -(-num_heads // block_h)
        max_splits = max(1, max_context // (4 * block_k))
        num_splits = max(1, min(_next_pow2(-(-cfg.target_programs // max(programs, 1))), _next_pow2(max_splits)))
        auto = dict(block_q=block_q, block_h=block_h, block_k=block_k, num_splits=num_splits,
                    num_warps=cfg.num_warps, num_stages=cfg.small_stages if small else cfg.large_stages)
    return {name: auto[name] if getattr(cfg, name) is None else getattr(cfg, name) for name in auto}


def smem_bytes(cfg: MLADecodeConfig, width: int, compute_dtype, pages_dtype, fp8_scales: bool) -> int:
    """Shared memory of the absorbed kernel (:mod:`pallas_kernels.tuning`'s estimate): per loop step it loads
    ``block_k`` cache rows ``[block_k, W]`` (and their fp8 scales), gathered through the block table, so
    ``num_stages - 1`` deep (at least 1); the scaled queries ``[rows, W]``, the probabilities ``[rows, block_k]``
    and a cache tile cast to the compute dtype (staged twice: as ``K^T`` and as ``V``) go through it into the
    dots."""
    rows = cfg.block_q * cfg.block_h
    step = tuning.nbytes(pages_dtype, cfg.block_k, width) + fp8_scales * tuning.nbytes("float32", cfg.block_k)
    staged = tuning.nbytes(compute_dtype, rows, width + cfg.block_k)
    if pages_dtype != compute_dtype:
        staged += 2 * tuning.nbytes(compute_dtype, cfg.block_k, width)
    return max(cfg.num_stages - 1, 1) * step + staged


def plan_tiles(cu_q_lens, num_tiles: int, block_q: int):
    """Per-tile sequence id and first query index within it: (tile_seq [n_tiles], tile_q0 [n_tiles]); tiles past
    the last real one get tile_q0 = block_q * 2**20 (an index no sequence reaches, so they do nothing)."""
    num_seqs = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    cu_tiles = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(pl.cdiv(q_lens, block_q))]).astype(jnp.int32)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq = jnp.searchsorted(cu_tiles, tile, side="right", method="scan_unrolled")  # no while loop: no host sync
    tile_seq = jnp.clip(tile_seq - 1, 0, num_seqs - 1).astype(jnp.int32)
    tile_q0 = (tile - cu_tiles[tile_seq]) * block_q
    tile_q0 = jnp.where(tile < cu_tiles[num_seqs], tile_q0, block_q * 2**20)
    return tile_seq, tile_q0


def _absorbed_kernel(
    tile_seq_ref, tile_q0_ref, cu_q_lens_ref, context_lens_ref, block_tables_ref, row_offset_ref,
    q_ref, pages_ref, scales_ref,
    o_ref, lse_ref,
    *, scale, num_heads, kv_lora_rank, block_q, block_h, block_k, block_size, num_splits,
):  # fmt: skip
    """One (query tile, head block, KV split) program. Refs are full arrays: q [T, H, W], pages [rows, W],
    scales [rows] or None, o [splits, T, H, R], lse [splits, T, H]."""
    head_block, split, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rank, width = kv_lora_rank, q_ref.shape[-1]
    rows = block_q * block_h
    seq = tile_seq_ref[tile]
    q0 = tile_q0_ref[tile]
    first_token = cu_q_lens_ref[seq]
    q_len = cu_q_lens_ref[seq + 1] - first_token
    context = context_lens_ref[seq]

    @pl.when(q0 < q_len)
    def _():
        r = jnp.arange(rows, dtype=jnp.int32)
        q_index = q0 + r // block_h  # query index within the sequence
        head = head_block * block_h + r % block_h
        row_real = (q_index < q_len) & (head < num_heads)
        # Padding rows point one past the last token: masked on GPU, dropped by interpret-mode scatters.
        token = jnp.where(row_real, first_token + q_index, q_ref.shape[0])[:, None]
        head = head[:, None]
        pos = context - q_len + q_index  # absolute position of each score row
        lat_cols = jnp.arange(rank, dtype=jnp.int32)[None, :]
        pe_cols = rank + jnp.arange(width - rank, dtype=jnp.int32)[None, :]
        q_lat = pltriton.load(q_ref.at[token, head, lat_cols], mask=row_real[:, None], other=0)
        q_pe = pltriton.load(q_ref.at[token, head, pe_cols], mask=row_real[:, None], other=0)
        q_lat = (q_lat.astype(jnp.float32) * scale).astype(q_ref.dtype)
        q_pe = (q_pe.astype(jnp.float32) * scale).astype(q_ref.dtype)

        kv_end = context - q_len + jnp.minimum(q0 + block_q, q_len)  # keys visible to the tile's last query
        num_key_blocks = pl.cdiv(kv_end, block_k)
        per_split = pl.cdiv(num_key_blocks, num_splits)
        start = split * per_split
        stop = jnp.minimum(start + per_split, num_key_blocks)
        compute_dtype = q_ref.dtype
        max_page = block_tables_ref.shape[1] - 1

        def body(kb, carry):
            acc, row_max, denom = carry
            key = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
            key_real = key < context
            page = jnp.minimum(key // block_size, max_page)
            cache_row = block_tables_ref[seq, page] * block_size + key % block_size + row_offset_ref[0]
            cache_row = jnp.where(key_real, cache_row, 0)[:, None]
            zero = jnp.zeros((), pages_ref.dtype)
            k_lat = pltriton.load(pages_ref.at[cache_row, lat_cols], mask=key_real[:, None], other=zero)
            k_pe = pltriton.load(pages_ref.at[cache_row, pe_cols], mask=key_real[:, None], other=zero)
            k_lat, k_pe = k_lat.astype(compute_dtype), k_pe.astype(compute_dtype)
            scores = jnp.dot(q_lat, k_lat.T, preferred_element_type=jnp.float32)
            scores += jnp.dot(q_pe, k_pe.T, preferred_element_type=jnp.float32)
            if scales_ref is not None:
                key_scale = pltriton.load(scales_ref.at[cache_row[:, 0]], mask=key_real, other=0.0)
                scores *= key_scale[None, :]
            visible = (key[None, :] <= pos[:, None]) & row_real[:, None]
            scores = jnp.where(visible, scores, NO_KEY_LSE)
            new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
            probs = jnp.where(visible, jnp.exp(scores - new_max[:, None]), 0.0)
            correction = jnp.exp(row_max - new_max)
            denom = denom * correction + jnp.sum(probs, axis=1)
            if scales_ref is not None:
                probs *= key_scale[None, :]
            acc = acc * correction[:, None] + jnp.dot(
                probs.astype(compute_dtype), k_lat, preferred_element_type=jnp.float32
            )
            return acc, new_max, denom

        init = (
            jnp.zeros((rows, rank), jnp.float32),
            jnp.full((rows,), NO_KEY_LSE, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        )
        acc, row_max, denom = lax.fori_loop(start, stop, body, init)
        seen = denom > 0
        safe_denom = jnp.where(seen, denom, 1.0)
        out = acc / safe_denom[:, None]
        lse = jnp.where(seen, row_max + jnp.log(safe_denom), NO_KEY_LSE)
        pltriton.store(o_ref.at[split, token, head, lat_cols], out.astype(o_ref.dtype), mask=row_real[:, None])
        pltriton.store(lse_ref.at[split, token[:, 0], head[:, 0]], lse, mask=row_real)


def fit_config(config: MLADecodeConfig | None, num_tokens: int, num_seqs: int, num_heads: int, max_context: int,
               width: int, compute_dtype, pages_dtype, fp8_scales: bool) -> MLADecodeConfig:
    """The tiling (``config``'s fields, the rest from :func:`choose_tiling`) shrunk to the device's shared memory:
    fewer stages, then fewer keys per step (down to 16)."""
    cfg = tuning.resolve(MLADecodeConfig, config)
    cfg = dataclasses.replace(cfg, **choose_tiling(num_tokens, num_seqs, num_heads, max_context, cfg))
    return tuning.fit("mla_absorbed_paged_attention", cfg,
                      lambda c: smem_bytes(c, width, compute_dtype, pages_dtype, fp8_scales),
                      tuning.smaller(cfg, "num_stages", [("block_k", 16)]),
                      what=f"{cfg.block_q * cfg.block_h} query rows of {width} in {jnp.dtype(compute_dtype).name}")


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank", "config", "interpret"))
def mla_paged_attention_pallas(
    q: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    scale: float,
    kv_lora_rank: int,
    page_scales: jax.Array | None = None,
    layer=None,
    config: MLADecodeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas version of :func:`~pallas_kernels.mla.reference.mla_paged_attention_reference` (same contract).

    ``config``: the tiling (static; fields left None: :func:`choose_tiling`'s picks), shrunk by :func:`fit_config`
    to the device's shared memory. ``R`` and ``K_rope`` must be powers of 2 >= 16 (Triton)."""
    num_tokens, num_heads, width = q.shape
    num_seqs, max_pages = block_tables.shape
    block_size = pages.shape[-2]
    cfg = fit_config(config, num_tokens, num_seqs, num_heads, max_pages * block_size, width, q.dtype, pages.dtype,
                     page_scales is not None)
    block_q, block_h, block_k, num_splits = cfg.block_q, cfg.block_h, cfg.block_k, cfg.num_splits
    num_tiles = min(num_tokens, -(-num_tokens // block_q) + num_seqs)
    num_head_blocks = -(-num_heads // block_h)
    rows_per_layer = pages.shape[-3] * block_size
    row_offset = jnp.zeros((1,), jnp.int32) if layer is None else jnp.full((1,), layer * rows_per_layer, jnp.int32)
    flat_pages = pages.reshape(-1, width)
    flat_scales = None if page_scales is None else page_scales.reshape(-1).astype(jnp.float32)
    tile_seq, tile_q0 = plan_tiles(cu_q_lens.astype(jnp.int32), num_tiles, block_q)
    out_dtype = q.dtype if num_splits == 1 else jnp.float32
    kernel = functools.partial(
        _absorbed_kernel, scale=scale, num_heads=num_heads, kv_lora_rank=kv_lora_rank, block_q=block_q,
        block_h=block_h, block_k=block_k, block_size=block_size, num_splits=num_splits,
    )  # fmt: skip
    operands = (
        tile_seq, tile_q0, cu_q_lens.astype(jnp.int32), context_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32), row_offset, q, flat_pages, flat_scales,
    )  # fmt: skip
    whole = lambda x: None if x is None else pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    o_parts, lse_parts = pl.pallas_call(
        kernel,
        # Head blocks vary fastest: programs launched together read the same keys (L2 reuse).
        grid=(num_head_blocks, num_splits, num_tiles),
        in_specs=[whole(x) for x in operands],
        out_specs=[
            pl.BlockSpec((num_splits, num_tokens, num_heads, kv_lora_rank), lambda *_: (0, 0, 0, 0)),
            pl.BlockSpec((num_splits, num_tokens, num_heads), lambda *_: (0, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, num_tokens, num_heads, kv_lora_rank), out_dtype),
            jax.ShapeDtypeStruct((num_splits, num_tokens, num_heads), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret_mode() if interpret is None else interpret,
        name="mla_absorbed_paged_attention",
    )(*operands)
    if num_splits == 1:
        o, lse = o_parts[0], lse_parts[0]
    else:
        o, lse = merge_partials(o_parts, lse_parts)
    _, _, is_real = query_positions(cu_q_lens, context_lens, num_tokens)
    o = jnp.where(is_real[:, None, None], o, 0).astype(q.dtype)
    lse = jnp.where(is_real[:, None], lse, NO_KEY_LSE)
    return o, lse
