"""Pure-jnp references for the MXFP4 and bf16 (grouped) GEMMs: dequantise to float32, then dot in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp4.quant import dequantize

_HIGHEST = jax.lax.Precision.HIGHEST


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``x [M, K]`` (rows sorted by expert) @ ``w [E, K, N]`` per group -> ``[M, N]`` in ``x.dtype``.

    Row ``m`` uses expert ``e`` with ``sum(group_sizes[:e]) <= m < sum(group_sizes[:e+1])``; rows at or past
    ``sum(group_sizes)`` are zero.
    """
    out = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), group_sizes.astype(jnp.int32),
                             precision=_HIGHEST)
    rows = jnp.arange(x.shape[0])[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, 0.0).astype(x.dtype)


def rows_matmul_reference(x: jax.Array, w: jax.Array, row_experts: jax.Array) -> jax.Array:
    """``x [M, K]`` @ ``w [E, K, N]`` row by row: row ``m`` uses expert ``row_experts[m]`` -> ``[M, N]`` in
    ``x.dtype``."""
    return jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), w.astype(jnp.float32)[row_experts],
                      precision=_HIGHEST).astype(x.dtype)


def mxfp4_grouped_matmul_reference(x: jax.Array, packed: jax.Array, scales: jax.Array,
                                   group_sizes: jax.Array) -> jax.Array:
    """``x [M, K]`` sorted by expert, ``packed [E, N, K/2]``, ``scales [E, N, K/32]`` -> ``x @ W_e.T`` ``[M, N]``."""
    w = jnp.swapaxes(dequantize(packed, scales, jnp.float32), 1, 2)
    return grouped_matmul_reference(x, w, group_sizes)


def mxfp4_matmul_reference(x: jax.Array, packed: jax.Array, scales: jax.Array) -> jax.Array:
    """``x [M, K]``, ``packed [N, K/2]``, ``scales [N, K/32]`` -> ``x @ W.T`` ``[M, N]`` in ``x.dtype``."""
    w = dequantize(packed, scales, jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w.T, precision=_HIGHEST).astype(x.dtype)
