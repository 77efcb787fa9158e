"""Pure-jnp reference of the residual add + RMSNorm step: float32 statistics, results in the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def add_rms_norm_reference(x: jax.Array, delta: jax.Array | None, weight: jax.Array,
                           eps: float) -> tuple[jax.Array, jax.Array]:
    """``x, delta [T, D]`` (``delta`` in ``x.dtype`` or float32), ``weight [D]`` -> ``(s, y)``: the residual sum
    ``s = x + delta`` taken in float32 and rounded once to ``x.dtype`` (``s = x`` when ``delta`` is None) and ``y = s * rsqrt(mean(s^2) + eps) * weight``
    computed in float32 from the rounded ``s``, in ``x.dtype``."""
    s = x if delta is None else (x.astype(jnp.float32) + delta.astype(jnp.float32)).astype(x.dtype)
    sf = s.astype(jnp.float32)
    y = sf * jax.lax.rsqrt(jnp.mean(sf * sf, axis=-1, keepdims=True) + eps)
    return s, (y * weight.astype(jnp.float32)).astype(x.dtype)
