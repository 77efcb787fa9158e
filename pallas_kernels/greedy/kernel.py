"""Greedy sampling as a Triton-style Pallas kernel plus a small combine: grid (rows, vocabulary chunks).

XLA splits each of the three reductions over a vocabulary-wide row (max, argmax, sum of exponentials) into two
kernels, six launches per decode step after the lm_head. Here each program reduces one ``chunk`` of one row to
its maximum, the first index of that maximum and the sum of ``exp(x - max)``; the ``[N, chunks]`` partials are
then merged in jnp (the argmax is the first index among the chunks holding the global maximum, the sum is
rescaled to it) into the token and ``-log(sum exp(x - max))``, its log-probability. A chunk per program keeps
a whole-vocabulary row spread over many SMs (one program streaming 655 KB alone would take longer than XLA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tuning
from pallas_kernels.greedy.config import GreedyConfig
from pallas_kernels.impl import interpret_mode


def _partials_kernel(logits_ref, max_ref, index_ref, sum_ref, *, vocab, chunk):
    row, c = pl.program_id(0), pl.program_id(1)
    cols = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    x = pltriton.load(logits_ref.at[row, pl.ds(pl.multiple_of(c * chunk, chunk), chunk)], mask=cols < vocab,
                      other=-jnp.inf).astype(jnp.float32)
    top = jnp.max(x)
    shift = jnp.where(top == -jnp.inf, 0.0, top)  # an all -inf chunk sums to 0, not NaN
    max_ref[row, c] = top
    index_ref[row, c] = jnp.min(jnp.where(x == top, cols, vocab))
    sum_ref[row, c] = jnp.sum(jnp.exp(x - shift))


@functools.partial(jax.jit, static_argnames=("config",))
def greedy_pallas(logits: jax.Array, *, config: GreedyConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """Same contract as :func:`pallas_kernels.greedy.reference.greedy_reference` (``logits [N, V]``); ``config``:
    :class:`~pallas_kernels.greedy.config.GreedyConfig` (None fields: tuned)."""
    rows, vocab = logits.shape
    cfg = tuning.resolve(GreedyConfig, config)
    chunk = min(cfg.chunk, pl.next_power_of_2(vocab))
    chunks = pl.cdiv(vocab, chunk)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - full-array ref
    outs = tuple(jax.ShapeDtypeStruct((rows, chunks), dtype) for dtype in (jnp.float32, jnp.int32, jnp.float32))
    top, index, total = pl.pallas_call(
        functools.partial(_partials_kernel, vocab=vocab, chunk=chunk), out_shape=outs, grid=(rows, chunks),
        in_specs=[whole(logits)], out_specs=tuple(whole(o) for o in outs),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret_mode(), name="greedy_sample",
    )(logits)
    best = jnp.max(top, axis=-1, keepdims=True)
    tokens = jnp.min(jnp.where(top == best, index, vocab), axis=-1)  # first chunk holding the maximum
    scale = jnp.where(top == -jnp.inf, 0.0, jnp.exp(top - jnp.where(best == -jnp.inf, 0.0, best)))
    return tokens.astype(jnp.int32), -jnp.log(jnp.sum(total * scale, axis=-1))
