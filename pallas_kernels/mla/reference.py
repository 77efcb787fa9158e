"""Pure-jnp reference for Gated MLA over a paged latent cache (absorbed form, fp32 softmax).

Cache layout for one layer: ``pages [num_blocks, block_size, R + K_rope]``; row ``r`` of block ``b`` holds one
token's normalised ``c_kv`` (first ``R`` values) followed by its un-rotated ``k_pe`` (last ``K_rope``). Token
slots are ``block_id * block_size + offset``. An fp8 cache stores ``pages`` in ``float8_e4m3fn`` plus
``page_scales [num_blocks, block_size]`` float32 (one scale per token: ``row ~= fp8_row * scale``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# LSE of a query row that sees no key (padding rows): finite, so LSE merges of partial results never NaN.
NO_KEY_LSE = -1e30
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_REFERENCE_CHUNK_BYTES = 1 << 29  # bound on the per-token gathered cache of one query chunk


def _layer_slots(pages: jax.Array, slot_mapping: jax.Array, layer) -> jax.Array:
    """Row indices into ``pages`` flattened to 2-D, for one layer's slots; padding (-1) maps out of range."""
    num_blocks, block_size = pages.shape[-3:-1]
    layer_rows = num_blocks * block_size
    num_rows = layer_rows * (pages.shape[0] if pages.ndim == 4 else 1)
    offset = 0 if layer is None else layer * layer_rows
    return jnp.where(slot_mapping < 0, num_rows, slot_mapping + offset)


def write_latent_cache(pages: jax.Array, latent: jax.Array, slot_mapping: jax.Array, *, layer=None) -> jax.Array:
    """Scatter new tokens into their cache rows.

    pages [num_blocks, block_size, R+K_rope], or [L, num_blocks, block_size, R+K_rope] with ``layer`` (int or
    int32 scalar) choosing the layer; latent [T, R+K_rope]; slot_mapping [T] int32 (-1 = skip).
    Returns the updated pages (in place under jit donation).
    """
    flat = pages.reshape(-1, pages.shape[-1])
    return _scatter_rows(flat, _layer_slots(pages, slot_mapping, layer), latent.astype(pages.dtype)).reshape(
        pages.shape)


def _scatter_rows(flat: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """``flat.at[slots].set(rows)``, out-of-range slots dropped. A single row gets a second, dropped one: XLA
    rewrites a one-row scatter as a dynamic-update-slice, which the CPU backend applied to a copy of the whole
    donated pool (~600 ms per decode step of the tiny preset)."""
    if slots.shape[0] == 1:
        slots = jnp.concatenate([slots, jnp.full((1,), flat.shape[0], slots.dtype)])
        rows = jnp.concatenate([rows, rows])
    return flat.at[slots].set(rows, mode="drop")


def quantize_latent_fp8(latent: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token e4m3 quantisation: latent [T, R+K_rope] -> (fp8 rows [T, R+K_rope], scales [T] f32)."""
    latent = latent.astype(jnp.float32)
    amax = jnp.max(jnp.abs(latent), axis=-1)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    rows = jnp.clip(latent / scales[:, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return rows, scales


def write_latent_cache_fp8(
    pages: jax.Array, page_scales: jax.Array, latent: jax.Array, slot_mapping: jax.Array, *, layer=None
) -> tuple[jax.Array, jax.Array]:
    """fp8 variant of :func:`write_latent_cache`: quantise per token, scatter rows and scales.

    pages [(L,) num_blocks, block_size, R+K_rope] e4m3; page_scales [(L,) num_blocks, block_size] f32;
    latent [T, R+K_rope]. Returns (pages, page_scales).
    """
    rows, scales = quantize_latent_fp8(latent)
    pages = write_latent_cache(pages, rows, slot_mapping, layer=layer)
    flat_scales = _scatter_rows(page_scales.reshape(-1), _layer_slots(pages, slot_mapping, layer), scales)
    return pages, flat_scales.reshape(page_scales.shape)


def gather_latent(
    pages: jax.Array,
    block_tables: jax.Array,
    cu_kv_lens: jax.Array,
    num_keys: int,
    *,
    page_scales: jax.Array | None = None,
    layer=None,
) -> jax.Array:
    """Packed cached rows of each sequence's context, for the un-absorbed prefill path.

    pages [(L,) num_blocks, block_size, R+K_rope]; block_tables [N, P]; cu_kv_lens [N+1] (context lengths
    prefix-summed). Returns [num_keys, R+K_rope]: row ``cu_kv_lens[n] + j`` is token ``j`` of sequence ``n``, in
    pages.dtype (float32 when page_scales dequantises an fp8 cache); rows past ``cu_kv_lens[N]`` are 0."""
    if layer is not None:
        pages = pages[layer]
        page_scales = None if page_scales is None else page_scales[layer]
    num_blocks, block_size, width = pages.shape
    num_seqs = block_tables.shape[0]
    key = jnp.arange(num_keys, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_kv_lens, key, side="right").astype(jnp.int32) - 1, 0, num_seqs - 1)
    offset = key - cu_kv_lens[seq]
    page = jnp.clip(offset // block_size, 0, block_tables.shape[1] - 1)
    block = jnp.clip(block_tables[seq, page], 0, num_blocks - 1)
    rows = pages[block, offset % block_size]
    if page_scales is not None:
        rows = rows.astype(jnp.float32) * page_scales[block, offset % block_size][:, None]
    return jnp.where((key < cu_kv_lens[num_seqs])[:, None], rows, 0).astype(rows.dtype)


def query_positions(cu_q_lens: jax.Array, context_lens: jax.Array, num_tokens: int):
    """Sequence id and absolute position of every packed query token.

    Returns (seq [T] int32 clipped to 0..N-1, pos [T] int32, is_real [T] bool). Query ``i`` of sequence ``n``
    is at ``context_lens[n] - q_len_n + i``; rows past ``cu_q_lens[N]`` are padding (``is_real`` False).
    """
    num_seqs = context_lens.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens, token, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, num_seqs - 1)
    pos = context_lens[seq] - cu_q_lens[seq + 1] + token
    is_real = token < cu_q_lens[num_seqs]
    return seq, pos, is_real


def _softmax_with_lse(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax over the last axis of f32 scores (-inf = masked) -> (weights, lse). Rows with no visible key
    give weights 0 and lse NO_KEY_LSE."""
    row_max = jnp.max(scores, axis=-1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max[..., None])  # masked -> exp(-inf) = 0
    denom = jnp.sum(probs, axis=-1)
    safe_denom = jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom > 0, row_max + jnp.log(safe_denom), NO_KEY_LSE)
    return probs / safe_denom[..., None], lse


def _map_query_chunks(attend, per_token, per_token_bytes: int):
    """Run ``attend(per_token) -> (o [Tc, H, V], lse [Tc, H])`` over query chunks sized so that one chunk's
    intermediates stay under _REFERENCE_CHUNK_BYTES (long prefills); arrays in ``per_token`` lead with T."""
    num_tokens = per_token[0].shape[0]
    chunk = max(1, min(num_tokens, _REFERENCE_CHUNK_BYTES // per_token_bytes))
    if chunk >= num_tokens:
        return attend(per_token)
    num_chunks = -(-num_tokens // chunk)
    pad = num_chunks * chunk - num_tokens
    padded = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in per_token]
    o, lse = lax.map(attend, tuple(x.reshape(num_chunks, chunk, *x.shape[1:]) for x in padded))
    return o.reshape(-1, *o.shape[2:])[:num_tokens], lse.reshape(-1, *lse.shape[2:])[:num_tokens]


def merge_partials(o_parts: jax.Array, lse_parts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp merge of attention partials over disjoint key sets.

    o_parts [S, T, H, R], lse_parts [S, T, H] -> (o [T, H, R] f32, lse [T, H] f32). Parts with no key carry
    lse NO_KEY_LSE and contribute nothing; rows with no key at all give o 0 and lse NO_KEY_LSE."""
    lse_max = jnp.max(lse_parts, axis=0)
    weights = jnp.exp(lse_parts - lse_max[None])
    total = jnp.sum(weights, axis=0)
    o = jnp.einsum("sth,sthr->thr", weights / total[None], o_parts.astype(jnp.float32))
    lse = jnp.where(lse_max > NO_KEY_LSE / 2, lse_max + jnp.log(total), NO_KEY_LSE)
    return o, lse


def mla_paged_attention_reference(
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
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA attention of packed queries over their requests' paged latent cache.

    q [T, H, R+K_rope]; pages [num_blocks, block_size, R+K_rope] (bf16/f32, or e4m3 with page_scales
    [num_blocks, block_size]); block_tables [N, P] int32; context_lens [N] int32 (cached tokens including this
    step's, already written); cu_q_lens [N+1] int32. Query ``i`` of sequence ``n`` attends causally to positions
    ``<= context_lens[n] - q_len_n + i``. Scores are ``scale * q . k`` over all R+K_rope dims; values are the first
    ``kv_lora_rank`` dims. Returns (o_lat [T, H, R] in q.dtype, lse [T, H] f32, natural log of the scaled score
    sum). Padding rows and rows with no visible key give o_lat 0 and lse ``NO_KEY_LSE``. With ``layer`` given,
    pages (and page_scales) carry a leading layer axis [L, ...] and ``layer`` selects one.
    """
    if layer is not None:
        pages = pages[layer]
        page_scales = None if page_scales is None else page_scales[layer]
    num_tokens, num_heads, width = q.shape
    num_blocks, block_size, _ = pages.shape
    seq, pos, is_real = query_positions(cu_q_lens, context_lens, num_tokens)

    def attend(chunk):
        q_c, seq_c, pos_c, is_real_c = chunk
        tables = jnp.clip(block_tables[seq_c], 0, num_blocks - 1)  # [Tc, P]
        kv = pages[tables].astype(jnp.float32)  # [Tc, P, bs, W]
        if page_scales is not None:
            kv = kv * page_scales[tables][..., None]
        kv = kv.reshape(q_c.shape[0], -1, width)  # [Tc, S, W]
        key_pos = jnp.arange(kv.shape[1], dtype=jnp.int32)
        visible = (key_pos[None, :] <= pos_c[:, None]) & is_real_c[:, None]  # [Tc, S]
        kv = jnp.where(visible[..., None], kv, 0.0)  # no NaN from unread pages may leak in
        scores = jnp.einsum("thw,tsw->ths", q_c.astype(jnp.float32), kv, precision=lax.Precision.HIGHEST)
        weights, lse = _softmax_with_lse(jnp.where(visible[:, None, :], scores * scale, -jnp.inf))
        o = jnp.einsum("ths,tsr->thr", weights, kv[..., :kv_lora_rank], precision=lax.Precision.HIGHEST)
        return o, lse

    per_token_bytes = block_tables.shape[1] * block_size * (width + num_heads) * 4
    o, lse = _map_query_chunks(attend, (q, seq, pos, is_real), per_token_bytes)
    return o.astype(q.dtype), lse


def mla_prefill_attention_reference(
    q: jax.Array,
    k_nope: jax.Array,
    k_pe: jax.Array,
    v: jax.Array,
    cu_q_lens: jax.Array,
    cu_kv_lens: jax.Array,
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """Un-absorbed ("MHA mode") MLA attention over packed, already up-projected keys and values.

    q [T, H, K_nope+K_rope]; k_nope [S, H, K_nope]; k_pe [S, K_rope] (shared by all heads); v [S, H, V];
    cu_q_lens, cu_kv_lens [N+1] int32. Sequence ``n`` owns keys ``cu_kv_lens[n]:cu_kv_lens[n+1]`` (its whole
    context, new tokens last) and queries ``cu_q_lens[n]:cu_q_lens[n+1]``, the last q_len_n of its context;
    query ``i`` sees keys ``<= kv_len_n - q_len_n + i``. Returns (o [T, H, V] in q.dtype, lse [T, H] f32);
    padding rows give 0 / NO_KEY_LSE.
    """
    num_tokens, num_heads, _ = q.shape
    num_keys, _, k_nope_dim = k_nope.shape
    num_seqs = cu_kv_lens.shape[0] - 1
    kv_lens = cu_kv_lens[1:] - cu_kv_lens[:-1]
    seq, pos, is_real = query_positions(cu_q_lens, kv_lens, num_tokens)
    key = jnp.arange(num_keys, dtype=jnp.int32)
    key_seq = jnp.searchsorted(cu_kv_lens, key, side="right").astype(jnp.int32) - 1
    key_index = key - cu_kv_lens[jnp.clip(key_seq, 0, num_seqs - 1)]
    key_real = key < cu_kv_lens[num_seqs]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def attend(chunk):
        q_c, seq_c, pos_c, is_real_c = chunk
        visible = (key_seq[None] == seq_c[:, None]) & (key_index[None] <= pos_c[:, None])
        visible &= is_real_c[:, None] & key_real[None]  # [Tc, S]
        any_visible = jnp.any(visible, axis=0)  # keys some query of the chunk reads
        kn = jnp.where(any_visible[:, None, None], f32(k_nope), 0.0)
        kp = jnp.where(any_visible[:, None], f32(k_pe), 0.0)
        vv = jnp.where(any_visible[:, None, None], f32(v), 0.0)
        q_c = f32(q_c)
        scores = jnp.einsum("thk,shk->ths", q_c[..., :k_nope_dim], kn, precision=lax.Precision.HIGHEST)
        scores += jnp.einsum("thk,sk->ths", q_c[..., k_nope_dim:], kp, precision=lax.Precision.HIGHEST)
        weights, lse = _softmax_with_lse(jnp.where(visible[:, None, :], scores * scale, -jnp.inf))
        return jnp.einsum("ths,shv->thv", weights, vv, precision=lax.Precision.HIGHEST), lse

    o, lse = _map_query_chunks(attend, (q, seq, pos, is_real), num_keys * num_heads * 8)
    return o.astype(q.dtype), lse


def absorb_queries_reference(q: jax.Array, kv_b: jax.Array, *, layer: int, k_nope: int) -> jax.Array:
    """``q [T, H, Kn+Kr]`` -> the absorbed query ``[T, H, R+Kr]`` in q's dtype: each head's ``q[..., :Kn]``
    through its W_UK (the first Kn of its ``Kn + V`` columns of ``kv_b [L, R, H*(Kn+V)]``, layer ``layer``) in
    fp32, then the rotary part ``q[..., Kn:]``."""
    heads = q.shape[1]
    w = kv_b[layer].reshape(kv_b.shape[1], heads, -1)[..., :k_nope]  # [R, H, Kn]
    q_lat = jnp.einsum("thn,rhn->thr", q[..., :k_nope], w, preferred_element_type=jnp.float32)
    return jnp.concatenate([q_lat, q[..., k_nope:].astype(jnp.float32)], axis=-1).astype(q.dtype)


def absorb_outputs_reference(o_lat: jax.Array, kv_b: jax.Array, *, layer: int, v_dim: int) -> jax.Array:
    """``o_lat [T, H, R]`` -> ``[T, H, V]`` f32: each head's latent output through its W_UV (the last V of its
    columns of ``kv_b``, layer ``layer``)."""
    heads = o_lat.shape[1]
    w = kv_b[layer].reshape(kv_b.shape[1], heads, -1)[..., -v_dim:]  # [R, H, V]
    return jnp.einsum("thr,rhv->thv", o_lat, w, preferred_element_type=jnp.float32)
