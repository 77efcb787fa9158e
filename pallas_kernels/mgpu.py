"""Helpers shared by the Mosaic-GPU (Hopper warpgroup) kernels: shared-memory layouts and operand buffers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

BARRIER_BYTES = 8
"""Shared memory of one mbarrier (a 64-bit word)."""


def wgmma_operand_transforms(minor: int, bits: int = 16):
    """Shared-memory tiling + swizzle for a ``wgmma`` operand (or a tile loaded into one) whose minor dimension
    holds ``minor`` elements of ``bits`` bits."""
    swizzle = plgpu.find_swizzle(minor * bits, "operand")
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def fresh_int32_buffer(x: jax.Array, floor: int = 0) -> jax.Array:
    """``x`` as int32 in a buffer of its own, values below ``floor`` raised to it (0 for indices; -1 where any
    negative value means "none"). Mosaic-GPU's custom call rejects operands that are not 256-byte aligned, and XLA
    hands a custom call a slice of a larger buffer in place: the engine's block tables, context lengths and state
    slots are slices of its packed step words (the first engine runs of the MLA and KDA decodes failed so at batch
    64). The max with ``floor`` is an op XLA cannot drop, so it writes a new buffer."""
    return jnp.maximum(x.astype(jnp.int32), floor)
