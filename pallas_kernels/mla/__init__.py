"""Gated MLA over a paged latent cache: cache writes, absorbed paged attention and un-absorbed prefill.

* :func:`mla_paged_attention` (absorbed / MQA form): decode, speculative verification, chunked prefill and mixes
  in one call, straight from the paged cache; returns ``(o_lat, lse)`` so partials can be LSE-merged
  (:func:`merge_partials`). Long-context decode over 64-token bf16 pages takes the Mosaic-GPU kernel
  (:mod:`pallas_kernels.mla.decode_mgpu`) when the caller says every sequence has the same query tokens.
* :func:`mla_prefill_attention` (un-absorbed / MHA form): the caller gathers the context latent
  (:func:`gather_latent`), up-projects it with ``kv_b_proj`` and passes per-head ``k_nope``/``v``; 3.4x fewer
  attention FLOPs per (query, key, head) than the absorbed form (320 vs 1088), for long prefill chunks.

Layout and semantics: see :mod:`pallas_kernels.mla.reference`.
"""

from __future__ import annotations

import jax

from pallas_kernels import tuning
from pallas_kernels.impl import on_hopper, resolve_impl
from pallas_kernels.mla.config import (AbsorbOutputsConfig, AbsorbQueriesConfig, MLADecodeConfig, MLADecodeMGPUConfig,
                                       MLAPrefillConfig)
from pallas_kernels.mla.reference import (
    NO_KEY_LSE,
    absorb_outputs_reference,
    absorb_queries_reference,
    gather_latent,
    merge_partials,
    mla_paged_attention_reference,
    mla_prefill_attention_reference,
    quantize_latent_fp8,
    write_latent_cache as _write_latent_cache_reference,
    write_latent_cache_fp8 as _write_latent_cache_fp8_reference,
)

__all__ = [
    "AbsorbOutputsConfig",
    "AbsorbQueriesConfig",
    "MLADecodeConfig",
    "MLADecodeMGPUConfig",
    "MLAPrefillConfig",
    "NO_KEY_LSE",
    "absorb_outputs",
    "absorb_outputs_reference",
    "absorb_queries",
    "absorb_queries_reference",
    "gather_latent",
    "merge_partials",
    "mla_paged_attention",
    "mla_paged_attention_reference",
    "mla_prefill_attention",
    "mla_prefill_attention_reference",
    "quantize_latent_fp8",
    "write_latent_cache",
    "write_latent_cache_fp8",
]


ABSORB_KERNEL_MAX_ROWS = 16
"""Query rows up to which ``impl="pallas"`` runs the absorption kernels (decode); XLA's batched GEMMs above."""


def _absorb_kernel_fits(rows: int, *widths: int) -> bool:
    """The absorption kernels take up to ABSORB_KERNEL_MAX_ROWS rows and head widths that are powers of two
    >= 16 (Triton block shapes and the MMA's minimum); other shapes take the XLA path."""
    return rows <= ABSORB_KERNEL_MAX_ROWS and all(w >= 16 and w & (w - 1) == 0 for w in widths)


def absorb_queries(q, kv_b, *, layer: int, k_nope: int, impl: str | None = None,
                   config: AbsorbQueriesConfig | None = None) -> jax.Array:
    """The absorbed query: q [T, H, Kn+Kr] -> [T, H, R+Kr] in q's dtype (``q[..., :Kn]`` through W_UK of the
    stacked ``kv_b [L, R, H*(Kn+V)]`` at ``layer``, fp32 accumulation; the rotary part after it). ``config``: the
    Pallas kernel's tiles (None: tuned)."""
    if resolve_impl(impl) == "pallas" and _absorb_kernel_fits(q.shape[0], k_nope, q.shape[2] - k_nope,
                                                              kv_b.shape[1]):
        from pallas_kernels.mla.absorb import absorb_queries_pallas

        return absorb_queries_pallas(q, kv_b, layer=layer, k_nope=k_nope, config=config)
    return absorb_queries_reference(q, kv_b, layer=layer, k_nope=k_nope)


def absorb_outputs(o_lat, kv_b, *, layer: int, v_dim: int, impl: str | None = None,
                   config: AbsorbOutputsConfig | None = None) -> jax.Array:
    """Latent attention outputs o_lat [T, H, R] through W_UV of ``kv_b [L, R, H*(Kn+V)]`` at ``layer`` ->
    [T, H, V] f32. ``config``: the Pallas kernel's tiles (None: tuned)."""
    if resolve_impl(impl) == "pallas" and _absorb_kernel_fits(o_lat.shape[0], v_dim, kv_b.shape[1]):
        from pallas_kernels.mla.absorb import absorb_outputs_pallas

        return absorb_outputs_pallas(o_lat, kv_b, layer=layer, v_dim=v_dim, config=config)
    return absorb_outputs_reference(o_lat, kv_b, layer=layer, v_dim=v_dim)


def write_latent_cache(pages, latent, slot_mapping, *, layer=None, impl: str | None = None) -> jax.Array:
    """Scatter latent [T, R+K_rope] into pages [(L,) num_blocks, block_size, R+K_rope] at slot_mapping [T].

    Every impl is the XLA scatter (in place under jit donation, T x (R+K_rope) elements moved): a Pallas
    write kernel would move the same bytes, so none exists; ``impl`` is only validated."""
    resolve_impl(impl)
    return _write_latent_cache_reference(pages, latent, slot_mapping, layer=layer)


def write_latent_cache_fp8(pages, page_scales, latent, slot_mapping, *, layer=None, impl: str | None = None):
    """Quantise latent [T, R+K_rope] per token to e4m3 and scatter rows and scales; returns (pages, page_scales)."""
    resolve_impl(impl)
    return _write_latent_cache_fp8_reference(pages, page_scales, latent, slot_mapping, layer=layer)


MGPU_DECODE: bool | None = None
"""Whether ``impl="pallas"`` decode calls that qualify (:func:`mgpu_decode_fits`) take the Mosaic-GPU kernel: None =
on a Hopper GPU only (its ``wgmma`` and TMA; elsewhere it would run in Mosaic-GPU's slow interpreter; tests set
True). H200, batch 16-64, 32K-128K context, chunk 128 (BENCHMARKS.md, MLA decode): H=32 186-690 us = 76-82% of
the 4.27 TB/s copy rate, 1.5-1.6x the Triton kernel; H=96 42-44%, 2.9-3.0x Triton; batch 1 at 128K: 1.5x (H=32)
and 2.6x (H=96)."""


def mgpu_decode_fits(q, pages, block_tables, *, kv_lora_rank: int, page_scales, q_len: int) -> bool:
    """The Mosaic-GPU decode kernel applies: bf16 queries (it computes in bf16) and bf16 pages of a multiple of 64
    tokens (no fp8 scales), the 512 + 64 latent width, ``T == N * q_len`` with at most 8 query tokens per sequence,
    at least ``MLADecodeMGPUConfig.min_rows`` (token, head) rows per sequence (at H=12 the Triton kernel was 3-11%
    faster, at H=32 the Mosaic-GPU kernel 1.5-1.6x: BENCHMARKS.md, MLA decode), stages that fit the device's shared
    memory, and a batch whose cache capacity (sequences x table width x page size) is past the Triton kernel's
    short-context tiling, which the Mosaic-GPU kernel has not been measured against."""
    from pallas_kernels.mla import attention, decode_mgpu

    num_seqs, table_pages = block_tables.shape
    block_size = pages.shape[-2]
    bf16 = jax.numpy.bfloat16
    cfg = tuning.tuned(MLADecodeMGPUConfig)
    return (page_scales is None and q.dtype == bf16 and pages.dtype == bf16
            and block_size % decode_mgpu.BLOCK_KV == 0 and q.shape[-1] == decode_mgpu.WIDTH
            and kv_lora_rank == decode_mgpu.RANK and 1 <= q_len <= 8 and q.shape[0] == num_seqs * q_len
            and q_len * q.shape[1] >= cfg.min_rows and decode_mgpu.smem_bytes(cfg.stages) <= tuning.smem_limit()
            and num_seqs * table_pages * block_size > attention.SHORT_KV_TOKENS)


def mla_paged_attention(
    q,
    pages,
    block_tables,
    context_lens,
    cu_q_lens,
    *,
    scale: float,
    kv_lora_rank: int,
    page_scales=None,
    layer=None,
    decode_q_len: int | None = None,
    impl: str | None = None,
    config: MLADecodeConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA attention: q [T, H, R+K_rope] -> (o_lat [T, H, R] q.dtype, lse [T, H] f32).

    See :func:`pallas_kernels.mla.reference.mla_paged_attention_reference` for the exact contract.
    ``decode_q_len`` (static): row block ``n`` of ``decode_q_len`` rows belongs to sequence ``n`` (``T == N *
    decode_q_len``; a sequence of the batch's padding has an empty context, and its rows come back as padding
    rows do), and every page row that a sequence's last page holds past its context is finite: then the Pallas
    path may take the Mosaic-GPU kernel (see ``MGPU_DECODE``), which gives such rows zero probability instead of
    not loading them. ``config``: the Triton kernel's tiling (None fields: tuned / picked per shape).
    """
    if resolve_impl(impl) == "pallas":
        use_mgpu = on_hopper() if MGPU_DECODE is None else MGPU_DECODE
        if use_mgpu and decode_q_len and mgpu_decode_fits(q, pages, block_tables, kv_lora_rank=kv_lora_rank,
                                                          page_scales=page_scales, q_len=decode_q_len):
            from pallas_kernels.mla.decode_mgpu import mla_decode_mgpu

            return mla_decode_mgpu(q, pages, block_tables, context_lens, scale=scale, q_len=decode_q_len,
                                   layer=layer)
        from pallas_kernels.mla.attention import mla_paged_attention_pallas

        return mla_paged_attention_pallas(
            q, pages, block_tables, context_lens, cu_q_lens,
            scale=scale, kv_lora_rank=kv_lora_rank, page_scales=page_scales, layer=layer, config=config,
        )
    return mla_paged_attention_reference(
        q, pages, block_tables, context_lens, cu_q_lens,
        scale=scale, kv_lora_rank=kv_lora_rank, page_scales=page_scales, layer=layer,
    )


def mla_prefill_attention(
    q, k_nope, k_pe, v, cu_q_lens, cu_kv_lens, *, scale: float, impl: str | None = None,
    config: MLAPrefillConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Un-absorbed MLA attention: q [T, H, K_nope+K_rope], k_nope [S, H, K_nope], k_pe [S, K_rope],
    v [S, H, V] -> (o [T, H, V] q.dtype, lse [T, H] f32).

    See :func:`pallas_kernels.mla.reference.mla_prefill_attention_reference` for the exact contract. ``config``: the
    Pallas kernel's tiling (None: tuned)."""
    if resolve_impl(impl) == "pallas":
        from pallas_kernels.mla.prefill import mla_prefill_attention_pallas

        return mla_prefill_attention_pallas(q, k_nope, k_pe, v, cu_q_lens, cu_kv_lens, scale=scale, config=config)
    return mla_prefill_attention_reference(q, k_nope, k_pe, v, cu_q_lens, cu_kv_lens, scale=scale)
