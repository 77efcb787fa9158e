"""Residual add + RMSNorm (the step between sublayers) with reference / Pallas implementations."""

from __future__ import annotations

import jax

from pallas_kernels.impl import layer_stacks, resolve_impl
from pallas_kernels.rmsnorm.reference import add_rms_norm_reference

__all__ = ["add_rms_norm", "add_rms_norm_reference"]


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float, layer: int | None = None,
                 impl: str | None = None) -> tuple[jax.Array, jax.Array]:
    """``x, delta [T, D]``, ``weight [D]`` -> ``(x + delta, rms_norm(x + delta) * weight)``, both in ``x.dtype``
    (the sum rounded first, statistics in float32; ``delta=None`` normalises ``x`` alone).

    ``layer``: ``weight`` is a stack ``[L, D]`` and row ``layer`` is used. The kernel reads that row in place:
    a sliced ``weight[layer]`` handed to a Pallas call is first copied by XLA (one memcpy node per call in the
    step's CUDA graph; BENCHMARKS.md, session 7).
    ``impl``: ``None | "reference" | "pallas"`` (one kernel instead of XLA's three: the decode step's case)."""
    (stacked,), row = layer_stacks(layer, weight)
    if (x.ndim != 2 or (delta is not None and delta.shape != x.shape) or stacked.ndim != 2
            or stacked.shape[1:] != x.shape[-1:]):
        raise ValueError(f"x [T, D], delta like x, weight [D] (or [L, D] with layer); got x {x.shape}, "
                         f"delta {None if delta is None else delta.shape}, weight {weight.shape}")
    if resolve_impl(impl) == "pallas":
        from pallas_kernels.rmsnorm.kernel import add_rms_norm_pallas

        return add_rms_norm_pallas(x, delta, stacked, eps=eps, layer=row)
    return add_rms_norm_reference(x, delta, stacked[row], eps)
