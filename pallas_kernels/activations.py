"""Gated (GLU) activations, shared by the model's reference layers and the kernels that fuse them into a GEMM's
input load. ``act`` is a hashable spec (a static kernel argument): ``("silu",)`` or ``("situ", beta,
linear_beta)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def glu_activation(gate: jax.Array, up: jax.Array, act: tuple) -> jax.Array:
    """``act(gate) * up`` in float32 (inputs of any float dtype, result float32).

    SiLU-GLU: ``silu(gate) * up``; SiTU-GLU (K3): ``beta*tanh(gate/beta)*sigmoid(gate) *
    linear_beta*tanh(up/linear_beta)``."""
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    if act[0] == "silu":
        return g * jax.nn.sigmoid(g) * u
    if act[0] == "situ":
        beta, linear_beta = act[1], act[2]
        return beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * (linear_beta * jnp.tanh(u / linear_beta))
    raise ValueError(f"unknown gated activation {act!r}")


def glu_of_halves(x: jax.Array, act: tuple) -> jax.Array:
    """``x [M, 2F]`` (gate then up, e.g. a concatenated gate/up projection) -> ``act(gate) * up`` ``[M, F]`` in
    x's dtype."""
    if x.shape[-1] % 2:
        raise ValueError(f"a gated activation needs gate and up halves, got width {x.shape[-1]}")
    half = x.shape[-1] // 2
    return glu_activation(x[..., :half], x[..., half:], act).astype(x.dtype)
