"""MoE routing at decode in two Triton-style Pallas kernels.

XLA runs a decode step's router as about seven kernels per MoE layer (H200 trace, session 7): the fp32
``HIGHEST`` logits of a few rows as a multiply that materialises ``[T, D, E]`` then a reduction, the bias add,
``top_k`` as a sort, the sum and the scaling of the chosen scores, and the per-row tile schedule. Here:

1. ``_logits_kernel``, grid ``(row tiles, E / block_e, split_d)``: fp32 partial logits of 16 rows for one expert
   block over one part of D (IEEE fp32 dot), into ``[split_d, T, E]``; split over D so that small steps still
   spread the router weight's bytes over about ``TARGET_PROGRAMS`` programs.
2. ``_topk_kernel``, grid ``(T,)``: the partial sums added, sigmoid, plus bias, ``k`` rounds of (maximum, lowest
   index holding it, mask it out), the chosen unbiased scores renormalised and scaled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.impl import interpret_mode, mma_block

BLOCK_T = 16  # rows per logits program (the MMA's minimum)
TARGET_PROGRAMS = 128  # about one per SM of the H200


def _logits_kernel(x_ref, w_ref, o_ref, *, layer, block_d, block_e, steps):
    tile, e_block, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(tile * BLOCK_T, BLOCK_T)
    row_mask = (tile * BLOCK_T + jnp.arange(BLOCK_T)) < x_ref.shape[0]
    cols = pl.ds(pl.multiple_of(e_block * block_e, block_e), block_e)

    def body(i, acc):
        d = pl.ds(pl.multiple_of((part * steps + i) * block_d, block_d), block_d)
        x = pltriton.load(x_ref.at[rows, d], mask=row_mask[:, None], other=0.0).astype(jnp.float32)
        w = w_ref[layer, d, cols].astype(jnp.float32)
        return acc + jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((BLOCK_T, block_e), jnp.float32))
    pltriton.store(o_ref.at[part, rows, cols], acc, mask=row_mask[:, None])


def _topk_kernel(partial_ref, bias_ref, weights_ref, ids_ref, *, layer, k, width, k_width, renormalize, scaling):
    row = pl.program_id(0)
    experts = partial_ref.shape[2]
    lanes = jnp.arange(width)
    valid = lanes < experts

    def add_part(s, acc):
        return acc + pltriton.load(partial_ref.at[s, row, pl.ds(0, width)], mask=valid, other=0.0)

    logits = jax.lax.fori_loop(0, partial_ref.shape[0], add_part, jnp.zeros((width,), jnp.float32))
    scores = jax.nn.sigmoid(logits)
    bias = pltriton.load(bias_ref.at[jnp.int32(layer), pl.ds(0, width)], mask=valid, other=0.0)
    choice = jnp.where(valid, scores + bias.astype(jnp.float32), -jnp.inf)
    slots = jnp.arange(k_width)
    ids = jnp.zeros((k_width,), jnp.int32)
    chosen = jnp.zeros((k_width,), jnp.float32)
    for i in range(k):  # static: k rounds of (max, lowest index holding it), like lax.top_k's order and ties
        best = jnp.max(choice)
        pick = jnp.minimum(jnp.min(jnp.where(choice == best, lanes, width)), experts - 1)  # NaN rows: stay in range
        hit = lanes == pick
        ids = jnp.where(slots == i, pick, ids)
        chosen = jnp.where(slots == i, jnp.sum(jnp.where(hit, scores, 0.0)), chosen)
        choice = jnp.where(hit, -jnp.inf, choice)
    if renormalize:
        chosen = chosen / (jnp.sum(chosen) + 1e-20)
    out = pl.ds(0, k_width)
    pltriton.store(weights_ref.at[row, out], chosen * scaling, mask=slots < k)
    pltriton.store(ids_ref.at[row, out], ids, mask=slots < k)


@functools.partial(jax.jit, static_argnames=("layer", "k", "renormalize", "scaling"))
def route_pallas(x: jax.Array, router: jax.Array, bias: jax.Array, *, layer: int, k: int, renormalize: bool,
                 scaling: float) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.router.route_reference` for ``x [T, D]`` with layer ``layer`` of the stacks
    ``router [L, D, E]``, ``bias [L, E]`` -> ``(weights [T, k] f32, ids [T, k] int32)``."""
    rows, dim = x.shape
    experts = router.shape[2]
    block_e, block_d = mma_block(experts, 64), mma_block(dim, 64)
    tiles = pl.cdiv(rows, BLOCK_T)
    steps_total = dim // block_d
    base = tiles * (experts // block_e)
    split = next((s for s in range(1, steps_total + 1) if steps_total % s == 0 and base * s >= TARGET_PROGRAMS),
                 steps_total)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - full-array ref
    partial_shape = jax.ShapeDtypeStruct((split, rows, experts), jnp.float32)
    partial = pl.pallas_call(
        functools.partial(_logits_kernel, layer=layer, block_d=block_d, block_e=block_e, steps=steps_total // split),
        out_shape=partial_shape, grid=(tiles, experts // block_e, split),
        in_specs=[whole(x), whole(router)], out_specs=whole(partial_shape),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret_mode(), name="router_logits",
    )(x, router)
    outs = (jax.ShapeDtypeStruct((rows, k), jnp.float32), jax.ShapeDtypeStruct((rows, k), jnp.int32))
    return pl.pallas_call(
        functools.partial(_topk_kernel, layer=layer, k=k, width=pl.next_power_of_2(experts),
                          k_width=pl.next_power_of_2(k), renormalize=renormalize, scaling=scaling),
        out_shape=outs, grid=(rows,), in_specs=[whole(partial), whole(bias)],
        out_specs=tuple(whole(o) for o in outs),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret_mode(), name="router_topk",
    )(partial, bias)
