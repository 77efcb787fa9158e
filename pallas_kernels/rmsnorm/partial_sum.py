"""A layer output whose last additions are left to the residual add + RMSNorm kernel that consumes it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PartialSum(NamedTuple):
    """``sum_i sum_p coeffs[i][t, p] * parts[i][t, p, :]`` (``coeffs[i] = None``: all ones), not yet taken.

    At decode such a sum is a launch of a microsecond or two on the critical path, e.g. a split-K GEMM's
    partials (``[T, splits, D]`` float32) or rows weighted by the router (``[T, k, D]`` with ``[T, k]``
    weights). :func:`pallas_kernels.rmsnorm.add_rms_norm` adds them into the residual in the same kernel as the
    norm (a few parts pay off: one program reads them all); :meth:`total` takes the sum in XLA."""

    parts: tuple[jax.Array, ...]
    coeffs: tuple[jax.Array | None, ...]

    @classmethod
    def of(cls, *terms: tuple[jax.Array, jax.Array | None]) -> "PartialSum":
        """From ``(part [T, P, D], coeff [T, P] or None)`` pairs."""
        for part, coeff in terms:
            if part.ndim != 3 or part.shape[::2] != terms[0][0].shape[::2] or (
                    coeff is not None and coeff.shape != part.shape[:2]):
                raise ValueError(f"parts [T, P, D] of one T and D with coeffs [T, P]; got {part.shape} and "
                                 f"{None if coeff is None else coeff.shape}")
        return cls(tuple(t[0] for t in terms), tuple(t[1] for t in terms))

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts[0].shape[0], self.parts[0].shape[2]

    def total(self, dtype=jnp.float32) -> jax.Array:
        """The sum ``[T, D]``, accumulated in float32, in ``dtype``."""
        acc = 0.0
        for part, coeff in zip(self.parts, self.coeffs):
            part = part.astype(jnp.float32)
            acc = acc + (jnp.sum(part, axis=1) if coeff is None else
                         jnp.einsum("tpd,tp->td", part, coeff.astype(jnp.float32)))
        return acc.astype(dtype)


def total(y: "jax.Array | PartialSum", dtype) -> jax.Array:
    """``y`` as an array in ``dtype`` (a :class:`PartialSum` summed)."""
    return y.total(dtype) if isinstance(y, PartialSum) else y.astype(dtype)

