"""MXFP4 quantise / dequantise for the compressed-tensors and gpt-oss layouts (pallas_kernels.mxfp4.quant)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mxfp4 import quant as mxfp4

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _pack_codes(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _nearest_even_code(a: np.ndarray) -> np.ndarray:
    """Brute-force oracle: nearest grid index to |a|, ties to the even index, saturating at 6."""
    dist = np.abs(np.minimum(a, 6.0)[..., None] - GRID)
    best = dist.min(axis=-1, keepdims=True)
    ties = dist == best
    even_tie = ties & (np.arange(8) % 2 == 0)
    return np.where(ties.sum(-1) > 1, even_tie.argmax(-1), ties.argmax(-1)).astype(np.uint8)


def test_pack_hand_built_block():
    # one block, max 6 -> exponent floor(log2 6) - 2 = 0 -> scale code 127; values are the grid itself
    row = np.zeros(32, np.float32)
    row[:8] = [0.0, 0.5, -1.0, 1.5, 2.0, -3.0, 4.0, 6.0]
    packed, scales = mxfp4.quantize(row[None])
    assert scales.tolist() == [[127]]
    assert packed.dtype == np.uint8 and packed.shape == (1, 16)
    # codes 0,1,10,3,4,13,6,7: low nibble = even column
    assert packed[0, :4].tolist() == [0x10, 0x3A, 0xD4, 0x76]
    assert not packed[0, 4:].any()


def test_dequantize_all_codes_every_exponent():
    codes = np.tile(np.arange(16, dtype=np.uint8), 2)  # one 32-wide block holding all 16 codes twice
    exps = np.arange(255, dtype=np.uint8)
    packed = np.broadcast_to(_pack_codes(codes), (255, 16))
    got = np.asarray(mxfp4.dequantize(packed, exps[:, None]), np.float64)
    with np.errstate(over="ignore"):
        want = (mxfp4.E2M1_VALUES[codes].astype(np.float64)[None] * 2.0 ** (exps[:, None] - 127.0))
        want = want.astype(np.float32).astype(np.float64)  # inf where the value exceeds float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert got[0, 1] == 2.0 ** -128 and got[0, 7] == 6 * 2.0 ** -127  # subnormal, not flushed
    got_bf16 = np.asarray(mxfp4.dequantize(packed, exps[:, None], jnp.bfloat16).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got_bf16, want)


def test_round_trip_of_representable_values_is_exact():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(2, 3, 5, 64), dtype=np.uint8)
    codes[..., 0] = 7  # every block holds a +-6 so quantize picks back the same scale
    codes[..., 32] = 15
    scales = rng.integers(1, 250, size=(2, 3, 5, 2), dtype=np.uint8)
    packed = _pack_codes(codes)
    w = np.asarray(mxfp4.dequantize(packed, scales))
    packed2, scales2 = mxfp4.quantize(w)
    np.testing.assert_array_equal(scales2, scales)
    # -0 and +0 dequantise to zero; quantize maps an exact zero to +0, so compare values then bytes off zeros
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize(packed2, scales2)), w)
    codes[codes == 8] = 0
    np.testing.assert_array_equal(packed2, _pack_codes(codes))


def test_quantize_matches_rne_oracle_and_error_bound():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((7, 96)) * np.exp(rng.uniform(-8, 8, size=(7, 1)))).astype(np.float32)
    w[0, :32] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4  # exact ties, max 7 -> scale 2**0
    packed, scales = mxfp4.quantize(w)
    shared = scales.astype(np.float64) - 127
    scaled = w.reshape(7, 3, 32) / 2.0 ** shared[..., None]
    want = _nearest_even_code(np.abs(scaled)) | np.where(scaled < 0, 8, 0).astype(np.uint8)
    np.testing.assert_array_equal(packed, _pack_codes(want.reshape(7, 96)))
    assert np.asarray(mxfp4.dequantize(packed, scales))[0, :8].tolist() == [0, 1, 1, 2, 2, 4, 4, 6]
    # block max lands in [4, 8) on the element scale
    assert np.all((np.abs(scaled).max(-1) >= 4) & (np.abs(scaled).max(-1) < 8))
    # error bound: half a grid step (0.25 / 0.5 / 1 scaled) inside the range, clipping above 6
    a = np.abs(scaled)
    bound = np.where(a < 2, 0.25, np.where(a < 4, 0.5, np.where(a <= 6, 1.0, a - 6))) * 2.0 ** shared[..., None]
    err = np.abs(np.asarray(mxfp4.dequantize(packed, scales), np.float64) - w).reshape(7, 3, 32)
    assert np.all(err <= bound)


def test_quantize_extreme_exponents():
    w = np.zeros((4, 32), np.float32)
    w[0, 0] = 3.0e38          # floor(log2) = 127 -> exponent 125
    w[1, 0] = 2.0 ** -127     # subnormal input: clamps at scale 2**-127, element 1.0
    w[1, 1] = -(2.0 ** -128)
    w[2, 0] = 1e-45           # smallest subnormal: rounds to zero under the smallest scale
    packed, scales = mxfp4.quantize(w)
    assert scales[:, 0].tolist() == [252, 0, 0, 0]
    assert packed[1, 0] == 0x92 and packed[2, 0] == 0 and not packed[3].any()
    back = np.asarray(mxfp4.dequantize(packed, scales))
    assert back[0, 0] == 1.5 * 2.0 ** 127 and back[1, 0] == 2.0 ** -127 and back[1, 1] == -(2.0 ** -128)


def test_gpt_oss_blocks_layout_round_trip():
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, size=(3, 4, 64), dtype=np.uint8)
    scales = rng.integers(100, 140, size=(3, 4, 2), dtype=np.uint8)
    packed = _pack_codes(codes)
    blocks, scales_b = mxfp4.packed_to_blocks(packed, scales)
    assert blocks.shape == (3, 4, 2, 16)
    # gpt-oss reference decode (convert_moe_packed_tensors): lut[lo] -> even, lut[hi] -> odd element of a block
    lut = mxfp4.E2M1_VALUES
    dec = np.stack([lut[blocks & 0xF], lut[blocks >> 4]], -1).reshape(3, 4, 2, 32)
    dec = np.ldexp(dec, scales_b.astype(np.int32)[..., None] - 127).reshape(3, 4, 64)
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize(packed, scales)), dec)
    packed2, scales2 = mxfp4.blocks_to_packed(blocks, scales_b)
    np.testing.assert_array_equal(packed2, packed)
    np.testing.assert_array_equal(scales2, scales)


def test_shape_errors():
    with pytest.raises(ValueError):
        mxfp4.quantize(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError):
        mxfp4.dequantize(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
