"""Gated MLA layers (spec section 2): NoPE multi-head latent attention over a paged latent cache.

The cache holds, per token, the normalised latent ``c_kv [R]`` and the shared, never-rotated ``k_pe [K_rope]``.
Attention runs in the absorbed form: ``q_lat = W_UK^T q_nope`` so every head attends against the single latent
"KV head", then ``W_UV`` maps the latent output back to ``V`` per head (the un-absorbed MHA form is the same
function; kernels pick by measurement). An optional sigmoid output gate multiplies the heads before o_proj.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.config import ModelConfig
from kimi_jax.layers.common import (F32, constant, fan_in_normal, rms_norm, stacked_linear, stacked_linear_unsummed,
                                    stacked_linears)
from kimi_jax.step import StepInputs, TokenLayout, slot_mapping
from pallas_kernels import mla as mla_ops
from pallas_kernels.rmsnorm import PartialSum


class MLAStack(nnx.Module):
    """Parameters of all MLA layers, leading axis = MLA layer index ``j`` (``config.mla_layers[j]``).

    q_a [L, D, Rq] + q_a_norm [L, Rq] + q_b [L, Rq, H*(Kn+Kr)]   (q-LoRA)   or   q_proj [L, D, H*(Kn+Kr)];
    kv_a [L, D, R+Kr]; kv_a_norm [L, R]; kv_b [L, R, H*(Kn+V)] (per head: Kn rows of k_nope then V of v);
    g_proj [L, D, H*V] (output gate, optional); o_proj [L, H*V, D].
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        n, d, h = len(cfg.mla_layers), cfg.hidden_size, cfg.mla_num_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a = fan_in_normal(rngs, (n, d, cfg.q_lora_rank), dtype)
            self.q_a_norm = constant((n, cfg.q_lora_rank), 1.0)
            self.q_b = fan_in_normal(rngs, (n, cfg.q_lora_rank, h * qk), dtype)
        else:
            self.q_proj = fan_in_normal(rngs, (n, d, h * qk), dtype)
        self.kv_a = fan_in_normal(rngs, (n, d, cfg.mla_cache_width), dtype)
        self.kv_a_norm = constant((n, cfg.kv_lora_rank), 1.0)
        self.kv_b = fan_in_normal(rngs, (n, cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)), dtype)
        if cfg.mla_output_gate:
            self.g_proj = fan_in_normal(rngs, (n, d, h * cfg.v_head_dim), dtype)
        self.o_proj = fan_in_normal(rngs, (n, h * cfg.v_head_dim, d), dtype)


UNABSORBED_MIN_ROWS_PER_SEQ = 16
"""``form="auto"`` takes the un-absorbed form for steps with at least this many rows per sequence of the bucket.
Measured on the H200 (BENCHMARKS.md, MLA section, H=96, 8K new tokens): the absorbed kernel reaches 60 TFLOP/s of
its 2176 FLOPs per (row, key, head) and the un-absorbed kernel 337 TFLOP/s of its 640, while the up-projection of
the gathered keys costs 2 x 512 x 256 FLOPs per (key, head) at the GEMM rate (~600 TFLOP/s). The un-absorbed form
then wins once rows exceed ~13 per gathered key span: more than 13 rows per sequence when each sequence's keys
are its table's."""
UNABSORBED_MAX_KEYS_PER_ROW = 4
"""... and whose gathered keys (sequences x table pages x page size, static) are at most this many per row: the
gather and the up-projection materialise ``[keys, 576]`` and ``[keys, H, 256]`` (a 4096-token step: 16K keys,
0.5 GB at H=32 in fp32, 1.6 GB at H=96), so they stay a few times the step's own activations; an 8K prompt in
4096-token chunks fits. Longer tables keep the absorbed kernel, which reads the pages in place."""


def choose_form(step: StepInputs, num_keys: int) -> str:
    """``form="auto"``'s static choice for a step's shapes (``num_keys``: the un-absorbed form's gathered keys,
    sequences x table pages x page size): "unabsorbed" for prefill-sized steps whose gather stays bounded (see the
    two constants above), else "absorbed" (every decode-only step)."""
    rows, num_seqs = step.token_ids.shape[0], step.block_tables.shape[0]
    if (not step.decode_only and rows >= UNABSORBED_MIN_ROWS_PER_SEQ * num_seqs
            and num_keys <= UNABSORBED_MAX_KEYS_PER_ROW * rows):
        return "unabsorbed"
    return "absorbed"


def mla_layer(p: MLAStack, j: int, x: jax.Array, pages: jax.Array, scales: jax.Array | None, step: StepInputs,
              layout: TokenLayout, cfg: ModelConfig, *, impl: str | None = None, form: str = "absorbed",
              finite_pages: bool = True, page_layer: int | None = None
              ) -> tuple[jax.Array | PartialSum, jax.Array, jax.Array | None]:
    """MLA layer ``j`` on a packed step.

    x [T, D]; pages [L_mla, num_blocks, block_size, R+Kr] (all MLA layers; layer ``j`` is read and written);
    scales [L_mla, num_blocks, block_size] f32 for an e4m3 ``pages`` (per-token quantisation), else None
    -> (out [T, D] or a :class:`PartialSum` of o_proj's split-K parts, pages, scales). ``form``: "absorbed"
    (queries move to the latent space; decode), "unabsorbed" (the cached latents of each sequence are gathered
    and up-projected to per-head keys/values; prefill) or "auto" (:func:`choose_form` from the step's shapes).
    ``finite_pages``: every page row holds a finite value (False under the engine's NaN test mode); with it,
    decode-only steps may take the Mosaic-GPU attention kernel (``mla_paged_attention``'s ``decode_q_len``).

    ``page_layer``: the layer of ``pages`` this layer reads and writes (default ``j``; a drafter's layers sit
    after the model's own).

    The three stages (:func:`mla_project`, the cache write + :func:`mla_attend`, :func:`mla_output`) are public
    so that a decode-context-parallel layer (``sharding.dcp``) can replace the middle one."""
    pj = j if page_layer is None else page_layer
    q, latent, gate = mla_project(p, j, x, cfg, impl=impl)
    slots = slot_mapping(step, layout, pages.shape[2])
    pages, scales = write_latent(pages, scales, latent, slots, pj)
    total = step.context_lens + layout.q_lens
    attn = mla_attend(p, j, q, pages, scales, step.block_tables, total, step, cfg, impl=impl, form=form,
                      finite_pages=finite_pages, layer=pj)
    return mla_output(p, j, attn, gate, x, cfg, impl=impl), pages, scales


def mla_project(p: MLAStack, j: int, x: jax.Array, cfg: ModelConfig, *, impl: str | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """x [T, D] -> (queries [T, H, Kn+Kr], the latent row to cache [T, R+Kr], output-gate logits [T, H*V] or
    None). ``H`` is read from ``cfg`` (a tensor-parallel shard passes its local head count)."""
    t_rows = x.shape[0]
    h, kn, kr, r = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    from_x = (p.q_a if cfg.q_lora_rank else p.q_proj, p.kv_a) + ((p.g_proj,) if cfg.mla_output_gate else ())
    q, kv, *gate = stacked_linears(x, from_x, j, impl=impl)
    if cfg.q_lora_rank:
        q = stacked_linear(rms_norm(q, p.q_a_norm[j], cfg.rms_norm_eps), p.q_b, j, impl=impl)
    q = q.reshape(t_rows, h, kn + kr)
    latent = jnp.concatenate([rms_norm(kv[:, :r], p.kv_a_norm[j], cfg.rms_norm_eps), kv[:, r:]], axis=-1)
    return q, latent, gate[0] if gate else None


def context_latent(p: MLAStack, j: int, x: jax.Array, cfg: ModelConfig, *, impl: str | None = None) -> jax.Array:
    """Only the row layer ``j`` caches for x [T, D]: normalised ``c_kv`` ++ ``k_pe`` [T, R+Kr] (a drafter's
    context entries, which no query reads in the same step)."""
    kv = stacked_linear(x, p.kv_a, j, impl=impl)
    r = cfg.kv_lora_rank
    return jnp.concatenate([rms_norm(kv[:, :r], p.kv_a_norm[j], cfg.rms_norm_eps), kv[:, r:]], axis=-1)


def write_latent(pages: jax.Array, scales: jax.Array | None, latent: jax.Array, slots: jax.Array, j: int
                 ) -> tuple[jax.Array, jax.Array | None]:
    """Scatter the step's latent rows into layer ``j``'s pages at flat rows ``slots [T]`` (-1: skipped)."""
    if scales is None:
        return mla_ops.write_latent_cache(pages, latent.astype(pages.dtype), slots, layer=j), None
    return mla_ops.write_latent_cache_fp8(pages, scales, latent, slots, layer=j)


def mla_attend(p: MLAStack, j: int, q: jax.Array, pages: jax.Array, scales: jax.Array | None,
               block_tables: jax.Array, total: jax.Array, step: StepInputs, cfg: ModelConfig, *,
               impl: str | None = None, form: str = "absorbed", finite_pages: bool = True,
               layer: int | None = None) -> jax.Array:
    """Attention of queries ``q [T, H, Kn+Kr]`` over the pages of ``block_tables [N, P]`` holding ``total [N]``
    tokens per sequence (this step's included) -> f32 ``[T, H*V]`` before the gate. ``layer``: the pool's layer
    (pages ``[L, blocks, block_size, W]``), or None for a single-layer pool ``[blocks, block_size, W]`` (the
    gathered pages of a decode-context-parallel prefill). The weights are layer ``j`` of ``p``."""
    t_rows, h = q.shape[:2]
    kn, kr, vd, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    scale = (kn + kr) ** -0.5
    block_size = pages.shape[-2]
    num_keys = block_tables.shape[0] * block_tables.shape[1] * block_size  # the gather's, static
    if form == "auto":
        form = choose_form(step, num_keys)
    if form == "unabsorbed":
        cu_kv = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(total).astype(jnp.int32)])
        keys = mla_ops.gather_latent(pages, block_tables, cu_kv, num_keys, page_scales=scales,
                                     layer=layer)  # [S, R+Kr]
        w_kv = p.kv_b[j].reshape(r, h, kn + vd)  # per head: Kn columns of W_UK, then V of W_UV
        kv = jnp.einsum("sr,rhc->shc", keys[:, :r].astype(q.dtype), w_kv, preferred_element_type=F32)
        o, _ = mla_ops.mla_prefill_attention(q, kv[..., :kn].astype(q.dtype), keys[:, r:].astype(q.dtype),
                                             kv[..., kn:].astype(q.dtype), step.cu_seqlens, cu_kv,
                                             scale=scale, impl=impl)
        return o.astype(F32).reshape(t_rows, h * vd)
    if form == "absorbed":
        q_abs = mla_ops.absorb_queries(q, p.kv_b[...], layer=j, k_nope=kn, impl=impl)
        o_lat, _ = mla_ops.mla_paged_attention(q_abs, pages, block_tables, total, step.cu_seqlens,
                                               scale=scale, kv_lora_rank=r, page_scales=scales, layer=layer,
                                               decode_q_len=1 if step.decode_only and finite_pages else None,
                                               impl=impl)
        return mla_ops.absorb_outputs(o_lat, p.kv_b[...], layer=j, v_dim=vd, impl=impl).reshape(t_rows, h * vd)
    raise ValueError(f"MLA form must be 'absorbed' or 'unabsorbed', got {form!r}")


def mla_output(p: MLAStack, j: int, attn: jax.Array, gate: jax.Array | None, x: jax.Array, cfg: ModelConfig, *,
               impl: str | None = None) -> jax.Array | PartialSum:
    """Gate (sigmoid of ``gate``) and o_proj: attn f32 [T, H*V] -> [T, D] in x's dtype (or a PartialSum)."""
    if gate is not None:
        attn = attn * jax.nn.sigmoid(gate.astype(F32))
    return stacked_linear_unsummed(attn.astype(x.dtype), p.o_proj, j, impl=impl)
