"""Exact in-register decodes shared by the MXFP4 kernels (Triton and Mosaic-GPU): E2M1 codes and E8M0 scales to
bf16, by integer ops on the bit patterns (no float arithmetic, so no rounding and no denormal flushing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def e2m1_to_bf16(codes: jax.Array) -> jax.Array:
    """uint16 E2M1 codes (0..15) -> exact bf16 values. Magnitude ``c`` (3 bits) -> bits ``0x3F00 + (c << 6)`` is
    exact for ``c >= 2`` (exponent ``e + 126``, mantissa bit ``m``); codes 0 and 1 (0 and 0.5) are ``c * 0x3F00``;
    the sign goes to bit 15."""
    mag = codes & 7
    bits = jnp.where(mag >= 2, (mag << 6) + 0x3F00, mag * 0x3F00) | ((codes & 8) << 12)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def e8m0_to_bf16(scales: jax.Array) -> jax.Array:
    """uint8 E8M0 exponents -> bf16 ``2**(s - 127)``: exponent field ``s``; code 0 is the bf16 subnormal
    ``2**-127`` (bits 0x0040)."""
    s = scales.astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(jnp.where(s == 0, jnp.uint16(0x40), s << 7), jnp.bfloat16)
