"""Residual add + RMSNorm in one Triton-style Pallas kernel: one program per row.

XLA runs this step as three kernels (the add, the sum-of-squares reduction, the scaling); at decode each is a
launch of a microsecond or two on a few kilobytes, and every kernel in a step's CUDA graph also costs host time
when the graph is re-recorded (BENCHMARKS.md, RMSNorm). A program loads its row once (``D`` padded to a power
of two, masked), writes the rounded sum and the normalised row. The addend may be a :class:`PartialSum`
(split-K partials, router-weighted expert rows, the shared expert): its parts are added here, in float32, which
saves XLA's reduction / combine kernel in front of every norm of a decode step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tuning
from pallas_kernels.impl import interpret_mode
from pallas_kernels.rmsnorm.config import AddRMSNormConfig
from pallas_kernels.rmsnorm.partial_sum import PartialSum


def _add_rms_norm_kernel(*refs, width, dim, eps, terms, layer):
    x_ref, refs = refs[0], refs[1:]
    term_refs = []
    for _, weighted in terms:  # (part [T, P, D], coeff [T, P] when weighted)
        term_refs.append((refs[0], refs[1] if weighted else None))
        refs = refs[1 + weighted:]
    w_ref, *s_ref, y_ref = refs
    row = pl.program_id(0)
    cols = pl.ds(0, width)
    mask = jnp.arange(width) < dim
    s = pltriton.load(x_ref.at[row, cols], mask=mask, other=0.0)
    if terms:
        delta = jnp.zeros((width,), jnp.float32)
        for (count, _), (part_ref, coeff_ref) in zip(terms, term_refs):
            for p in range(count):
                v = pltriton.load(part_ref.at[row, jnp.int32(p), cols], mask=mask, other=0.0).astype(jnp.float32)
                delta = delta + (v if coeff_ref is None else v * coeff_ref[row, jnp.int32(p)].astype(jnp.float32))
        s = (s.astype(jnp.float32) + delta).astype(s_ref[0].dtype)
        pltriton.store(s_ref[0].at[row, cols], s, mask=mask)
    sf = s.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(sf * sf) / dim + eps)
    w = pltriton.load(w_ref.at[jnp.int32(layer), cols], mask=mask, other=0.0).astype(jnp.float32)
    pltriton.store(y_ref.at[row, cols], (sf * inv * w).astype(y_ref.dtype), mask=mask)


def _num_warps(cfg: AddRMSNormConfig, rows: int, width: int) -> int:
    if cfg.num_warps:
        return cfg.num_warps
    if rows <= cfg.few_rows:
        return cfg.few_rows_warps
    return cfg.narrow_warps if width <= cfg.wide_width else cfg.wide_warps


@functools.partial(jax.jit, static_argnames=("eps", "layer", "config"))
def add_rms_norm_pallas(x: jax.Array, delta: PartialSum | None, weight: jax.Array, *, eps: float, layer: int = 0,
                        config: AddRMSNormConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.rmsnorm.reference.add_rms_norm_reference` with ``weight[layer]`` of a stack
    ``weight [L, D]`` (``x [T, D]``, ``delta`` summed into the residual in float32 before one rounding).
    ``config``: the warps per program (:class:`~pallas_kernels.rmsnorm.config.AddRMSNormConfig`; None: tuned, by
    the row count and width)."""
    rows, dim = x.shape
    width = pl.next_power_of_2(dim)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - full-array ref
    terms, term_inputs = (), []
    if delta is not None:
        terms = tuple((part.shape[1], coeff is not None) for part, coeff in zip(delta.parts, delta.coeffs))
        for part, coeff in zip(delta.parts, delta.coeffs):
            term_inputs += [part] + ([coeff] if coeff is not None else [])
    inputs = (x, *term_inputs, weight)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    outs = (out,) if delta is None else (out, out)
    result = pl.pallas_call(
        functools.partial(_add_rms_norm_kernel, width=width, dim=dim, eps=float(eps), terms=terms, layer=layer),
        out_shape=outs, grid=(rows,), in_specs=[whole(a) for a in inputs], out_specs=tuple(whole(o) for o in outs),
        compiler_params=pltriton.CompilerParams(
            num_warps=_num_warps(tuning.resolve(AddRMSNormConfig, config), rows, width), num_stages=1),
        interpret=interpret_mode(), name="add_rms_norm",
    )(*inputs)
    return (x, result[0]) if delta is None else tuple(result)
