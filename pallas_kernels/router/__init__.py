"""MoE routing (router logits, sigmoid, biased top-k, renormalisation) with reference / Pallas implementations."""

from __future__ import annotations

import jax

from pallas_kernels.impl import layer_stacks, resolve_impl
from pallas_kernels.router.config import RouterConfig
from pallas_kernels.router.reference import route_reference, select_experts

__all__ = ["route", "route_reference", "select_experts", "KERNEL_MAX_ROWS", "RouterConfig"]

KERNEL_MAX_ROWS = 64
"""Token rows up to which ``impl="pallas"`` routes with the two Pallas kernels (decode steps); larger steps keep
XLA's GEMM for the logits."""


def route(x: jax.Array, router: jax.Array, bias: jax.Array, *, k: int, renormalize: bool = True,
          scaling: float = 1.0, num_expert_group: int = 1, topk_group: int = 1, layer: int | None = None,
          impl: str | None = None, config: RouterConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """``x [T, D]``, ``router [D, E]``, ``bias [E]`` -> ``(weights [T, k] f32, expert ids [T, k] int32)``.

    ``layer``: ``router [L, D, E]`` and ``bias [L, E]`` are per-layer stacks and row ``layer`` is used (the
    kernels read it in place; a slice handed to a Pallas call would be copied first).
    ``impl``: ``None | "reference" | "pallas"``. The Pallas path (two kernels instead of XLA's seven at decode:
    the fp32 logits split over experts and D, then sigmoid + bias + top-k + renormalisation per row) serves
    ``T <= KERNEL_MAX_ROWS``, ungrouped routing, ``E`` and ``D`` multiples of 16, ``k <= E``; anything else runs
    the reference. ``config``: the kernels' launch knobs (None: tuned)."""
    stacked, row = layer_stacks(layer, router, bias)
    if x.ndim != 2 or stacked[0].ndim != 3 or stacked[0].shape[1] != x.shape[1] or stacked[1].shape != (
            stacked[0].shape[0], stacked[0].shape[2]):
        raise ValueError(f"x [T, D], router [D, E] and bias [E] (stacked [L, D, E], [L, E] with layer); got x "
                         f"{x.shape}, router {router.shape}, bias {bias.shape}")
    dim, experts = stacked[0].shape[1:]
    if not 1 <= k <= experts:
        raise ValueError(f"k={k} must be in [1, E={experts}]")
    kernel_ok = (x.shape[0] <= KERNEL_MAX_ROWS and num_expert_group == 1 and experts % 16 == 0 and dim % 16 == 0)
    if resolve_impl(impl) == "pallas" and kernel_ok:
        from pallas_kernels.router.kernel import route_pallas

        return route_pallas(x, *stacked, layer=row, k=k, renormalize=renormalize, scaling=float(scaling),
                            config=config)
    return route_reference(x, stacked[0][row], stacked[1][row], k=k, renormalize=renormalize, scaling=scaling,
                           num_expert_group=num_expert_group, topk_group=topk_group)
