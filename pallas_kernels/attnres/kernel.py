"""Fused AttnRes mix as a Triton-style Pallas kernel: one program per block of ``BN`` tokens.

Pass 1 streams the ``L`` sources once over ``D`` in power-of-two chunks and accumulates, per token, each
source's sum of squares, its dot with ``query * rms_weight`` and (with an output norm) the Gram matrix of the
sources, so that ``|mixed|^2 = w^T G w`` is known before ``mixed`` is formed. Pass 2 reads the sources again
(from L2 for a block this size) and writes the mixed, optionally normalised, output. All math is float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tuning
from pallas_kernels.attnres.config import AttnResConfig
from pallas_kernels.impl import interpret_mode


def _chunk_width(d: int, max_width: int) -> int:
    """Largest power of two dividing ``d`` and at most ``max_width`` (Triton needs power-of-two arrays)."""
    width = 1
    while d % (width * 2) == 0 and width * 2 <= max_width:
        width *= 2
    return width


def _attnres_kernel(qw_ref, ow_ref, src_ref, out_ref, w_ref, *, num_sources, width, chunk, eps, norm_output):
    L, DC = num_sources, chunk
    num_chunks = width // DC
    pairs = [(a, b) for a in range(L) for b in range(a, L)] if norm_output else []

    def stats(c, carry):
        ss, dots, gram = carry
        cols = pl.ds(pl.multiple_of(c * DC, DC), DC)
        qw = qw_ref[cols].astype(jnp.float32)
        v = [src_ref[l, :, cols].astype(jnp.float32) for l in range(L)]
        ss = tuple(s + jnp.sum(x * x, axis=1) for s, x in zip(ss, v))
        dots = tuple(t + jnp.sum(x * qw[None, :], axis=1) for t, x in zip(dots, v))
        gram = tuple(g + jnp.sum(v[a] * v[b], axis=1) for g, (a, b) in zip(gram, pairs))
        return ss, dots, gram

    bn = src_ref.shape[1]
    zeros = jnp.zeros((bn,), jnp.float32)
    ss, dots, gram = jax.lax.fori_loop(0, num_chunks, stats,
                                       ((zeros,) * L, (zeros,) * L, (zeros,) * len(pairs)))
    scores = [t * jax.lax.rsqrt(s / width + eps) for s, t in zip(ss, dots)]
    top = functools.reduce(jnp.maximum, scores)
    exps = [jnp.exp(s - top) for s in scores]
    total = functools.reduce(jnp.add, exps)
    weights = [e / total for e in exps]
    for l in range(L):
        w_ref[l, :] = weights[l]

    inv_rms = None
    if norm_output:
        sq = zeros
        for g, (a, b) in zip(gram, pairs):
            sq = sq + (1.0 if a == b else 2.0) * weights[a] * weights[b] * g
        inv_rms = jax.lax.rsqrt(jnp.maximum(sq, 0.0) / width + eps)

    def mix(c, _):
        cols = pl.ds(pl.multiple_of(c * DC, DC), DC)
        acc = jnp.zeros((bn, DC), jnp.float32)
        for l in range(L):
            acc = acc + weights[l][:, None] * src_ref[l, :, cols].astype(jnp.float32)
        if norm_output:
            acc = acc * inv_rms[:, None] * ow_ref[cols].astype(jnp.float32)[None, :]
        out_ref[:, cols] = acc.astype(out_ref.dtype)
        return 0

    jax.lax.fori_loop(0, num_chunks, mix, 0)


@functools.partial(jax.jit, static_argnames=("eps", "scale", "config"))
def attnres_mix_pallas(query: jax.Array, sources: jax.Array, rms_weight: jax.Array, *,
                       output_rms_weight: jax.Array | None = None, eps: float = 1e-6, scale: float = 1.0,
                       config: AttnResConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """``query [D]``, ``sources [L, N, D]``, ``rms_weight [D]`` -> ``(mixed [N, D], weights [L, N] f32)``.

    Same contract as :func:`pallas_kernels.attnres.reference.attnres_mix_reference`; ``config``:
    :class:`~pallas_kernels.attnres.config.AttnResConfig` (None fields: tuned).
    """
    cfg = tuning.resolve(AttnResConfig, config)
    block_n = cfg.block_n
    L, N, D = sources.shape
    qw = query.astype(jnp.float32) * rms_weight.astype(jnp.float32) * scale
    norm_output = output_rms_weight is not None
    ow = output_rms_weight.astype(jnp.float32) if norm_output else jnp.ones((D,), jnp.float32)
    kernel = functools.partial(_attnres_kernel, num_sources=L, width=D, chunk=_chunk_width(D, cfg.max_chunk),
                               eps=eps, norm_output=norm_output)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((N, D), sources.dtype), jax.ShapeDtypeStruct((L, N), jnp.float32)),
        grid=(pl.cdiv(N, block_n),),
        in_specs=[pl.BlockSpec((D,), lambda i: (0,)), pl.BlockSpec((D,), lambda i: (0,)),
                  pl.BlockSpec((L, block_n, D), lambda i: (0, i, 0))],
        out_specs=(pl.BlockSpec((block_n, D), lambda i: (i, 0)), pl.BlockSpec((L, block_n), lambda i: (0, i))),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret_mode(),
        name="attnres_mix",
    )(qw, ow, sources)
