"""Grouped W4A16 / bf16 GEMM as a Triton-style Pallas kernel over rows sorted by expert.

Grid ``(T, N / block_n, split_k)``: program ``(t, j, s)`` computes rows ``[first_row_t, end_row_t)`` (at most
``block_m``) of expert ``e_t`` for output columns ``[j * block_n, (j + 1) * block_n)`` over part s of K; the tile
schedule comes from :mod:`pallas_kernels.mxfp4.tiles` and is read inside the kernel (Triton has no scalar
prefetch). The K loop streams ``block_k`` columns of the weights per step; MXFP4 tiles are decoded to bf16 in registers (:mod:`pallas_kernels.mxfp4.decode`):

* E2M1 magnitude ``c`` (3 bits) -> bf16 bits ``0x3F00 + (c << 6)`` is exact for ``c >= 2`` (exponent ``e + 126``,
  mantissa bit ``m``); codes 0 and 1 (0 and 0.5) are selected as ``c * 0x3F00``; the sign goes to bit 15.
  No subnormal appears, so the decode is exact whatever the backend's denormal mode.
* the E8M0 scale ``2**(s - 127)`` is the bf16 with exponent field ``s`` and multiplies the decoded tile; the
  product is exact (IEEE, results outside bf16's normal range follow denormal / overflow rules).

``weight_format="mxfp4_pairs"`` reads the pair-halves byte order (:func:`pallas_kernels.mxfp4.quant.to_pair_halves`):
per 64 columns, 32 bytes whose low nibbles are one MX block and high nibbles the next. Each block is then
decoded from one nibble of a ``[block_n, 32]`` byte tile (no interleave of low and high nibbles, no ``[bn, bk]``
broadcast of the scales), scaled by its block's E8M0 scale in the decode, and multiplied by ``x``'s 32 matching
columns in its own K=32 dot accumulating in place.

On the GPU the pair-halves decode is inline PTX: per 4 bytes, two ``prmt`` place bytes
in the low halves of two bf16 pairs, then per nibble half two ``and`` + two ``shl`` + ``or`` put the 3 magnitude
bits at bf16 bits 8..6 and the sign at bit 15, which reads as ``E2M1 * 2**-126`` for every code (code 1 as a
bf16 subnormal); one ``mul.rn.bf16x2`` by ``2**126`` makes it exact and a second by the block's scale (an input of
the asm, a bf16 pair per register) scales it: about 3.5 instructions per weight against about 13 for the jnp
decode (``weight_format="mxfp4_pairs_jnp"``, and the interpret-mode path). Scaling the weights rather than each
block's fp32 ``[block_n, block_m]`` product drops a multiply and an add per product element (two per pair of
weights at 16-row tiles, by SASS count).

``weight_format="mxfp4_words"`` reads the word order (:func:`pallas_kernels.mxfp4.quant.to_word_order`): the same
``[block_n, 32]`` byte tile per pair of blocks, but each 4-byte word holds 4 columns of both blocks at bits chosen so
that 1-5 shifts and masks per bf16 pair place sign and magnitude (:func:`_word_ptx`: 17 PTX instructions per 8
weights with narrow scales, against 29 for a Marlin-style nibble order), and the scales come as uint32
words of 4 blocks, each block's bf16 scale pair formed once per column (:func:`_scale_pair`); ``narrow_scales``
folds the decode's bias into the scale. It needs x as the MMA's A operand.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tuning
from pallas_kernels.impl import interpret_mode
from pallas_kernels.mxfp4 import quant as mxfp4
from pallas_kernels.mxfp4.config import GroupedGemmConfig
from pallas_kernels.mxfp4.decode import e2m1_to_bf16, e8m0_to_bf16
from pallas_kernels.mxfp4.tiles import make_tile_schedule

MX_BLOCK = 32
PAIRS_FORMATS = ("mxfp4_pairs", "mxfp4_pairs_jnp", "mxfp4_words")
"""Formats decoded per pair of MX blocks: the pair-halves order with the inline-PTX decode on the GPU (jnp in
interpret mode) or the jnp decode everywhere, and the word order (inline PTX on the GPU, jnp in interpret mode)."""
WORD_SCALES = 4
"""``"mxfp4_words"`` reads the E8M0 scales as uint32 words of 4 consecutive blocks (a bitcast of the uint8 array)."""
SHARED_EXPERT = -1
"""Row expert id (per-row mode) of the shared expert, whose matrices are passed separately (``shared``)."""


def _nibble_ptx(mask: int, magnitude_shift: int, sign_shift: int) -> str:
    """PTX for one nibble half of 4 packed bytes ($2) and their block's scale as two bf16 pairs ($3, $4) -> two
    bf16 pairs ($0: bytes 0-1, $1: bytes 2-3) of scaled weights."""
    magnitude, sign = f"0x{(mask & 0x77) * 0x10001:08X}", f"0x{(mask & 0x88) * 0x10001:08X}"
    halves = []
    for out, selector in ((0, "0x4140"), (1, "0x4342")):
        halves.append(f"prmt.b32 p, $2, z, {selector}; and.b32 v, p, {magnitude}; shl.b32 v, v, {magnitude_shift}; "
                      f"and.b32 s, p, {sign}; shl.b32 s, s, {sign_shift}; or.b32 v, v, s; mul.rn.bf16x2 v, v, c; "
                      f"mul.rn.bf16x2 ${out}, v, ${3 + out};")
    return "{ .reg .b32 p, v, s, c, z; mov.b32 c, 0x7E807E80; mov.b32 z, 0; " + " ".join(halves) + " }"


_LOW_NIBBLES_PTX = _nibble_ptx(0x0F, 6, 12)  # magnitude bits 2..0 -> 8..6, sign bit 3 -> 15
_HIGH_NIBBLES_PTX = _nibble_ptx(0xF0, 2, 8)  # magnitude bits 6..4 -> 8..6, sign bit 7 -> 15
# (one asm per half: jax 0.11.2's Triton lowering of elementwise_inline_asm returns a single result)


def _word_ptx(block: int, narrow_scales: bool) -> str:
    """PTX for one block of a word-order word ($2; :data:`pallas_kernels.mxfp4.quant.WORD_POSITIONS`) and its scale as a
    bf16 pair ($3, :func:`_scale_pair`) -> two bf16 pairs ($0: columns c, c + 1; $1: c + 2, c + 3) of scaled
    weights. Shifts and masks place each weight's 3 magnitude bits at bf16 bits 8..6 and its sign at 15, which reads
    as ``E2M1 * 2**-126`` (code 1 a bf16 subnormal): 1 / 2 instructions per pair of the first block, 5 of the second.
    Then one ``mul.rn.bf16x2`` by the scale, whose exponent carries the 2**126 when ``narrow_scales``; otherwise a
    multiply by 2**126 first. Exact either way: 17 instructions per 8 weights with narrow scales.

    Unlike the pair-halves decode this is not a per-byte map: it needs Triton to hand the asm 4 bytes that are one
    aligned word in memory. With x as the MMA's A operand the decoded tile is the B operand, which Triton loads
    4 consecutive K bytes per thread (and permutes K in both operands alike); with the weights as A (wgmma's
    register operand) the 4 bytes are K pairs 8 apart, and the result is wrong (H200); as mma.sync's
    A operand (1-2 warps) it is right but no faster. So the word order runs with
    ``weights_lhs=False`` only, and the GPU tests check it at the tilings ``tile_config`` picks."""
    if block == 0:
        pairs = ["and.b32 t, $2, 0x81C081C0;", "shl.b32 t, $2, 3; and.b32 t, t, 0x81C081C0;"]
    else:
        pairs = [f"{shift} m, $2, {n}; and.b32 m, m, 0x01C001C0; shl.b32 t, $2, {sign}; and.b32 t, t, 0x80008000; "
                 "or.b32 t, t, m;" for shift, n, sign in (("shl.b32", 6, 2), ("shr.b32", 3, 1))]
    lines = [p + (f" mul.rn.bf16x2 ${out}, t, $3;" if narrow_scales else
                  f" mul.rn.bf16x2 t, t, k; mul.rn.bf16x2 ${out}, t, $3;") for out, p in enumerate(pairs)]
    return "{ .reg .b32 t, m, k; mov.b32 k, 0x7E807E80; " + " ".join(lines) + " }"


def _scale_code(word: jax.Array, byte: int) -> jax.Array:
    """E8M0 code ``byte`` (0-3) of uint32 scale words."""
    return (word >> (8 * byte)) & 0xFF


def _scale_pair(word: jax.Array, byte: int, narrow_scales: bool) -> jax.Array:
    """uint32 scale words ``[bn]`` (4 E8M0 codes) -> uint32 ``[bn]``: code ``byte`` as a bf16 pair (both halves),
    ``2**(s - 1)`` with ``narrow_scales`` (every code <= 128; the decode's 2**126 folded in), else ``2**(s - 127)``
    (code 0: the subnormal 2**-127)."""
    code = _scale_code(word, byte)
    half = ((code + 126) << 7) if narrow_scales else jnp.maximum(code << 7, jnp.uint32(0x40))
    return half | (half << 16)


def _decode_words(packed: jax.Array, word: jax.Array, first_byte: int, how: str,
                  narrow_scales: bool) -> tuple[jax.Array, jax.Array]:
    """Word-order bytes ``[bn, 32]`` uint8 of one pair of MX blocks and their scales' word ``[bn]`` uint32
    (scale ``first_byte`` is the pair's first block's, the next byte its second's) -> (scaled bf16 weights of
    the first block, of the second), each ``[bn, 32]``. Exact."""
    if how == "asm":
        shape = jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)
        return tuple(pltriton.elementwise_inline_asm(
            _word_ptx(half, narrow_scales),
            args=[packed, jnp.broadcast_to(_scale_pair(word, first_byte + half, narrow_scales)[:, None], packed.shape)],
            constraints="=r,=r,r,r,r,r,r", pack=4, result_shape_dtypes=[shape])[0]
            for half in range(2))
    codes = mxfp4.word_order_codes(packed)
    scales = (_scale_code(word, first_byte + half).astype(jnp.uint8) for half in range(2))
    return tuple(e2m1_to_bf16(c.astype(jnp.uint16)) * e8m0_to_bf16(sc)[:, None] for c, sc in zip(codes, scales))


def _decode_nibbles(packed: jax.Array, scales: tuple[jax.Array, jax.Array], how: str) -> tuple[jax.Array, jax.Array]:
    """uint8 bytes ``[bn, c]`` and the bf16 scales ``[bn]`` of the low and the high nibbles' blocks -> (scaled bf16
    weights of the low nibbles, of the high nibbles), each ``[bn, c]``. Exact: the E2M1 values times a power of
    two (IEEE rounding only where the product leaves bf16's normal range)."""
    if how == "asm":
        shape = jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)
        return tuple(pltriton.elementwise_inline_asm(
            ptx, args=[packed, jnp.broadcast_to(scale[:, None], packed.shape)], constraints="=r,=r,r,r,r", pack=4,
            result_shape_dtypes=[shape])[0] for ptx, scale in zip((_LOW_NIBBLES_PTX, _HIGH_NIBBLES_PTX), scales))
    p = packed.astype(jnp.uint16)
    return tuple(e2m1_to_bf16(codes) * scale[:, None] for codes, scale in zip((p & 0xF, p >> 4), scales))


def _decode_mxfp4_tile(packed: jax.Array, scales: jax.Array) -> jax.Array:
    """``packed [bn, bk/2]`` uint8, ``scales [bn, bk/32]`` uint8 -> bf16 weights ``[bn, bk]``."""
    bn, half = packed.shape
    p = packed.astype(jnp.uint16)
    codes = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(bn, 2 * half)  # low nibble = even column
    s = jnp.broadcast_to(e8m0_to_bf16(scales)[:, :, None], (bn, scales.shape[1], MX_BLOCK))
    return e2m1_to_bf16(codes) * s.reshape(bn, 2 * half)


def _grouped_kernel(sched_ref, offset_ref, x_ref, *refs, num_experts, block_m, block_n, block_k, weight_format,
                    weights_lhs, split_k, part_tiles, x_repeat, pairs_decode, shared, narrow_scales):
    *w_refs, o_ref = refs
    shared_refs = w_refs[len(w_refs) // 2:] if shared else ()  # the shared expert's matrices, after the routed
    w_refs = w_refs[:len(w_refs) // 2] if shared else w_refs
    per_part = len(w_refs) // len(part_tiles)  # arrays per weight matrix: 1 (bf16) or 2 (packed + scales)
    t, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if x_repeat:  # per row: sched_ref is row_experts [M]; tile t is output row t, from x row t // x_repeat
        group, first_row, end_row = sched_ref[t], t, t + 1
        x_rows = pl.ds(t // x_repeat, block_m)
        x_mask = jnp.arange(block_m) < 1
    else:
        group, first_row, end_row = sched_ref[0, t], sched_ref[1, t], sched_ref[2, t]
    rows = pl.ds(first_row, block_m)
    # split_k > 1: fp32 partial sums [M, split_k * N], part ``split`` in columns [split * N, (split + 1) * N)
    out_cols = pl.ds(pl.multiple_of((split * (o_ref.shape[1] // split_k)) + j * block_n, block_n), block_n)
    row_mask = (first_row + jnp.arange(block_m)) < end_row
    if not x_repeat:
        x_rows, x_mask = rows, row_mask
    num_k = x_ref.shape[1] // block_k // split_k  # K steps of this program, from ``split * num_k``

    def weight_tile(part_refs, expert, cols, k):  # bf16 [block_n, block_k] of weight row ``expert``
        k_cols = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        if weight_format == "bf16":
            return part_refs[0][expert, k_cols, cols].T
        if weight_format == "bf16_nk":
            return part_refs[0][expert, cols, k_cols]
        packed_ref, scales_ref = part_refs
        packed = packed_ref[expert, cols, pl.ds(pl.multiple_of(k * (block_k // 2), block_k // 2), block_k // 2)]
        scales = scales_ref[expert, cols,
                            pl.ds(pl.multiple_of(k * (block_k // MX_BLOCK), block_k // MX_BLOCK),
                                  block_k // MX_BLOCK)]
        return _decode_mxfp4_tile(packed, scales)

    def tile_product(part_refs, first_tile, expert):
        """This program's output tile from one weight matrix (its row ``expert``), whose column tiles start at
        ``first_tile``."""
        cols = pl.ds(pl.multiple_of((j - first_tile) * block_n, block_n), block_n)

        def pair_products(k, acc):
            """"mxfp4_pairs": per 64 K columns, one ``[block_n, 32]`` byte tile decoded into the scaled weights of
            two MX blocks (low and high nibbles), each multiplied by ``x``'s 32 matching columns in its own K=32
            dot accumulating in place."""
            packed_ref, scales_ref = part_refs
            for pair in range(block_k // (2 * MX_BLOCK)):  # static
                first_byte = pl.multiple_of(k * (block_k // 2) + pair * MX_BLOCK, MX_BLOCK)
                packed = packed_ref[expert, cols, pl.ds(first_byte, MX_BLOCK)]  # [bn, 32] uint8
                first_block = k * (block_k // MX_BLOCK) + 2 * pair
                if weight_format == "mxfp4_words":  # the scales of 2 pairs in one uint32 per column
                    if pair % 2 == 0:  # loaded once for this pair and the next
                        word = scales_ref[expert, cols, k * (block_k // (WORD_SCALES * MX_BLOCK)) + pair // 2]
                    weights = _decode_words(packed, word, 2 * (pair % 2), pairs_decode, narrow_scales)
                else:
                    scales = tuple(e8m0_to_bf16(scales_ref[expert, cols, first_block + half]) for half in range(2))
                    weights = _decode_nibbles(packed, scales, pairs_decode)
                for half, w in enumerate(weights):
                    block = first_block + half
                    x = pltriton.load(x_ref.at[x_rows, pl.ds(pl.multiple_of(block * MX_BLOCK, MX_BLOCK), MX_BLOCK)],
                                      mask=x_mask[:, None], other=0.0)
                    acc = acc + _weight_product(w, x, weights_lhs)
            return acc

        def body(k, acc):
            if weight_format in PAIRS_FORMATS:
                return pair_products(k, acc)
            x = pltriton.load(x_ref.at[x_rows, pl.ds(pl.multiple_of(k * block_k, block_k), block_k)],
                              mask=x_mask[:, None], other=0.0)
            return acc + _weight_product(weight_tile(part_refs, expert, cols, k), x, weights_lhs)

        acc_shape = (block_n, block_m) if weights_lhs else (block_m, block_n)
        acc = jax.lax.fori_loop(split * num_k, (split + 1) * num_k, body, jnp.zeros(acc_shape, jnp.float32))
        acc = acc.T if weights_lhs else acc
        pltriton.store(o_ref.at[rows, out_cols], acc.astype(o_ref.dtype), mask=row_mask[:, None])

    first_tile = 0
    for part, tiles in enumerate(part_tiles):  # static: one code path per weight matrix
        part_refs = w_refs[part * per_part:(part + 1) * per_part]
        in_part = (j >= first_tile) & (j < first_tile + tiles)
        pl.when((group >= 0) & (group < num_experts) & in_part)(
            functools.partial(tile_product, part_refs, first_tile, group + offset_ref[0]))
        if shared:  # rows naming SHARED_EXPERT use the shared expert's matrices, at row offset_ref[1]
            pl.when((group == SHARED_EXPERT) & in_part)(functools.partial(
                tile_product, shared_refs[part * per_part:(part + 1) * per_part], first_tile, offset_ref[1]))
        first_tile += tiles

    @pl.when(group == num_experts)  # rows past sum(group_sizes)
    def _():
        pltriton.store(o_ref.at[rows, out_cols], jnp.zeros((block_m, block_n), o_ref.dtype), mask=row_mask[:, None])


def _weight_product(w, x, weights_lhs):
    """fp32 ``w @ x.T`` ``[block_n, block_m]`` (``weights_lhs``: the decoded tile feeds the MMA's register operand)
    or ``x @ w.T`` ``[block_m, block_n]``, for a weight tile ``w [block_n, k]`` and activations ``x [block_m, k]``.
    ``w`` takes ``x``'s dtype: exact for decoded MXFP4 (and for bf16 weights), and the Triton dot needs both
    operands of one type (fp32 activations then take JAX's default matmul precision)."""
    w = w.astype(x.dtype)
    if weights_lhs:
        return jnp.dot(w, x.T, preferred_element_type=jnp.float32)
    return jnp.dot(x, w.T, preferred_element_type=jnp.float32)


def _scale_words(scales: jax.Array) -> jax.Array:
    """uint8 E8M0 scales ``[..., K/32]`` -> uint32 ``[..., K/128]``, block ``4w + b`` in byte ``b`` of word ``w``."""
    return jax.lax.bitcast_convert_type(scales.reshape(*scales.shape[:-1], -1, WORD_SCALES), jnp.uint32)


def scales_are_narrow(*scales: jax.Array) -> bool:
    """Whether every E8M0 code is at most 128 (block scales up to 2, block values up to 12: trained weights), so
    the ``"mxfp4_words"`` decode may fold its bias into the scale (``narrow_scales``). One host sync."""
    return all(int(jnp.max(s)) <= 128 for s in scales)  # a scalar per array: no stack-sized temporary


def _output_width(weights: tuple[jax.Array, ...], weight_format: str) -> int:
    if weight_format == "bf16":
        return weights[0].shape[2]
    if weight_format in ("bf16_nk", "mxfp4", *PAIRS_FORMATS):
        return weights[0].shape[1]
    raise ValueError(f"unknown weight_format {weight_format!r}")


MIN_BLOCK_K = {"mxfp4": MX_BLOCK, "mxfp4_pairs": 2 * MX_BLOCK, "mxfp4_pairs_jnp": 2 * MX_BLOCK,
               "mxfp4_words": WORD_SCALES * MX_BLOCK}
"""The smallest ``block_k`` per weight format (whole MX blocks, pairs of them, scale words); bf16: 16."""


def smem_bytes(cfg: GroupedGemmConfig, weight_format: str, x_dtype, w_dtype) -> int:
    """Shared memory of the grouped GEMM (:mod:`pallas_kernels.tuning`'s estimate): per K step the ``[block_m,
    block_k]`` rows of x and the weight tile (``[block_k, block_n]`` bf16, or ``block_n`` rows of ``block_k / 2``
    packed bytes and ``block_k / 32`` scale bytes), ``num_stages`` deep; the weights decoded (or cast) in registers
    to x's dtype, ``[block_n, block_k]``, staged into the dot."""
    if weight_format.startswith("bf16"):
        weights = tuning.nbytes(w_dtype, cfg.block_k, cfg.block_n)
        staged = 0 if jnp.dtype(w_dtype) == jnp.dtype(x_dtype) else tuning.nbytes(x_dtype, cfg.block_n, cfg.block_k)
    else:
        weights = cfg.block_n * (cfg.block_k // 2 + cfg.block_k // MX_BLOCK)
        staged = tuning.nbytes(x_dtype, cfg.block_n, cfg.block_k)
    return cfg.num_stages * (tuning.nbytes(x_dtype, cfg.block_m, cfg.block_k) + weights) + staged


def fit_config(config: GroupedGemmConfig | None, weight_format: str, x_dtype, w_dtype) -> GroupedGemmConfig:
    """The resolved config shrunk to the device's shared memory: fewer stages, then smaller ``block_k`` (down to
    the format's :data:`MIN_BLOCK_K`), ``block_n`` and ``block_m`` (down to 16)."""
    cfg = tuning.resolve(GroupedGemmConfig, config)
    blocks = [("block_k", MIN_BLOCK_K.get(weight_format, 16)), ("block_n", 16), ("block_m", 16)]
    return tuning.fit(f"grouped_gemm_{weight_format}", cfg, lambda c: smem_bytes(c, weight_format, x_dtype, w_dtype),
                      tuning.smaller(cfg, "num_stages", blocks), what=f"{jnp.dtype(x_dtype).name} x")


@functools.partial(jax.jit, static_argnames=("weight_format", "config", "narrow_scales"))
def grouped_gemm_pallas(x: jax.Array, weights: tuple[jax.Array, ...], group_sizes: jax.Array,
                        expert_offset: jax.Array | int = 0, *, weight_format: str,
                        config: GroupedGemmConfig | None = None, narrow_scales: bool = False) -> jax.Array:
    """``x [M, K]`` bf16 rows sorted by expert; ``weights`` is ``(w [E', K, N],)`` for ``"bf16"``,
    ``(w [E', N, K],)`` for ``"bf16_nk"`` or ``(packed [E', N, K/2], scales [E', N, K/32])`` for ``"mxfp4"``
    (``"mxfp4_pairs"`` / ``"mxfp4_pairs_jnp"``: ``packed`` in the pair-halves byte order, ``block_k`` a multiple
    of 64; the two differ only in the decode's code; ``"mxfp4_words"``: ``packed`` in the word order of
    :func:`pallas_kernels.mxfp4.quant.to_word_order`, ``block_k`` a multiple of 128);
    group ``e`` of ``group_sizes [E]`` uses weight row ``expert_offset + e`` (an int32 scalar, traced: so the
    experts of every layer can be passed as one ``[L*E, ...]`` bitcast of the stacked parameter, since a slice
    ``w[layer]`` handed to a custom call is copied by XLA, 1.2 GB per call at Kimi-Linear shapes, and every
    layer shares one compiled kernel; the caller keeps ``expert_offset + E <= E'``) -> ``[M, N]`` in
    ``x.dtype`` (fp32 accumulation;
    rows at or past ``sum(group_sizes)`` are zero; ``sum(group_sizes) <= M``). ``config``: the tiling
    (:class:`~pallas_kernels.mxfp4.config.GroupedGemmConfig`; tile sizes are powers of two dividing ``K`` / ``N``;
    ``weights_lhs`` computes ``W @ x.T`` per tile, the small-M orientation; ``split_k``, dividing ``K /
    block_k``, cuts every tile's K loop across that many programs, which write fp32 partial sums that are then
    added: at decode a few experts' tiles alone cannot fill the GPU), shrunk to the device's shared memory
    (:func:`fit_config`). ``narrow_scales``
    (``"mxfp4_words"``): the caller vouches that every scale code is at most 128 (:func:`scales_are_narrow`,
    checked once at load); the decode then folds its 2**126 bias into the scale (one multiply per weight pair
    fewer). Outside that range the results would be wrong, not just inexact."""
    return grouped_gemm_concat_pallas(x, (weights,), group_sizes, expert_offset, weight_format=weight_format,
                                      config=config, narrow_scales=narrow_scales)


@functools.partial(jax.jit, static_argnames=("weight_format", "config", "per_row", "sum_splits", "narrow_scales"))
def grouped_gemm_concat_pallas(x: jax.Array, matrices: tuple[tuple[jax.Array, ...], ...], group_sizes: jax.Array,
                               expert_offset: jax.Array | int = 0, *, weight_format: str,
                               config: GroupedGemmConfig | None = None, per_row: bool = False,
                               sum_splits: bool = True, shared: tuple[tuple[jax.Array, ...], ...] = (),
                               shared_offset: jax.Array | int = 0, narrow_scales: bool = False) -> jax.Array:
    """:func:`grouped_gemm_pallas` against several weight matrices at once (each a ``weights`` tuple of the same
    format, leading size and K, widths ``N_i`` multiples of ``block_n``): ``[M, sum N_i]``, the products side by
    side in order. One launch instead of one per matrix, e.g. the q / k / v projections of a decode step.

    ``per_row``: ``group_sizes`` is instead ``row_experts [M]`` int32, the expert of each output row (rows in any
    order; ids in ``[0, E')`` after the offset), and every row is its own tile: ``x[m // r] @ W[row_experts[m]]``
    with ``r = M / x.shape[0]`` (x's rows each used by r consecutive output rows, as ``jnp.repeat(x, r, 0)``
    would give, without materialising it: the (token, choice) pairs of a decode step). For a few decode rows
    this needs no sort, gather or scatter around the call; an expert shared by several rows is read once per
    row.

    ``sum_splits=False``: ``[M, split_k, sum N_i]`` instead, the split-K partial products unsummed (float32;
    ``x.dtype`` when ``split_k == 1``), for a consumer that adds them itself (the residual add + RMSNorm).

    ``shared`` (per-row only): the shared expert's matrices, one per entry of ``matrices`` with the same format
    and width (leading size: layers); rows whose expert is ``SHARED_EXPERT`` use their row ``shared_offset``.
    The shared expert then runs as one more row of the routed launch instead of launches of its own."""
    dim_k = x.shape[1]
    if shared and (not per_row or len(shared) != len(matrices)
                   or [_output_width(w, weight_format) for w in shared]
                   != [_output_width(w, weight_format) for w in matrices]):
        raise ValueError("shared needs per_row and one matrix of the same width per routed matrix")
    num_rows = group_sizes.shape[0] if per_row else x.shape[0]
    if per_row and num_rows % x.shape[0]:
        raise ValueError(f"row_experts has {num_rows} rows, not a multiple of x's {x.shape[0]}")
    num_experts = matrices[0][0].shape[0] if per_row else group_sizes.shape[0]
    widths = [_output_width(w, weight_format) for w in matrices]
    dim_n = sum(widths)
    cfg = fit_config(config, weight_format, x.dtype, matrices[0][0].dtype)
    block_m, block_n, block_k, split_k, weights_lhs = cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, \
        cfg.weights_lhs
    if any(n % block_n for n in widths) or dim_k % block_k:
        raise ValueError(f"K={dim_k} / N={widths} must be multiples of block_k={block_k} / block_n={block_n}")
    if block_k % (2 * MX_BLOCK if weight_format in PAIRS_FORMATS else MX_BLOCK if weight_format == "mxfp4" else 1):
        raise ValueError(f"block_k={block_k} must hold whole MX blocks (pairs of them for {weight_format!r})")
    words = weight_format == "mxfp4_words"
    if words and block_k % (WORD_SCALES * MX_BLOCK):
        raise ValueError(f"block_k={block_k} must be a multiple of {WORD_SCALES * MX_BLOCK} for 'mxfp4_words'")
    if words and weights_lhs:  # the word decode needs 4 memory-consecutive bytes per thread (see _word_ptx)
        raise ValueError("weight_format='mxfp4_words' needs weights_lhs=False (x as the MMA's A operand)")
    if narrow_scales and not words:
        raise ValueError("narrow_scales applies to weight_format='mxfp4_words' only")
    if words:  # scales [E', N, K/32] uint8 -> [E', N, K/128] uint32 words (a bitcast, no copy)
        matrices, shared = (tuple((p, _scale_words(sc)) for p, sc in group) for group in (matrices, shared))
    if split_k < 1 or (dim_k // block_k) % split_k:
        raise ValueError(f"split_k={split_k} must divide K / block_k = {dim_k // block_k}")
    schedule = group_sizes.astype(jnp.int32) if per_row else make_tile_schedule(group_sizes, num_rows, block_m)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731 - full-array ref
    offset = jnp.stack([jnp.asarray(expert_offset, jnp.int32), jnp.asarray(shared_offset, jnp.int32)])
    flat = [a for w in (*matrices, *shared) for a in w]
    kernel = functools.partial(_grouped_kernel, num_experts=num_experts, block_m=block_m, block_n=block_n,
                               block_k=block_k, weight_format=weight_format, weights_lhs=weights_lhs,
                               split_k=split_k, part_tiles=tuple(n // block_n for n in widths),
                               x_repeat=num_rows // x.shape[0] if per_row else 0,
                               pairs_decode="asm" if weight_format in ("mxfp4_pairs", "mxfp4_words")
                               and not interpret_mode() else "jnp", shared=bool(shared), narrow_scales=narrow_scales)
    out = jax.ShapeDtypeStruct((num_rows, dim_n), x.dtype) if split_k == 1 else jax.ShapeDtypeStruct(
        (num_rows, split_k * dim_n), jnp.float32)
    result = pl.pallas_call(
        kernel,
        out_shape=out,
        grid=(schedule.shape[-1], dim_n // block_n, split_k),
        in_specs=[whole(schedule), whole(offset), whole(x), *(whole(a) for a in flat)],
        out_specs=whole(out),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret_mode(),
        name=f"grouped_gemm_{weight_format}",
    )(schedule, offset, x, *flat)
    if not sum_splits:
        return result.reshape(num_rows, split_k, dim_n)
    if split_k == 1:
        return result
    return jnp.sum(result.reshape(num_rows, split_k, dim_n), axis=1).astype(x.dtype)
