"""Residual add + RMSNorm (the step between sublayers) with reference / Pallas implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.impl import layer_stacks, resolve_impl
from pallas_kernels.rmsnorm.config import AddRMSNormConfig
from pallas_kernels.rmsnorm.partial_sum import PartialSum, total
from pallas_kernels.rmsnorm.reference import add_rms_norm_reference

__all__ = ["AddRMSNormConfig", "add_rms_norm", "add_rms_norm_reference", "PartialSum", "total"]


def add_rms_norm(x: jax.Array, delta: jax.Array | PartialSum | None, weight: jax.Array, *, eps: float,
                 layer: int | None = None, impl: str | None = None,
                 config: AddRMSNormConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """``x [T, D]``, ``delta [T, D]`` or a :class:`PartialSum` of that shape, ``weight [D]`` ->
    ``(x + delta, rms_norm(x + delta) * weight)``, both in ``x.dtype`` (the sum rounded once, statistics in
    float32; ``delta=None`` normalises ``x`` alone).

    ``layer``: ``weight`` is a stack ``[L, D]`` and row ``layer`` is used. The kernel reads that row in place:
    a sliced ``weight[layer]`` handed to a Pallas call is first copied by XLA (one memcpy node per call in the
    step's CUDA graph; BENCHMARKS.md, RMSNorm).
    ``impl``: ``None | "reference" | "pallas"`` (one kernel instead of XLA's three, plus those that would sum a
    :class:`PartialSum`: the decode step's case). ``config``: the kernel's launch knobs (None: tuned)."""
    (stacked,), row = layer_stacks(layer, weight)
    delta_shape = delta.shape if delta is not None else x.shape
    if x.ndim != 2 or tuple(delta_shape) != x.shape or stacked.ndim != 2 or stacked.shape[1:] != x.shape[-1:]:
        raise ValueError(f"x [T, D], delta like x, weight [D] (or [L, D] with layer); got x {x.shape}, "
                         f"delta {None if delta is None else tuple(delta_shape)}, weight {weight.shape}")
    if resolve_impl(impl) == "pallas":
        from pallas_kernels.rmsnorm.kernel import add_rms_norm_pallas

        if delta is not None and not isinstance(delta, PartialSum):
            delta = PartialSum.of((jnp.asarray(delta)[:, None, :], None))
        return add_rms_norm_pallas(x, delta, stacked, eps=eps, layer=row, config=config)
    if isinstance(delta, PartialSum):
        delta = delta.total()
    return add_rms_norm_reference(x, delta, stacked[row], eps)
