"""Expert parallelism: routed (token, choice) pairs dispatched to the experts' owners by all-to-all and combined back.

Runs inside the MoE layer's ``jax.shard_map`` (``sharding.parallel.Parallel.moe``), per device, over the expert
group ``axes`` (``("expert",)``, or every axis of a replica under ``--enable-expert-parallel``; rank ``r`` of the
group, ``lax.axis_index(axes)``, holds experts ``[r * E_local, (r + 1) * E_local)``).

Scheme (static shapes, no token dropping by default):
1. The replicated activations ``z [T, Din]`` (the latent width for LatentMoE: what crosses the network is
   ``Din = latent_dim`` wide, as LatentMoE intends) are split by rows: rank ``r`` dispatches tokens
   ``[r * T_local, (r + 1) * T_local)`` (T padded to a multiple of the group size).
2. Each of its ``T_local * k`` pairs goes to the rank owning its expert, at the next free position of a per-
   destination buffer of ``capacity`` rows: ``send [ep, capacity, Din]`` plus the local expert id of each row
   (-1: empty). One ``all_to_all`` delivers every rank the rows addressed to it, ``[ep * capacity, Din]``.
3. The rank runs its experts' grouped GEMMs (``kimi_jax.layers.ffn.expert_glu``: the Pallas MXFP4 / bf16 grouped
   kernels or ``ragged_dot``) on those rows sorted by expert; empty rows are zero and give zero.
4. A second ``all_to_all`` returns the results to the senders, which combine each token's k rows with its router
   weights, then the token rows are all-gathered over the group (the layer's output is replicated).
``capacity`` defaults to ``T_local * k`` (every pair of a rank could go to one expert owner: exact, so the
sharded model gives the one-device tokens); ``capacity_factor`` c sets ``ceil(c * T_local * k / ep)`` instead
(the expected share per owner times c), and pairs past it are dropped (contribute zero), as capacity-based EP
does. When each expert's FFN width is also split over the tensor-parallel axes (the ``expert`` axis without
``--enable-expert-parallel``), the combined rows are partial sums over those axes and are reduced there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from kimi_jax.config import ModelConfig
from kimi_jax.layers.ffn import MoEStack, expert_glu, row_path

F32 = jnp.float32


def dispatch_capacity(t_local: int, k: int, ep: int, capacity_factor: float | None) -> int:
    """Rows per destination of the dispatch buffer (see the module docstring)."""
    pairs = t_local * k
    if capacity_factor is None:
        return pairs
    return max(1, min(pairs, math.ceil(capacity_factor * pairs / ep)))


def ep_routed_experts(p: MoEStack, j: int, z: jax.Array, weights: jax.Array, idx: jax.Array, cfg: ModelConfig, *,
                      axes: tuple[str, ...], ep: int, partial_axes: tuple[str, ...] = (),
                      capacity_factor: float | None = None, impl: str | None = None) -> jax.Array:
    """Inside ``shard_map``: z [T, Din] replicated, router weights / expert ids [T, k] (global ids), ``p`` holding
    this rank's E / ep experts -> [T, Din] in z's dtype (replicated over the group).

    ``partial_axes``: axes over which the experts' FFN width is split (their outputs are summed there)."""
    t_rows, din = z.shape
    k = idx.shape[1]
    local_experts = cfg.num_experts // ep
    rank = lax.axis_index(axes)
    t_pad = -(-t_rows // ep) * ep
    t_local = t_pad // ep
    pad = ((0, t_pad - t_rows), (0, 0))
    z_mine = lax.dynamic_slice_in_dim(jnp.pad(z, pad), rank * t_local, t_local)
    w_mine = lax.dynamic_slice_in_dim(jnp.pad(weights, pad), rank * t_local, t_local)  # padding rows weigh 0
    e_mine = lax.dynamic_slice_in_dim(jnp.pad(idx, pad), rank * t_local, t_local).reshape(-1)  # [pairs]

    capacity = dispatch_capacity(t_local, k, ep, capacity_factor)
    dest = e_mine // local_experts
    pos = jnp.take_along_axis(jnp.cumsum(jax.nn.one_hot(dest, ep, dtype=jnp.int32), axis=0) - 1, dest[:, None],
                              axis=1)[:, 0]
    kept = pos < capacity
    slot = jnp.where(kept, pos, capacity)  # out of range: dropped by the scatters
    token = jnp.arange(t_local * k, dtype=jnp.int32) // k
    send = jnp.zeros((ep, capacity, din), z.dtype).at[dest, slot].set(z_mine[token], mode="drop")
    send_expert = jnp.full((ep, capacity), -1, jnp.int32).at[dest, slot].set(e_mine % local_experts, mode="drop")

    rows = lax.all_to_all(send, axes, 0, 0, tiled=True).reshape(ep * capacity, din)
    row_expert = lax.all_to_all(send_expert, axes, 0, 0, tiled=True).reshape(-1)
    out = _local_experts(p, j, rows, row_expert, local_experts, cfg, impl)  # f32 [ep * capacity, Din]
    back = lax.all_to_all(out.reshape(ep, capacity, din), axes, 0, 0, tiled=True)  # [ep, capacity, Din]

    y_pairs = jnp.where(kept[:, None], back[dest, jnp.minimum(slot, capacity - 1)], 0.0)
    y = jnp.einsum("tkd,tk->td", y_pairs.reshape(t_local, k, din), w_mine.astype(F32))
    if partial_axes:
        y = lax.psum(y, partial_axes)
    return lax.all_gather(y, axes, axis=0, tiled=True)[:t_rows].astype(z.dtype)


def _local_experts(p: MoEStack, j: int, rows: jax.Array, row_expert: jax.Array, local_experts: int,
                   cfg: ModelConfig, impl: str | None) -> jax.Array:
    """The GLU experts of this rank on received rows (-1 = empty, a zero row) -> f32 [M, Din] in row order."""
    expert = jnp.where(row_expert < 0, local_experts - 1, row_expert)  # empty rows are zero: any expert gives 0
    if row_path(rows.shape[0], 1, impl):
        return expert_glu(p, j, rows, cfg, impl=impl, row_experts=expert)
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.bincount(expert, length=local_experts).astype(jnp.int32)
    ys = expert_glu(p, j, rows[order], cfg, impl=impl, sizes=sizes)
    return jnp.zeros_like(ys).at[order].set(ys)
