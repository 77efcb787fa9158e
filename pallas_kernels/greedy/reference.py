"""Pure-jnp reference of greedy sampling: the argmax of each row and its log-probability."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_reference(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``logits [N, V]`` -> ``(token_ids [N] int32, logprobs [N] float32)``: the first index of each row's maximum
    and ``log_softmax(row)[token]``, in float32."""
    x = logits.astype(jnp.float32)
    tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
