"""MXFP4 (OCP MX: E2M1 elements, one E8M0 scale per 32 inputs) quantisation for the checkpoint layouts.

Compressed-tensors layout (what the K3 checkpoint stores and the model keeps in memory):
``packed`` uint8 ``[..., out, in/2]`` with the code of column ``2k`` in the low nibble and ``2k+1`` in the high
nibble, ``scales`` uint8 ``[..., out, in/32]`` holding the biased exponent ``e`` of the scale ``2**(e - 127)``.
The gpt-oss ``_blocks [..., out, in/32, 16]`` / ``_scales [..., out, in/32]`` layout is the same bytes in the
same order, grouped per 32-wide block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
E8M0_BIAS = 127
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest E2M1 power of two (4 = 2**2)

# value of each 4-bit code: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def e8m0_to_float32(scales: jax.Array) -> jax.Array:
    """Exact ``2**(scales - 127)`` as float32, built from bits (code 0 is the subnormal ``2**-127``)."""
    e = scales.astype(jnp.uint32)
    bits = jnp.where(e == 0, jnp.uint32(1 << 22), e << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _round_to_e2m1_code(a: np.ndarray) -> np.ndarray:
    """Code magnitude (0..7) nearest to ``a >= 0`` on the E2M1 grid, ties to the even code, saturating at 6."""
    # midpoints between neighbouring grid values; at a tie the even code (even mantissa) wins, so the
    # comparison is strict where the lower neighbour is even and non-strict where the upper one is
    steps = (a > 0.25, a >= 0.75, a > 1.25, a >= 1.75, a > 2.5, a >= 3.5, a > 5.0)
    return np.sum(steps, axis=0, dtype=np.uint8)


def quantize(w) -> tuple[np.ndarray, np.ndarray]:
    """``w [..., out, in]`` (float, ``in % 32 == 0``) -> ``(packed [..., out, in/2], scales [..., out, in/32])``.

    Host-side numpy (checkpoint writers, tests), exact for subnormal inputs. OCP MX rules: each 32-wide block
    along ``in`` shares the exponent ``floor(log2(amax)) - 2`` (so the block max lands in ``[4, 8)`` before
    saturation), clamped to the E8M0 range ``-127..127``; elements are rounded to the nearest E2M1 value with ties
    to even and saturate at +-6. Negative inputs keep the sign bit (``-0`` possible). An all-zero block gets
    scale code 0.
    """
    w = np.asarray(w).astype(np.float32)
    *lead, n_out, n_in = w.shape
    if n_in % BLOCK:
        raise ValueError(f"input dim must be a multiple of {BLOCK}, got {n_in}")
    blocks = w.reshape(*lead, n_out, n_in // BLOCK, BLOCK)
    amax = np.max(np.abs(blocks), axis=-1)
    _, exp = np.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1) -> floor(log2(amax)) = exp - 1
    shared = np.where(amax > 0, exp - 1 - E2M1_EMAX, -E8M0_BIAS)
    shared = np.clip(shared, -E8M0_BIAS, E8M0_BIAS)
    scaled = np.ldexp(blocks, -shared[..., None])  # exact: a power-of-two rescale with no overflow
    codes = _round_to_e2m1_code(np.abs(scaled)) | np.where(scaled < 0, np.uint8(8), np.uint8(0))
    codes = codes.reshape(*lead, n_out, n_in // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.astype(np.uint8), (shared + E8M0_BIAS).astype(np.uint8)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """``packed [..., out, in/2]`` uint8 -> E2M1 codes ``[..., out, in]`` uint8 (low nibble first)."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_codes(codes: jax.Array) -> jax.Array:
    """Inverse of :func:`unpack_codes`: E2M1 codes ``[..., out, in]`` -> ``packed [..., out, in/2]`` uint8."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)


def _dequantize_bits(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """float32 bit patterns of ``E2M1[codes] * 2**(scales - 127)``; ``codes [..., 32]``, ``scales [...]``.

    Built with integer ops so that subnormal results are exact even where the backend flushes denormals.
    A code magnitude is ``M / 2`` with ``M`` in {0, 1, 2, 3, 4, 6, 8, 12} = ``(1 + f) * 2**p``, so the value is
    ``(1 + f) * 2**(p + e - 128)``: biased float32 exponent ``p + e - 1``.
    """
    mag = (codes & 7).astype(jnp.int32)
    p = mag >> 1  # floor(log2 M) for mag 1..7
    f = jnp.where(mag >= 2, mag & 1, 0)  # mantissa bit; mag 1 (M = 1) has none
    exp = p + scales.astype(jnp.int32)[..., None] - 1
    normal = (exp << 23) | (f << 22)
    subnormal = (2 + f) << jnp.clip(exp + 21, 0, 31)  # exp >= -1 here, so the shift is >= 20
    bits = jnp.where(exp >= 255, 255 << 23, jnp.where(exp >= 1, normal, subnormal))
    bits = jnp.where(mag == 0, 0, bits) | ((codes.astype(jnp.int32) & 8) << 28)
    return bits.astype(jnp.uint32)


def dequantize(packed: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``packed [..., out, in/2]``, ``scales [..., out, in/32]`` -> weights ``[..., out, in]`` in ``dtype``.

    Exact in float32 and bfloat16 for every scale code 0..254 (results beyond the float32 range are inf, as the
    math says); other dtypes are the float32 value converted once.
    """
    packed, scales = jnp.asarray(packed), jnp.asarray(scales)
    *lead, n_out, n_half = packed.shape
    n_in = 2 * n_half
    if scales.shape != (*lead, n_out, n_in // BLOCK):
        raise ValueError(f"scales shape {scales.shape} does not match packed shape {packed.shape}")
    codes = unpack_codes(packed).reshape(*lead, n_out, n_in // BLOCK, BLOCK)
    bits = _dequantize_bits(codes, scales).reshape(*lead, n_out, n_in)
    if jnp.dtype(dtype) == jnp.bfloat16:  # every result has its low 16 mantissa bits zero
        return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def blocks_to_packed(blocks: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """gpt-oss ``(_blocks [..., out, in/32, 16], _scales [..., out, in/32])`` -> ``(packed [..., out, in/2], scales)``.

    Byte ``j`` of block ``b`` holds columns ``32b + 2j`` (low) and ``32b + 2j + 1`` (high), i.e. packed byte
    ``16b + j``: the conversion is a reshape.
    """
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {blocks.shape} / scales {scales.shape} are not a gpt-oss MXFP4 pair")
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1]), scales


def packed_to_blocks(packed: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Compressed-tensors ``(packed [..., out, in/2], scales [..., out, in/32])`` -> gpt-oss ``(_blocks, _scales)``."""
    if packed.shape[-1] != scales.shape[-1] * (BLOCK // 2) or packed.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"packed {packed.shape} / scales {scales.shape} are not an MXFP4 pair")
    return packed.reshape(*scales.shape, BLOCK // 2), scales


def to_pair_halves(packed: jax.Array) -> jax.Array:
    """Compressed-tensors ``packed [..., out, in/2]`` -> the same codes in the pair-halves byte order
    ``[..., out, in/2]`` (``in % 64 == 0``): for each pair of MX blocks ``(2p, 2p + 1)``, byte ``32p + j`` holds
    column ``64p + j`` of block 2p in its low nibble and column ``64p + 32 + j`` of block 2p + 1 in its high
    nibble. A kernel then decodes each block as one nibble of 32 consecutive bytes, with no interleave, and can
    apply the block's scale after its dot. The scales keep their layout."""
    *lead, n_out, n_half = packed.shape
    if (2 * n_half) % (2 * BLOCK):
        raise ValueError(f"the pair-halves order needs in % {2 * BLOCK} == 0, got in = {2 * n_half}")
    codes = unpack_codes(packed).reshape(*lead, n_out, n_half // BLOCK, 2, BLOCK)
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(packed.shape)


def from_pair_halves(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`to_pair_halves`: pair-halves bytes -> compressed-tensors ``packed [..., out, in/2]``."""
    *lead, n_out, n_half = packed.shape
    pairs = packed.reshape(*lead, n_out, n_half // BLOCK, 1, BLOCK)
    return pack_codes(jnp.concatenate([pairs & 0xF, pairs >> 4], axis=-2).reshape(*lead, n_out, 2 * n_half))


WORD_POSITIONS = (((6, 7, 8, 15), (22, 23, 24, 31), (3, 4, 5, 12), (19, 20, 21, 28)),
                  ((0, 1, 2, 13), (16, 17, 18, 29), (9, 10, 11, 14), (25, 26, 27, 30)))
"""The word order's bit map: ``WORD_POSITIONS[block][j]`` are the bits of a 32-bit word that hold E2M1 code bits
(mantissa, exponent 0, exponent 1, sign) of column ``c + j`` of a pair's first / second MX block, for the word of
columns ``c .. c + 3``. The first block's columns c, c + 1 sit where a bf16 pair wants them (magnitude at bits
8..6 and 24..22, sign at 15 and 31: one ``and`` decodes them as ``E2M1 * 2**-126``), c + 2, c + 3 three bits lower
(``shl`` + ``and``); the second block's magnitudes 6 bits lower / 3 bits higher, their signs 2 / 1 bits lower
(two shifts, two ``and`` and an ``or`` per pair)."""


def to_word_order(packed: jax.Array) -> jax.Array:
    """Compressed-tensors ``packed [..., out, in/2]`` -> the word order ``[..., out, in/2]`` (``in % 64 == 0``):
    per pair of MX blocks, 32 bytes read as 8 little-endian 32-bit words; word ``g`` holds columns ``4g .. 4g + 3``
    of both blocks at the bits of :data:`WORD_POSITIONS`, so that a kernel forms each bf16 pair of weights with
    1-5 register instructions. The scales keep their layout."""
    *lead, n_out, n_half = packed.shape
    if (2 * n_half) % (2 * BLOCK):
        raise ValueError(f"the word order needs in % {2 * BLOCK} == 0, got in = {2 * n_half}")
    codes = unpack_codes(packed).reshape(*lead, n_out, n_half // BLOCK, 2, BLOCK // 4, 4).astype(jnp.uint32)
    word = jnp.zeros(codes.shape[:-3] + (BLOCK // 4,), jnp.uint32)  # [..., pairs, 8 words]
    for block, columns in enumerate(WORD_POSITIONS):
        for j, positions in enumerate(columns):
            for bit, position in enumerate(positions):
                word = word | (((codes[..., block, :, j] >> bit) & 1) << position)
    data = jnp.stack([(word >> (8 * i)) & 0xFF for i in range(4)], axis=-1)
    return data.reshape(packed.shape).astype(jnp.uint8)


def word_order_codes(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Word-order bytes ``[..., 32 * n]`` (whole pairs of blocks) -> E2M1 codes ``(A, B)`` ``[..., 32 * n]``
    uint8: column ``j`` of each pair's first and second block."""
    b = words.reshape(*words.shape[:-1], -1, 4).astype(jnp.uint32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    codes = []
    for columns in WORD_POSITIONS:
        block = [sum(((word >> position) & 1) << bit for bit, position in enumerate(positions))
                 for positions in columns]
        codes.append(jnp.stack(block, axis=-1).reshape(words.shape).astype(jnp.uint8))
    return codes[0], codes[1]


def from_word_order(words: jax.Array) -> jax.Array:
    """Inverse of :func:`to_word_order`: word-order bytes -> compressed-tensors ``packed [..., out, in/2]``."""
    *lead, n_out, n_half = words.shape
    a, b = (c.reshape(*lead, n_out, n_half // BLOCK, 1, BLOCK) for c in word_order_codes(words))
    return pack_codes(jnp.concatenate([a, b], axis=-2).reshape(*lead, n_out, 2 * n_half))


FROM_BYTE_ORDER = {"pairs": from_pair_halves, "words": from_word_order}
"""Kernel byte order -> its converter back to the compressed-tensors order."""
