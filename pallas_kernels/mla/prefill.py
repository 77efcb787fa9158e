"""Pallas (Triton-style) un-absorbed ("MHA mode") MLA prefill attention over packed, up-projected keys/values.

The caller gathers each request's context latent from its pages, up-projects it with ``kv_b_proj`` into
per-head ``k_nope``/``v`` (``k_pe`` stays shared by all heads), and calls this with the new tokens' queries.
One program handles ``block_q`` consecutive queries of one sequence for one head and streams that sequence's
keys ``block_k`` at a time: first the key blocks every query of the tile sees (no mask), then the causal
diagonal blocks (masked). Semantics match :func:`pallas_kernels.mla.reference.mla_prefill_attention_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tuning
from pallas_kernels.impl import interpret_mode
from pallas_kernels.mla.attention import plan_tiles
from pallas_kernels.mla.config import MLAPrefillConfig
from pallas_kernels.mla.reference import NO_KEY_LSE, query_positions


def _prefill_kernel(
    tile_seq_ref, tile_q0_ref, cu_q_lens_ref, cu_kv_lens_ref, q_ref, k_nope_ref, k_pe_ref, v_ref,
    o_ref, lse_ref,
    *, scale, block_q, block_k,
):  # fmt: skip
    """One (query tile, head) program. Refs are full arrays: q [T, H, Kn+Kr], k_nope [S, H, Kn], k_pe [S, Kr],
    v [S, H, V], o [T, H, V], lse [T, H]."""
    tile, head = pl.program_id(0), pl.program_id(1)
    k_nope_dim, width, v_dim = k_nope_ref.shape[-1], q_ref.shape[-1], v_ref.shape[-1]
    seq = tile_seq_ref[tile]
    q0 = tile_q0_ref[tile]
    first_token = cu_q_lens_ref[seq]
    q_len = cu_q_lens_ref[seq + 1] - first_token
    kv_start = cu_kv_lens_ref[seq]
    kv_len = cu_kv_lens_ref[seq + 1] - kv_start

    @pl.when(q0 < q_len)
    def _():
        q_index = q0 + jnp.arange(block_q, dtype=jnp.int32)
        row_real = q_index < q_len
        token = jnp.where(row_real, first_token + q_index, q_ref.shape[0])[:, None]  # padding: one past the end
        pos = kv_len - q_len + q_index
        nope_cols = jnp.arange(k_nope_dim, dtype=jnp.int32)[None, :]
        pe_cols = jnp.arange(width - k_nope_dim, dtype=jnp.int32)[None, :]
        v_cols = jnp.arange(v_dim, dtype=jnp.int32)[None, :]
        q_nope = pltriton.load(q_ref.at[token, head, nope_cols], mask=row_real[:, None], other=0)
        q_pe = pltriton.load(q_ref.at[token, head, k_nope_dim + pe_cols], mask=row_real[:, None], other=0)
        dtype = q_nope.dtype
        q_nope = (q_nope.astype(jnp.float32) * scale).astype(dtype)
        q_pe = (q_pe.astype(jnp.float32) * scale).astype(dtype)

        def body(kb, carry, *, causal):
            acc, row_max, denom = carry
            key = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
            key_real = key < kv_len
            key_row = jnp.where(key_real, kv_start + key, 0)[:, None]
            mask = key_real[:, None] if causal else None
            zero = 0 if causal else None
            k_nope = pltriton.load(k_nope_ref.at[key_row, head, nope_cols], mask=mask, other=zero)
            k_pe = pltriton.load(k_pe_ref.at[key_row, pe_cols], mask=mask, other=zero)
            v = pltriton.load(v_ref.at[key_row, head, v_cols], mask=mask, other=zero)
            scores = jnp.dot(q_nope, k_nope.T, preferred_element_type=jnp.float32)
            scores += jnp.dot(q_pe, k_pe.T, preferred_element_type=jnp.float32)
            if causal:
                visible = (key[None, :] <= pos[:, None]) & row_real[:, None]
                scores = jnp.where(visible, scores, NO_KEY_LSE)
            new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
            probs = jnp.exp(scores - new_max[:, None])
            if causal:
                probs = jnp.where(visible, probs, 0.0)
            correction = jnp.exp(row_max - new_max)
            denom = denom * correction + jnp.sum(probs, axis=1)
            acc = acc * correction[:, None] + jnp.dot(probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return acc, new_max, denom

        carry = (
            jnp.zeros((block_q, v_dim), jnp.float32),
            jnp.full((block_q,), NO_KEY_LSE, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
        )
        num_open_blocks = (kv_len - q_len + q0 + 1) // block_k  # blocks every query of the tile sees in full
        num_blocks = pl.cdiv(kv_len - q_len + jnp.minimum(q0 + block_q, q_len), block_k)
        carry = lax.fori_loop(0, num_open_blocks, functools.partial(body, causal=False), carry)
        acc, row_max, denom = lax.fori_loop(num_open_blocks, num_blocks, functools.partial(body, causal=True), carry)
        seen = denom > 0
        safe_denom = jnp.where(seen, denom, 1.0)
        lse = jnp.where(seen, row_max + jnp.log(safe_denom), NO_KEY_LSE)
        out = (acc / safe_denom[:, None]).astype(o_ref.dtype)
        pltriton.store(o_ref.at[token, head, v_cols], out, mask=row_real[:, None])
        pltriton.store(lse_ref.at[token[:, 0], head], lse, mask=row_real)


def smem_bytes(cfg: MLAPrefillConfig, k_nope_dim: int, k_rope_dim: int, v_dim: int, dtype) -> int:
    """Shared memory of the prefill kernel (:mod:`pallas_kernels.tuning`'s estimate): per loop step ``block_k`` rows
    of ``k_nope``, ``k_pe`` and ``v``, ``num_stages`` deep; the scaled queries ``[block_q, Kn + Kr]`` and the
    probabilities ``[block_q, block_k]`` staged into the dots."""
    step = tuning.nbytes(dtype, cfg.block_k, k_nope_dim + k_rope_dim + v_dim)
    return cfg.num_stages * step + tuning.nbytes(dtype, cfg.block_q, k_nope_dim + k_rope_dim + cfg.block_k)


def fit_config(config: MLAPrefillConfig | None, k_nope_dim: int, k_rope_dim: int, v_dim: int,
               dtype) -> MLAPrefillConfig:
    """The resolved config shrunk to the device's shared memory: fewer stages, then smaller ``block_k``, then
    ``block_q`` (down to 16)."""
    cfg = tuning.resolve(MLAPrefillConfig, config)
    return tuning.fit("mla_unabsorbed_prefill_attention", cfg,
                      lambda c: smem_bytes(c, k_nope_dim, k_rope_dim, v_dim, dtype),
                      tuning.smaller(cfg, "num_stages", [("block_k", 16), ("block_q", 16)]),
                      what=f"K_nope={k_nope_dim}, K_rope={k_rope_dim}, V={v_dim} in {jnp.dtype(dtype).name}")


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def mla_prefill_attention_pallas(
    q: jax.Array,
    k_nope: jax.Array,
    k_pe: jax.Array,
    v: jax.Array,
    cu_q_lens: jax.Array,
    cu_kv_lens: jax.Array,
    *,
    scale: float,
    config: MLAPrefillConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas version of :func:`~pallas_kernels.mla.reference.mla_prefill_attention_reference` (same contract).

    ``K_nope``, ``K_rope`` and ``V`` must be powers of 2 >= 16 (Triton); ``config``: the tiling (powers of 2;
    None fields: tuned, see :class:`~pallas_kernels.mla.config.MLAPrefillConfig`), shrunk by :func:`fit_config`."""
    num_tokens, num_heads, _ = q.shape
    num_seqs = cu_q_lens.shape[0] - 1
    v_dim = v.shape[-1]
    cfg = fit_config(config, k_nope.shape[-1], k_pe.shape[-1], v_dim, q.dtype)
    block_q, block_k = cfg.block_q, cfg.block_k
    num_tiles = min(num_tokens, -(-num_tokens // block_q) + num_seqs)
    cu_q_lens, cu_kv_lens = cu_q_lens.astype(jnp.int32), cu_kv_lens.astype(jnp.int32)
    tile_seq, tile_q0 = plan_tiles(cu_q_lens, num_tiles, block_q)
    operands = (tile_seq, tile_q0, cu_q_lens, cu_kv_lens, q, k_nope, k_pe, v)
    o, lse = pl.pallas_call(
        functools.partial(_prefill_kernel, scale=scale, block_q=block_q, block_k=block_k),
        # Tiles vary fastest: programs launched together read the same head's keys (L2 reuse).
        grid=(num_tiles, num_heads),
        in_specs=[pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n) for x in operands],
        out_specs=[
            pl.BlockSpec((num_tokens, num_heads, v_dim), lambda *_: (0, 0, 0)),
            pl.BlockSpec((num_tokens, num_heads), lambda *_: (0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_tokens, num_heads, v_dim), q.dtype),
            jax.ShapeDtypeStruct((num_tokens, num_heads), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps or (
            cfg.wide_warps if block_q >= cfg.wide_rows else cfg.narrow_warps), num_stages=cfg.num_stages),
        interpret=interpret_mode() if interpret is None else interpret,
        name="mla_unabsorbed_prefill_attention",
    )(*operands)
    _, _, is_real = query_positions(cu_q_lens, cu_kv_lens[1:] - cu_kv_lens[:-1], num_tokens)
    o = jnp.where(is_real[:, None, None], o, 0)
    lse = jnp.where(is_real[:, None], lse, NO_KEY_LSE)
    return o, lse
