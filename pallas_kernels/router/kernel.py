"""MoE routing at decode in two Triton-style Pallas kernels.

XLA runs a decode step's router as about seven kernels per MoE layer (H200 trace; BENCHMARKS.md, router): the fp32
``HIGHEST`` logits of a few rows as a multiply that materialises ``[T, D, E]`` then a reduction, the bias add,
``top_k`` as a sort, the sum and the scaling of the chosen scores, and the per-row tile schedule. Here:

1. ``_logits_kernel``, grid ``(row tiles, E / block_e, split_d)``: fp32 partial logits of 16 rows for one expert
   block over one part of D (IEEE fp32 dot), into ``[split_d, T, E]``; split over D so that small steps still
   spread the router weight's bytes over about ``target_programs`` programs.
2. ``_topk_kernel``, grid ``(T,)``: the partial sums added (all parts loaded at once: the loop over them it
   replaced waited one L2 round trip per part, 12.2 -> 9.4 us for both kernels at batch 1), sigmoid,
   plus bias, ``k`` rounds of (argmax, mask it out), the chosen unbiased scores renormalised and scaled. The
   rounds are serial reductions across the program's warps, so each round is one (value, index) reduction.

One launch instead of two (the logits programs count themselves done on an atomic counter and the last one runs
the top-k) measured no faster at one row and 3x slower at 16 on the H200: the last program's serial loads of
every part cost what the second launch did. Launch knobs: :class:`~pallas_kernels.router.config.RouterConfig`.
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
from pallas_kernels.router.config import RouterConfig

BLOCK_T = 16  # rows per logits program (the MMA's minimum)


def _sum_parts(partial_ref, row, width, experts):
    """``[1, width]``: row ``row`` of ``partial_ref [parts, T, E]`` summed over the parts (lanes past E are 0).
    The parts are a static unroll: independent loads, all in flight at once."""
    valid = (jnp.arange(width) < experts)[None, :]
    return sum(pltriton.load(partial_ref.at[jnp.int32(p), pl.ds(row, 1), pl.ds(0, width)], mask=valid, other=0.0)
               for p in range(partial_ref.shape[0]))


def _select(logits, bias, *, experts, k, k_width, renormalize, scaling):
    """One row of fp32 logits ``[1, width]`` and the bias ``[1, width]`` -> (weights ``[k_width]``, ids
    ``[k_width]``): ``k`` rounds of (lowest index of the maximum, mask it out), like ``lax.top_k``'s order and
    ties, each round one (value, index) reduction; the chosen scores are gathered after the loop in one 2D
    reduction. Slots past ``k`` hold id 0 and weight 0."""
    width = logits.shape[1]
    lanes = jnp.arange(width)[None, :]
    scores = jax.nn.sigmoid(logits)
    choice = jnp.where(lanes < experts, scores + bias, -jnp.inf)
    slots = jnp.arange(k_width)[:, None]
    ids = jnp.zeros((k_width, 1), jnp.int32)
    for i in range(k):  # static; NaN rows may pick a padding lane: the clamp keeps the id in range
        pick = jnp.minimum(jnp.argmax(choice, axis=1, keepdims=True).astype(jnp.int32), experts - 1)  # [1, 1]
        ids = jnp.where(slots == i, pick, ids)
        choice = jnp.where(lanes == pick, -jnp.inf, choice)
    chosen = jnp.sum(jnp.where((ids == lanes) & (slots < k), scores, 0.0), axis=1)  # [k_width]
    if renormalize:
        chosen = chosen / (jnp.sum(chosen) + 1e-20)
    return chosen * scaling, ids.reshape(k_width)


def _load_bias(bias_ref, layer, width, experts):
    return pltriton.load(bias_ref.at[pl.ds(jnp.int32(layer), 1), pl.ds(0, width)],
                         mask=(jnp.arange(width) < experts)[None, :], other=0.0).astype(jnp.float32)


def _logits_kernel(x_ref, w_ref, o_ref, *, layer, block_d, block_e, steps):
    """fp32 partial logits of row tile ``program_id(0)`` (16 rows), expert block ``program_id(1)``, D part
    ``program_id(2)``, into ``o_ref [parts, T, E]``."""
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


def _topk_kernel(partial_ref, bias_ref, weights_ref, ids_ref, *, layer, select):
    row = pl.program_id(0)
    experts = partial_ref.shape[2]
    width = pl.next_power_of_2(experts)
    logits = _sum_parts(partial_ref, row, width, experts)
    weights, ids = _select(logits, _load_bias(bias_ref, layer, width, experts), experts=experts, **select)
    out = (row, pl.ds(0, weights.shape[0]))
    mask = jnp.arange(weights.shape[0]) < select["k"]
    pltriton.store(weights_ref.at[out], weights, mask=mask)
    pltriton.store(ids_ref.at[out], ids, mask=mask)


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def logits_smem_bytes(cfg: RouterConfig, x_dtype, w_dtype) -> int:
    """Shared memory of the logits kernel (:mod:`pallas_kernels.tuning`'s estimate): per D step the ``[16,
    block_d]`` rows of x and the ``[block_d, block_e]`` router tile, ``logits_stages`` deep, and both cast to fp32
    in registers (when they are not) and staged into the dot."""
    x, w = tuning.nbytes(x_dtype, BLOCK_T, cfg.block_d), tuning.nbytes(w_dtype, cfg.block_d, cfg.block_e)
    staged = (jnp.dtype(x_dtype) != jnp.float32) * 4 * BLOCK_T * cfg.block_d + (
        jnp.dtype(w_dtype) != jnp.float32) * 4 * cfg.block_d * cfg.block_e
    return cfg.logits_stages * (x + w) + staged


def _plan(rows: int, dim: int, experts: int, cfg: RouterConfig):
    """-> (block_e, block_d, row tiles, D parts): the D split is the smallest divisor of D / block_d giving at
    least ``cfg.target_programs`` programs (all of them if none does)."""
    block_e, block_d, target_programs = cfg.block_e, cfg.block_d, cfg.target_programs
    tiles = pl.cdiv(rows, BLOCK_T)
    steps_total = dim // block_d
    base = tiles * (experts // block_e)
    split = next((s for s in range(1, steps_total + 1) if steps_total % s == 0 and base * s >= target_programs),
                 steps_total)
    return block_e, block_d, tiles, split


def _select_args(k, renormalize, scaling):
    return dict(k=k, k_width=pl.next_power_of_2(k), renormalize=renormalize, scaling=scaling)


@functools.partial(jax.jit, static_argnames=("layer", "k", "renormalize", "scaling", "config"))
def route_pallas(x: jax.Array, router: jax.Array, bias: jax.Array, *, layer: int, k: int, renormalize: bool,
                 scaling: float, config: RouterConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.router.route_reference` for ``x [T, D]`` with layer ``layer`` of the stacks
    ``router [L, D, E]``, ``bias [L, E]`` -> ``(weights [T, k] f32, ids [T, k] int32)``; two launches
    (``config``: :class:`~pallas_kernels.router.config.RouterConfig`, None fields tuned; its tiles shrink to the
    device's shared memory)."""
    rows, dim = x.shape
    experts = router.shape[2]
    cfg = tuning.resolve(RouterConfig, config)
    cfg = dataclasses.replace(cfg, block_e=mma_block(experts, cfg.block_e), block_d=mma_block(dim, cfg.block_d))
    cfg = tuning.fit("router_logits", cfg, lambda c: logits_smem_bytes(c, x.dtype, router.dtype),
                     tuning.smaller(cfg, "logits_stages", [("block_d", 16), ("block_e", 16)]),
                     what=f"D={dim}, E={experts}")
    block_e, block_d, tiles, split = _plan(rows, dim, experts, cfg)
    partial_shape = jax.ShapeDtypeStruct((split, rows, experts), jnp.float32)
    partial = pl.pallas_call(
        functools.partial(_logits_kernel, layer=layer, block_d=block_d, block_e=block_e,
                          steps=dim // block_d // split),
        out_shape=partial_shape, grid=(tiles, experts // block_e, split),
        in_specs=[_whole(x.shape), _whole(router.shape)], out_specs=_whole(partial_shape.shape),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.logits_warps, num_stages=cfg.logits_stages),
        interpret=interpret_mode(), name="router_logits",
    )(x, router)
    outs = (jax.ShapeDtypeStruct((rows, k), jnp.float32), jax.ShapeDtypeStruct((rows, k), jnp.int32))
    return pl.pallas_call(
        functools.partial(_topk_kernel, layer=layer, select=_select_args(k, renormalize, scaling)),
        out_shape=outs, grid=(rows,), in_specs=[_whole(partial.shape), _whole(bias.shape)],
        out_specs=tuple(_whole(o.shape) for o in outs),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.topk_warps, num_stages=1),
        interpret=interpret_mode(), name="router_topk",
    )(partial, bias)
