"""Pure-jnp AttnRes depth mixing (float32 math), shaped like flash-linear-attention's ``naive_attnres``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """float32 RMSNorm over the last axis: ``x * rsqrt(mean(x**2) + eps) * weight``."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(jnp.float32)


def attnres_mix_reference(query: jax.Array, sources: jax.Array, rms_weight: jax.Array, *,
                          output_rms_weight: jax.Array | None = None, eps: float = 1e-6,
                          scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Softmax-over-depth mix of ``sources [L, N, D]`` scored against the pseudo-query ``query [D]``.

    ``s_l = scale * query . RMSNorm(sources_l; rms_weight, eps)``, ``weights = softmax_L(s)`` (float32),
    ``mixed = sum_l weights_l * sources_l`` over the un-normalised sources, then
    ``RMSNorm(mixed; output_rms_weight, eps)`` when given. Returns ``(mixed [N, D] in sources.dtype,
    weights [L, N] float32)``; any number of middle axes may stand in for ``N``.
    """
    v = sources.astype(jnp.float32)
    keys = rms_norm(v, rms_weight, eps)
    scores = jnp.einsum("l...d,d->l...", keys, query.astype(jnp.float32) * scale,
                        precision=jax.lax.Precision.HIGHEST)
    weights = jax.nn.softmax(scores, axis=0)
    mixed = jnp.einsum("l...,l...d->...d", weights, v, precision=jax.lax.Precision.HIGHEST)
    if output_rms_weight is not None:
        mixed = rms_norm(mixed, output_rms_weight, eps)
    return mixed.astype(sources.dtype), weights
