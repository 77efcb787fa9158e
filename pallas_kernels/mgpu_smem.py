"""Shared-memory layout helpers for the Mosaic-GPU (Hopper warpgroup) kernels."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

BARRIER_BYTES = 8
"""Shared memory of one mbarrier (a 64-bit word)."""


def wgmma_operand_transforms(minor: int, bits: int = 16):
    """Shared-memory tiling + swizzle for a ``wgmma`` operand (or a tile loaded into one) whose minor dimension
    holds ``minor`` elements of ``bits`` bits."""
    swizzle = plgpu.find_swizzle(minor * bits, "operand")
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)
