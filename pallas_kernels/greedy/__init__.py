"""Greedy sampling (argmax + its log-probability) with reference / Pallas implementations."""

from __future__ import annotations

import jax

from pallas_kernels.greedy.config import GreedyConfig
from pallas_kernels.greedy.reference import greedy_reference
from pallas_kernels.impl import resolve_impl

__all__ = ["GreedyConfig", "greedy", "greedy_reference"]


def greedy(logits: jax.Array, *, impl: str | None = None,
           config: GreedyConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """``logits [N, V]`` -> ``(token_ids [N] int32, logprobs [N] float32)``: the first index of each row's
    maximum and its log-probability under ``softmax(row)``. ``impl``: ``None | "reference" | "pallas"`` (one
    kernel instead of XLA's six; ``config``: its launch knobs, None: tuned). Rows containing NaN: unspecified."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, V], got shape {logits.shape}")
    if resolve_impl(impl) == "pallas":
        from pallas_kernels.greedy.kernel import greedy_pallas

        return greedy_pallas(logits, config=config)
    return greedy_reference(logits)
