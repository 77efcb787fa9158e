"""Small numerics shared by every layer: linear maps, RMSNorm, GLU activations, parameter init."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.impl import resolve_impl
from pallas_kernels.rmsnorm import PartialSum

F32 = jnp.float32
CHUNK_ELEMENTS = 1 << 26  # random parameters larger than this are drawn one trailing matrix at a time
SKINNY_MAX_ROWS = 8
"""Row counts up to which :func:`stacked_linear` runs the Pallas grouped GEMM on the whole stack under
``impl="pallas"`` (0: never, XLA everywhere). Decode-sized; chosen by measurement (``bench_decode
--skinny-rows``, BENCHMARKS.md)."""


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., in] @ w [in, out]`` with fp32 accumulation, result in x's dtype."""
    return jnp.einsum("...i,io->...o", x.astype(w.dtype), w, preferred_element_type=F32).astype(x.dtype)


def stacked_linear(x: jax.Array, stack: jax.Array, j: int, *, impl: str | None = None) -> jax.Array:
    """``linear(x, stack[j])`` for ``x [T, in]`` and a layer-stacked weight ``stack [L, in, out]``.

    With ``impl="pallas"`` and ``T <= SKINNY_MAX_ROWS``, the grouped GEMM reads layer j in place (one group of
    T rows at expert offset j, split-K for parallelism): for one-row GEMMs XLA copies the ``stack[j]`` slice first
    (2.9 ms of a 6.3 ms K3 batch-1 step on the H200) and lowers small ones as reductions over few blocks."""
    return stacked_linears(x, (stack,), j, impl=impl)[0]


def _skinny_products(x: jax.Array, stacks: tuple[jax.Array, ...], j: int, impl: str | None, *,
                     sum_splits: bool = True) -> jax.Array | None:
    """One grouped-GEMM launch of ``x`` against layer ``j`` of every stack on the skinny path (see
    :func:`stacked_linear`): ``[T, sum out_i]`` (``[T, P, sum out_i]`` split-K parts unless ``sum_splits``);
    None off that path."""
    if not (x.ndim == 2 and x.shape[0] <= SKINNY_MAX_ROWS and resolve_impl(impl) == "pallas"):
        return None
    from pallas_kernels.mxfp4 import grouped_matmul_concat

    rows = jnp.full((1,), x.shape[0], jnp.int32)
    return grouped_matmul_concat(x.astype(stacks[0].dtype), [s[:, None] for s in stacks], rows, layer=j,
                                 impl="pallas", sum_splits=sum_splits)


def stacked_linears(x: jax.Array, stacks: tuple[jax.Array, ...], j: int, *,
                    impl: str | None = None) -> list[jax.Array]:
    """``[linear(x, s[j]) for s in stacks]`` for weights of one input width (``[L, in, out_i]``).

    On the skinny path (see :func:`stacked_linear`) the products come from one kernel launch (widths that
    share a power-of-two tile); elsewhere they are separate GEMMs."""
    both = _skinny_products(x, stacks, j, impl)
    if both is not None:
        return split_columns(both.astype(x.dtype), [s.shape[-1] for s in stacks])
    return [linear(x, s[j]) for s in stacks]


def stacked_linear_unsummed(x: jax.Array, stack: jax.Array, j: int, *,
                            impl: str | None = None) -> jax.Array | PartialSum:
    """:func:`stacked_linear` for a layer's last projection: on the skinny path its split-K partial products
    are left for the residual add + RMSNorm kernel to add (a :class:`PartialSum`, saving XLA's reduction in
    front of it); elsewhere the array."""
    parts = _skinny_products(x, (stack,), j, impl, sum_splits=False)
    return linear(x, stack[j]) if parts is None else PartialSum.of((parts, None))


def split_columns(y: jax.Array, widths: list[int]) -> list[jax.Array]:
    """``y [..., sum(widths)]`` -> its consecutive column blocks of those widths (products computed side by side)."""
    return jnp.split(y, list(itertools.accumulate(widths))[:-1], axis=-1)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis, statistics in fp32, result in x's dtype."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(F32)).astype(x.dtype)


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(gate.dtype)


def situ_glu(gate: jax.Array, up: jax.Array, beta: float, linear_beta: float) -> jax.Array:
    """SiTU-GLU (K3): ``beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta)`` in fp32."""
    g = gate.astype(F32)
    u = up.astype(F32)
    act = beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * (linear_beta * jnp.tanh(u / linear_beta))
    return act.astype(gate.dtype)


def glu(gate: jax.Array, up: jax.Array, cfg) -> jax.Array:
    """The config's gated activation: SiLU-GLU or SiTU-GLU."""
    if cfg.hidden_act == "situ":
        return situ_glu(gate, up, cfg.situ_beta, cfg.situ_linear_beta)
    return silu_glu(gate, up)


def draw_in_chunks(key: jax.Array, shape: tuple[int, ...], draw) -> jax.Array:
    """``draw(key, shape)``, for more than CHUNK_ELEMENTS elements one trailing ``[in, out]`` matrix at a time
    (``lax.map`` over the leading axes). Drawing a whole stack at once needs 4-16 temporary bytes per element:
    237 GB for one K3 MXFP4 expert stack, which made the random 896-expert k3-slice run out of memory."""
    if len(shape) <= 2 or math.prod(shape) <= CHUNK_ELEMENTS:
        return draw(key, shape)
    keys = jax.random.split(key, math.prod(shape[:-2]))
    return jax.lax.map(lambda k: draw(k, shape[-2:]), keys).reshape(shape)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> nnx.Param:
    """A parameter drawn from N(0, std^2)."""
    return nnx.Param(draw_in_chunks(rngs.params(), shape,
                                    lambda key, s: (jax.random.normal(key, s, F32) * std).astype(dtype)))


def fan_in_normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> nnx.Param:
    """N(0, 1/fan_in) for a stacked linear weight ``[L, in, out]`` (fan_in = shape[-2])."""
    return normal(rngs, shape, shape[-2] ** -0.5, dtype)


def constant(shape: tuple[int, ...], value: float, dtype=F32) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, dtype))
