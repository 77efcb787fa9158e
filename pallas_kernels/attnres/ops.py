"""Public AttnRes mix: one call site, implementation chosen by ``impl``."""

from __future__ import annotations

import jax

from pallas_kernels.attnres.config import AttnResConfig
from pallas_kernels.attnres.reference import attnres_mix_reference
from pallas_kernels.impl import resolve_impl


def attnres_mix(query: jax.Array, sources: jax.Array, rms_weight: jax.Array, *,
                output_rms_weight: jax.Array | None = None, eps: float = 1e-6, scale: float = 1.0,
                impl: str | None = None, config: AttnResConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """``query [D]``, ``sources [L, N, D]``, ``rms_weight [D]`` -> ``(mixed [N, D], weights [L, N] f32)``.

    See :func:`pallas_kernels.attnres.reference.attnres_mix_reference` for the math. ``impl=None`` means the
    XLA-fused reference on every backend: the Pallas kernel (``impl="pallas"``) is kept off the default path
    until bench.py shows it beating XLA's fusion on the H200. ``config``: the kernel's launch knobs (None: tuned).
    """
    if impl is not None and resolve_impl(impl) == "pallas":
        from pallas_kernels.attnres.kernel import attnres_mix_pallas
        return attnres_mix_pallas(query, sources, rms_weight, output_rms_weight=output_rms_weight, eps=eps,
                                  scale=scale, config=config)
    return attnres_mix_reference(query, sources, rms_weight, output_rms_weight=output_rms_weight, eps=eps,
                                 scale=scale)
