"""Implementation selection shared by every op: one place decides reference vs Pallas and interpret mode."""

from __future__ import annotations

import os

import jax

IMPLS = ("reference", "pallas")


def on_gpu() -> bool:
    """True when the default JAX backend is a CUDA GPU."""
    return jax.default_backend() == "gpu"


def on_hopper() -> bool:
    """True when the default device is a compute capability 9.x GPU (H100 / H200): what Mosaic-GPU kernels built on
    ``wgmma`` and TMA need."""
    return on_gpu() and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def resolve_impl(impl: str | None) -> str:
    """Turn ``None`` into the backend default (``KIMI_JAX_IMPL`` env overrides); validate names."""
    if impl is None:
        impl = os.environ.get("KIMI_JAX_IMPL") or ("pallas" if on_gpu() else "reference")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def interpret_mode() -> bool:
    """Pallas kernels run in interpret mode unless a GPU is present (or ``PALLAS_INTERPRET=1`` forces it)."""
    return os.environ.get("PALLAS_INTERPRET") == "1" or not on_gpu()


def layer_stacks(layer: int | None, *arrays: jax.Array) -> tuple[tuple[jax.Array, ...], int]:
    """Per-layer operands that a kernel reads in place -> (``[L, ...]`` stacks, the row to read). With ``layer``
    the arrays already are stacks of the model's layers; without, each gets a leading axis of one and the row is 0.
    A slice ``stack[layer]`` handed to a Pallas call would be copied by XLA first (a memcpy node per call in the
    step's CUDA graph; BENCHMARKS.md, engine step graph)."""
    if layer is None:
        return tuple(a[None] for a in arrays), 0
    num_layers = arrays[0].shape[0]
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer} outside the stack's {num_layers} layers")
    return arrays, int(layer)


def mma_block(size: int, largest: int) -> int:
    """A kernel's tile along a dimension: the largest power of two <= ``largest`` dividing ``size``; at least 16
    (the Triton dot's minimum), else ValueError."""
    block = largest
    while size % block:
        block //= 2
    if block < 16:
        raise ValueError(f"{size} is not a multiple of 16")
    return block
