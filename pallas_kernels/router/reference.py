"""Pure-jnp reference of MoE routing (spec section 4): fp32 sigmoid scores, biased (optionally group-limited)
top-k selection, the chosen experts' unbiased scores renormalised and scaled."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def route_reference(x: jax.Array, router: jax.Array, bias: jax.Array, *, k: int, renormalize: bool = True,
                    scaling: float = 1.0, num_expert_group: int = 1, topk_group: int = 1
                    ) -> tuple[jax.Array, jax.Array]:
    """``x [T, D]``, ``router [D, E]``, ``bias [E]`` -> ``(weights [T, k] f32, expert ids [T, k] int32)``, the ids
    in descending order of biased score (lower id first on ties, like ``lax.top_k``)."""
    logits = jnp.einsum("td,de->te", x.astype(F32), router.astype(F32), precision=jax.lax.Precision.HIGHEST)
    return select_experts(logits, bias, k=k, renormalize=renormalize, scaling=scaling,
                          num_expert_group=num_expert_group, topk_group=topk_group)


def select_experts(logits: jax.Array, bias: jax.Array, *, k: int, renormalize: bool = True, scaling: float = 1.0,
                   num_expert_group: int = 1, topk_group: int = 1) -> tuple[jax.Array, jax.Array]:
    """The selection half of :func:`route_reference`: fp32 router ``logits [T, E]``, ``bias [E]`` -> ``(weights
    [T, k] f32, expert ids [T, k] int32)``. For callers that computed the logits themselves (a tensor-parallel
    router whose expert columns are split over ranks gathers them first)."""
    scores = jax.nn.sigmoid(logits.astype(F32))
    choice = scores + bias.astype(F32)
    if num_expert_group > 1:
        t_rows, e = choice.shape
        grouped = choice.reshape(t_rows, num_expert_group, e // num_expert_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        keep = jax.lax.top_k(group_score, topk_group)[1]
        group_mask = jnp.zeros_like(group_score, bool).at[jnp.arange(t_rows)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, e // num_expert_group, axis=1), choice, -jnp.inf)
    idx = jax.lax.top_k(choice, k)[1]
    weights = jnp.take_along_axis(scores, idx, axis=1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, idx.astype(jnp.int32)
