"""Residual add + RMSNorm in one Triton-style Pallas kernel: one program per row.

XLA runs this step as three kernels (the add, the sum-of-squares reduction, the scaling); at decode each is a
launch of a microsecond or two on a few kilobytes, and every kernel in a step's CUDA graph also costs host time
when the graph is re-recorded (BENCHMARKS.md, session 6). A program loads its row once (``D`` padded to a power
of two, masked), writes the rounded sum and the normalised row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.impl import interpret_mode


def _add_rms_norm_kernel(*refs, width, dim, eps, with_delta, layer):
    if with_delta:
        x_ref, d_ref, w_ref, s_ref, y_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
    row = pl.program_id(0)
    cols = pl.ds(0, width)
    mask = jnp.arange(width) < dim
    s = pltriton.load(x_ref.at[row, cols], mask=mask, other=0.0)
    if with_delta:
        d = pltriton.load(d_ref.at[row, cols], mask=mask, other=0.0)
        s = (s.astype(jnp.float32) + d.astype(jnp.float32)).astype(s_ref.dtype)
        pltriton.store(s_ref.at[row, cols], s, mask=mask)
    sf = s.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(sf * sf) / dim + eps)
    w = pltriton.load(w_ref.at[jnp.int32(layer), cols], mask=mask, other=0.0).astype(jnp.float32)
    pltriton.store(y_ref.at[row, cols], (sf * inv * w).astype(y_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "layer", "num_warps"))
def add_rms_norm_pallas(x: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float, layer: int = 0,
                        num_warps: int | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.rmsnorm.reference.add_rms_norm_reference` with ``weight[layer]`` of a stack
    ``weight [L, D]`` (``x, delta [T, D]``). ``num_warps`` defaults to 4 up to ``D = 4096`` and 8 above."""
    rows, dim = x.shape
    width = pl.next_power_of_2(dim)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - full-array ref
    inputs = (x, weight) if delta is None else (x, delta, weight)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    outs = (out,) if delta is None else (out, out)
    result = pl.pallas_call(
        functools.partial(_add_rms_norm_kernel, width=width, dim=dim, eps=float(eps), with_delta=delta is not None,
                          layer=layer),
        out_shape=outs, grid=(rows,), in_specs=[whole(a) for a in inputs], out_specs=tuple(whole(o) for o in outs),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or (4 if width <= 4096 else 8), num_stages=1),
        interpret=interpret_mode(), name="add_rms_norm",
    )(*inputs)
    return (x, result[0]) if delta is None else tuple(result)
