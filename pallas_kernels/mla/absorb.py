"""The absorbed MLA form's two per-head up-projections at decode, as Triton-style Pallas kernels reading the
stacked ``kv_b [L, R, H*(Kn+V)]`` parameter in place.

* :func:`absorb_queries_pallas`: ``q_lat[t, h] = q_nope[t, h] @ W_UK[h].T`` (``W_UK[h] = kv_b[l, :, h*C:h*C+Kn]``,
  ``C = Kn + V``), written beside the rotary part as the attention's query ``[T, H, R+Kr]``, grid
  ``(H, R / block_r, T tiles)``.
* :func:`absorb_outputs_pallas`: ``o[t, h] = o_lat[t, h] @ W_UV[h]`` (``W_UV[h] = kv_b[l, :, h*C+Kn:(h+1)*C]``),
  grid ``(H, V / block_v, T tiles)``, a K loop over R.

XLA lowers these one-row batched products as a broadcast multiply (materialising ``[H, R, V]`` fp32) and a
reduction, plus a concatenation for the query: 4.0 + 1.3 + 4.2 + 2.7 us per MLA layer of a Kimi-Linear
batch-1 step on the H200 for 8.4 MB of weights (BENCHMARKS.md, MLA decode). fp32 accumulation, as
``einsum(..., preferred_element_type=f32)``. Tiles: :class:`~pallas_kernels.mla.config.AbsorbQueriesConfig`,
:class:`~pallas_kernels.mla.config.AbsorbOutputsConfig`, shrunk to the device's shared memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tuning
from pallas_kernels.impl import interpret_mode, mma_block
from pallas_kernels.mla.config import AbsorbOutputsConfig, AbsorbQueriesConfig

BLOCK_T = 16  # query rows per program (the MMA's minimum; decode steps have 1-16)


def _precision(ref):
    """IEEE products for fp32 operands (the GPU's default would round them to TF32); bf16 as is."""
    return jax.lax.Precision.HIGHEST if ref.dtype == jnp.float32 else None


def _absorb_q_kernel(q_ref, w_ref, o_ref, *, layer, block_r, width, k_nope):
    head, r_block, t_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(t_block * BLOCK_T, BLOCK_T)
    row_mask = (t_block * BLOCK_T + jnp.arange(BLOCK_T)) < q_ref.shape[0]
    k_rope = q_ref.shape[2] - k_nope
    rank = o_ref.shape[2] - k_rope
    q = pltriton.load(q_ref.at[rows, head, pl.ds(0, k_nope)], mask=row_mask[:, None], other=0.0)
    r_cols = pl.ds(pl.multiple_of(r_block * block_r, block_r), block_r)
    w = w_ref[layer, r_cols, pl.ds(head * width, k_nope)]  # [block_r, Kn]
    out = jnp.dot(q, w.T, precision=_precision(q_ref), preferred_element_type=jnp.float32)
    pltriton.store(o_ref.at[rows, head, r_cols], out.astype(o_ref.dtype), mask=row_mask[:, None])

    @pl.when(r_block == 0)  # the rotary part passes through, after the latent columns
    def _():
        rope = pltriton.load(q_ref.at[rows, head, pl.ds(k_nope, k_rope)], mask=row_mask[:, None], other=0.0)
        pltriton.store(o_ref.at[rows, head, pl.ds(rank, k_rope)], rope, mask=row_mask[:, None])


def _absorb_o_kernel(x_ref, w_ref, o_ref, *, layer, block_v, block_k, width, k_nope):
    head, v_block, t_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(t_block * BLOCK_T, BLOCK_T)
    row_mask = (t_block * BLOCK_T + jnp.arange(BLOCK_T)) < x_ref.shape[0]
    first_col = head * width + k_nope + v_block * block_v

    def body(k, acc):
        ks = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        x = pltriton.load(x_ref.at[rows, head, ks], mask=row_mask[:, None], other=0.0)
        w = w_ref[layer, ks, pl.ds(first_col, block_v)]  # [block_k, block_v]
        return acc + jnp.dot(x, w, precision=_precision(x_ref), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, x_ref.shape[2] // block_k, body, jnp.zeros((BLOCK_T, block_v), jnp.float32))
    pltriton.store(o_ref.at[rows, head, pl.ds(pl.multiple_of(v_block * block_v, block_v), block_v)], acc,
                   mask=row_mask[:, None])


def _check(x: jax.Array, kv_b: jax.Array, layer: int) -> int:
    """-> per-head column width C of kv_b."""
    heads = x.shape[1]
    if kv_b.ndim != 3 or kv_b.shape[2] % heads:
        raise ValueError(f"kv_b must be [L, R, H*(Kn+V)] with H={heads}, got {kv_b.shape}")
    if not 0 <= layer < kv_b.shape[0]:
        raise ValueError(f"layer={layer} out of range for {kv_b.shape[0]} stacked layers")
    return kv_b.shape[2] // heads


@functools.partial(jax.jit, static_argnames=("layer", "k_nope", "config"))
def absorb_queries_pallas(q: jax.Array, kv_b: jax.Array, *, layer: int, k_nope: int,
                          config: AbsorbQueriesConfig | None = None) -> jax.Array:
    """``q [T, H, Kn+Kr]`` (the no-position part first), ``kv_b [L, R, H*(Kn+V)]`` -> ``q_abs [T, H, R+Kr]`` in
    q's dtype: ``q[..., :Kn]`` through layer ``layer``'s W_UK (fp32 accumulation), then ``q[..., Kn:]``. Shared
    memory (no loop): the ``[BLOCK_T, Kn]`` queries and the ``[block_r, Kn]`` weight tile; ``block_r`` halves
    (down to 16) until they fit."""
    tokens, heads, q_width = q.shape
    width = _check(q, kv_b, layer)
    rank = kv_b.shape[1]
    if not 0 < k_nope < q_width or k_nope > width:
        raise ValueError(f"k_nope={k_nope} does not fit q {q.shape} / kv_b {kv_b.shape}")
    cfg = tuning.resolve(AbsorbQueriesConfig, config)
    cfg = dataclasses.replace(cfg, block_r=mma_block(rank, cfg.block_r))
    estimate = lambda c: tuning.nbytes(q.dtype, BLOCK_T, k_nope) + tuning.nbytes(  # noqa: E731
        kv_b.dtype, c.block_r, k_nope)
    cfg = tuning.fit("mla_absorb_queries", cfg, estimate, tuning.smaller(cfg, "num_stages", [("block_r", 16)]),
                     what=f"k_nope={k_nope}")
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - full-array ref
    out = jax.ShapeDtypeStruct((tokens, heads, rank + q_width - k_nope), q.dtype)
    return pl.pallas_call(
        functools.partial(_absorb_q_kernel, layer=layer, block_r=cfg.block_r, width=width, k_nope=k_nope),
        out_shape=out, grid=(heads, rank // cfg.block_r, pl.cdiv(tokens, BLOCK_T)),
        in_specs=[whole(q), whole(kv_b)], out_specs=whole(out),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret_mode(), name="mla_absorb_queries",
    )(q, kv_b)


@functools.partial(jax.jit, static_argnames=("layer", "v_dim", "config"))
def absorb_outputs_pallas(o_lat: jax.Array, kv_b: jax.Array, *, layer: int, v_dim: int,
                          config: AbsorbOutputsConfig | None = None) -> jax.Array:
    """``o_lat [T, H, R]``, ``kv_b [L, R, H*(Kn+V)]`` -> ``[T, H, V]`` f32 (layer ``layer``'s W_UV, V=v_dim).
    Shared memory: per loop step the ``[BLOCK_T, block_k]`` latents and the ``[block_k, block_v]`` weight tile,
    ``num_stages`` deep; fewer stages, then smaller ``block_k`` and ``block_v`` (down to 16) until they fit."""
    tokens, heads, rank = o_lat.shape
    width = _check(o_lat, kv_b, layer)
    if kv_b.shape[1] != rank or not 0 < v_dim < width:
        raise ValueError(f"o_lat {o_lat.shape} / v_dim={v_dim} do not match kv_b {kv_b.shape}")
    cfg = tuning.resolve(AbsorbOutputsConfig, config)
    cfg = dataclasses.replace(cfg, block_v=mma_block(v_dim, cfg.block_v), block_k=mma_block(rank, cfg.block_k))
    cfg = tuning.fit("mla_absorb_outputs", cfg, lambda c: c.num_stages * (
        tuning.nbytes(o_lat.dtype, BLOCK_T, c.block_k) + tuning.nbytes(kv_b.dtype, c.block_k, c.block_v)),
        tuning.smaller(cfg, "num_stages", [("block_k", 16), ("block_v", 16)]), what=f"R={rank}, V={v_dim}")
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - full-array ref
    out = jax.ShapeDtypeStruct((tokens, heads, v_dim), jnp.float32)
    return pl.pallas_call(
        functools.partial(_absorb_o_kernel, layer=layer, block_v=cfg.block_v, block_k=cfg.block_k, width=width,
                          k_nope=width - v_dim),
        out_shape=out, grid=(heads, v_dim // cfg.block_v, pl.cdiv(tokens, BLOCK_T)),
        in_specs=[whole(o_lat), whole(kv_b)], out_specs=whole(out),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret_mode(), name="mla_absorb_outputs",
    )(o_lat, kv_b)
