"""MXFP4 W4A16 and bf16 grouped GEMM kernels (Pallas interpret mode on CPU) vs the float32 references.

Tolerance: per-row max error <= 1e-2 of the row's largest reference magnitude. The kernel decodes the weights
exactly to bf16 and accumulates products of bf16 values in fp32, the reference does the same products in fp32;
both round the output once to bf16 (2**-8 relative), which bounds the difference. A wrong nibble, scale or row
assignment is an O(1) error.
"""

from __future__ import annotations

import functools
import itertools
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mxfp4 import (
    SHARED_EXPERT,
    GroupedGemmConfig,
    grouped_matmul,
    grouped_matmul_concat,
    grouped_matmul_reference,
    mxfp4_grouped_matmul,
    mxfp4_grouped_matmul_concat,
    mxfp4_grouped_matmul_reference,
    mxfp4_matmul,
    mxfp4_matmul_reference,
)
from pallas_kernels.mxfp4.decode import e2m1_to_bf16, e8m0_to_bf16
from pallas_kernels.mxfp4.kernel import (
    grouped_gemm_concat_pallas,
    grouped_gemm_pallas,
    scales_are_narrow,
)
from pallas_kernels.mxfp4.quant import (
    E2M1_VALUES,
    WORD_POSITIONS,
    dequantize,
    from_pair_halves,
    from_word_order,
    to_pair_halves,
    to_word_order,
    unpack_codes,
    word_order_codes,
)
from pallas_kernels.mxfp4.tiles import make_tile_schedule, max_num_tiles

TOL = 1e-2
SMALL_TILES = dict(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1)


def tiles(**fields):
    """The kernels' ``config=`` keyword for SMALL_TILES with ``fields`` changed."""
    return dict(config=GroupedGemmConfig(**{**SMALL_TILES, **fields}))


def assert_rows_close(actual, expected, tol=TOL):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max(1) / np.maximum(np.abs(expected).max(1), 1e-30)
    assert np.all(err <= tol), f"per-row relative error up to {err.max():.3e} > {tol:.1e}"


def random_problem(seed, group_sizes, num_rows, n=16, k=64, scale_range=(120, 134)):
    rng = np.random.default_rng(seed)
    e = len(group_sizes)
    packed = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], -1)
    assert len(np.unique(codes)) == 16  # every E2M1 code is exercised
    scales = rng.integers(*scale_range, (e, n, k // 32), dtype=np.uint8)
    x = jnp.asarray(rng.standard_normal((num_rows, k)), jnp.bfloat16)
    return x, jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(group_sizes, jnp.int32)


def test_decode_helpers_exact():
    got = np.asarray(e2m1_to_bf16(jnp.arange(16, dtype=jnp.uint16)).astype(jnp.float32))
    np.testing.assert_array_equal(got, E2M1_VALUES)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(E2M1_VALUES))
    s = np.arange(1, 255)
    got = np.asarray(e8m0_to_bf16(jnp.asarray(s, jnp.uint8)).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got, 2.0 ** (s - 127.0))


def test_tile_schedule():
    sched = np.asarray(make_tile_schedule(jnp.array([5, 0, 30], jnp.int32), num_rows=37, block_m=16))
    # expert 0: rows 0-4; expert 1: none; expert 2: rows 5-34 in two tiles; rows 35-36: the zero group (id 3)
    assert sched[:, :4].T.tolist() == [[0, 0, 5], [2, 5, 35], [2, 21, 35], [3, 35, 37]]
    assert np.all(sched[0, 4:] == -1)


def extreme_scales(x, scales):
    """Experts 0 and 2 of a 3-expert problem get scales 2**-125..2**-123 and 2**121..2**125; rows 0-19 (expert
    0's) are scaled by 2**100 and the rest by 2**-110, so the products stay finite."""
    scales = scales.at[0].set(2 + scales[0] % 3).at[2].set(248 + scales[2] % 5)
    row_scale = jnp.where(jnp.arange(x.shape[0]) < 20, 2.0 ** 100, 2.0 ** -110)
    return (x.astype(jnp.float32) * row_scale[:, None]).astype(jnp.bfloat16), scales


# every grouped case has E=3, M=37, N=16, K=64, so the interpret-mode kernels compile once per tile config
NUM_ROWS = 37


@pytest.mark.parametrize("group_sizes,extreme", [
    ([5, 0, 30], False),    # empty group, ragged tiles, 2 tail rows past sum(group_sizes)
    ([20, 0, 17], True),    # scales 2**-125..2**-123 and 2**121..2**125, rows scaled so products stay finite
])
def test_mxfp4_grouped_matches_reference(group_sizes, extreme):
    x, packed, scales, gs = random_problem(sum(group_sizes), group_sizes, NUM_ROWS)
    if extreme:
        x, scales = extreme_scales(x, scales)
    got = grouped_gemm_pallas(x, (packed, scales), gs, weight_format="mxfp4", **tiles())
    assert got.dtype == jnp.bfloat16
    assert_rows_close(got, mxfp4_grouped_matmul_reference(x, packed, scales, gs))
    assert not np.asarray(got[sum(group_sizes):], np.float32).any()


def test_mxfp4_public_ops():
    # one expert takes every row (M=37 is not a multiple of the 16-row tile); decode tiles: weights as MMA lhs
    x, packed, scales, gs = random_problem(11, [0, NUM_ROWS, 0], NUM_ROWS)
    want = mxfp4_grouped_matmul_reference(x, packed, scales, gs)
    assert_rows_close(mxfp4_grouped_matmul(x, packed, scales, gs, impl="pallas"), want)
    np.testing.assert_array_equal(mxfp4_grouped_matmul(x, packed, scales, gs, impl="reference"), want)
    dense = mxfp4_matmul(x, packed[1], scales[1], impl="pallas")
    assert_rows_close(dense, mxfp4_matmul_reference(x, packed[1], scales[1]))
    assert_rows_close(dense, want)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_bf16_grouped_matches_reference(transpose_rhs):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((29, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 64, 16)), jnp.bfloat16)  # [E, K, N]
    gs = jnp.array([0, 17, 0, 10], jnp.int32)
    got = grouped_matmul(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, gs, transpose_rhs=transpose_rhs,
                         impl="pallas")
    assert_rows_close(got, grouped_matmul_reference(x, w, gs))
    assert not np.asarray(got[27:], np.float32).any()


def test_stacked_layer_weights_use_the_right_layer_without_slicing():
    """``layer=`` reads layer l's experts out of the stacked [L, E, ...] parameters (passed to the kernel as one
    [L*E, ...] bitcast plus an expert offset); other layers' weights are poisoned with NaN to prove no read."""
    x, packed, scales, gs = random_problem(9, [4, 0, 20], NUM_ROWS)
    want = mxfp4_grouped_matmul_reference(x, packed, scales, gs)
    nan_scale = jnp.full_like(scales, 255)  # E8M0 255 = NaN
    stack_p = jnp.stack([packed, packed, packed])
    stack_s = jnp.stack([nan_scale, scales, nan_scale])
    got = mxfp4_grouped_matmul(x, stack_p, stack_s, gs, layer=1, impl="pallas")
    assert_rows_close(got, want)
    np.testing.assert_array_equal(mxfp4_grouped_matmul(x, stack_p, stack_s, gs, layer=1, impl="reference"), want)
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((2, 3, 64, 16)), jnp.bfloat16)  # [L, E, K, N]
    w = w.at[0].set(jnp.nan)
    got = grouped_matmul(x[:, :64], w, gs, layer=1, impl="pallas")
    assert_rows_close(got, grouped_matmul_reference(x[:, :64], w[1], gs))
    with pytest.raises(ValueError, match="layer=2"):
        grouped_matmul(x[:, :64], w, gs, layer=2, impl="pallas")


def test_every_layer_shares_one_compiled_kernel():
    """The expert offset is data, not a static argument: layers of the same shape reuse one compilation."""
    x, packed, scales, gs = random_problem(13, [3, 9, 0], 16)
    stack_p, stack_s = jnp.stack([packed] * 3), jnp.stack([scales] * 3)
    outs = [mxfp4_grouped_matmul(x, stack_p, stack_s, gs, layer=0, impl="pallas")]
    size = grouped_gemm_pallas._cache_size()
    outs += [mxfp4_grouped_matmul(x, stack_p, stack_s, gs, layer=layer, impl="pallas") for layer in (1, 2)]
    assert grouped_gemm_pallas._cache_size() == size
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_tile_bound_is_tight_at_decode_and_never_too_small():
    """Few rows over many experts need few tiles (the grid launches no crowd of idle programs), and the bound
    still covers the worst case: every row a group of its own, or one full group plus ragged ones. Shapes come
    from a small grid (each distinct one compiles the schedule once), the group sizes are drawn afresh."""
    assert max_num_tiles(8, 256, 16) == 8
    assert max_num_tiles(2, 56, 16) == 2
    rng = np.random.default_rng(0)
    for e, m, bm in itertools.product((1, 7, 39), (1, 37, 119), (1, 4, 16, 64)):
        schedule = jax.jit(functools.partial(make_tile_schedule, num_rows=m, block_m=bm))
        for _ in range(4):
            sizes = np.bincount(rng.integers(0, e + 1, m), minlength=e + 1)  # group e: the rows past the experts'
            if rng.random() < 0.25:  # every row in one expert, or in the zero group
                sizes = np.zeros(e + 1, int)
                sizes[rng.integers(0, e + 1)] = m
            needed = int(np.sum(-(-sizes // bm)))
            assert needed <= max_num_tiles(m, e, bm)
            sched = np.asarray(schedule(jnp.asarray(sizes[:e], jnp.int32)))
            valid = sched[0] >= 0
            assert valid.sum() == needed
            covered = np.zeros(m, int)
            for g, first, end in sched[:, valid].T:
                covered[first:min(first + bm, end)] += 1
            assert np.all(covered == 1)


@pytest.mark.parametrize("weight_format", ["mxfp4", "bf16"])
def test_split_k_equals_one_pass(weight_format):
    """``split_k`` cuts the K loop over programs and adds fp32 partials: same result within bf16 output rounding,
    zero rows past the groups, and a clear error when it does not divide the K steps."""
    x, packed, scales, gs = random_problem(21, [5, 0, 30], NUM_ROWS)
    if weight_format == "mxfp4":
        weights, want = (packed, scales), mxfp4_grouped_matmul_reference(x, packed, scales, gs)
    else:
        w = jnp.asarray(np.random.default_rng(2).standard_normal((3, 64, 16)), jnp.bfloat16)
        weights, want = (w,), grouped_matmul_reference(x, w, gs)
    got = grouped_gemm_pallas(x, weights, gs, weight_format=weight_format, **tiles(split_k=2))
    assert got.dtype == jnp.bfloat16
    assert_rows_close(got, want)
    assert not np.asarray(got[35:], np.float32).any()
    with pytest.raises(ValueError, match="split_k=3"):
        grouped_gemm_pallas(x, weights, gs, weight_format=weight_format, **tiles(split_k=3))


def test_tile_config_splits_k_only_when_few_programs_would_run():
    from pallas_kernels.mxfp4.ops import tile_config
    assert tile_config(1, 56, 6144, 3584, "mxfp4")["split_k"] == 2  # one expert: 96 column tiles x 2 >= 128
    assert tile_config(1, 56, 6144, 3584, "bf16")["split_k"] == 2
    assert tile_config(1, 1, 2304, 4096, "bf16")["split_k"] == 4  # Kimi-Linear o_proj at batch 1: 36 x 4
    assert "split_k" not in tile_config(8, 256, 1024, 2304, "bf16")  # 8 experts x 16 column tiles fill the GPU
    assert "split_k" not in tile_config(14, 56, 6144, 3584, "mxfp4")  # 13+ experts fill the GPU
    assert "split_k" not in tile_config(8192, 56, 6144, 3584, "mxfp4")
    assert "split_k" not in tile_config(0, 56, 6144, 3584, "mxfp4_words")  # no rows on this device: no crash


def test_tile_config_picks_the_pair_halves_and_word_tilings():
    """The pair-halves and word orders get their own H200 tilings (x as the MMA's A operand at decode, 64 x 128 x
    128 tiles at prefill; the word order 512-column K steps at decode, never under 128); the checkpoint order keeps
    its own."""
    from pallas_kernels.mxfp4.ops import tile_config
    decode = tile_config(262, 56, 6144, 3584, "mxfp4_pairs")
    assert (decode["block_k"], decode.get("weights_lhs", False)) == (256, False)
    assert tile_config(262, 56, 6144, 3584, "mxfp4")["weights_lhs"]
    assert tile_config(8212, 56, 6144, 3584, "mxfp4_pairs")["block_m"] == 64
    assert tile_config(8212, 56, 6144, 3584, "mxfp4")["block_m"] == 128
    words = [tile_config(rows, 56, 6144, k, "mxfp4_words") for rows in (1, 262, 1024, 8212) for k in (3072, 3584)]
    assert words[2]["block_k"] == 512 and words[4]["block_m"] == 32 and words[6]["block_m"] == 64
    assert (words[0]["num_warps"], words[2]["num_warps"]) == (4, 2)  # 2 warps from 2 rows per expert
    assert all(not cfg.get("weights_lhs") and cfg["block_k"] % 128 == 0 for cfg in words)  # what the decode needs


def test_tile_config_short_k_loops_pipeline_three_deep():
    from pallas_kernels.mxfp4.ops import tile_config
    assert tile_config(8, 8, 2304, 1024, "bf16")["num_stages"] == 3  # MoE down projection at decode: 8 K steps
    assert tile_config(8, 8, 2048, 2304, "bf16")["num_stages"] == 4  # gate/up: 18 K steps
    assert tile_config(512, 8, 2304, 1024, "bf16")["num_stages"] == 3  # prefill config, unchanged


@pytest.mark.parametrize("weight_format,split_k", [("mxfp4", 1), ("bf16", 2)])
def test_concatenated_matrices_in_one_launch(weight_format, split_k):
    """Several weight matrices of different widths in one launch give their products side by side, exactly as
    separate launches do (same groups, zero rows past them, split-K partials added per matrix)."""
    x, packed, scales, gs = random_problem(41, [5, 0, 30], NUM_ROWS)
    _, packed2, scales2, _ = random_problem(42, [5, 0, 30], NUM_ROWS, n=32)
    rng = np.random.default_rng(6)
    w16 = [jnp.asarray(rng.standard_normal((3, 64, n)), jnp.bfloat16) for n in (16, 32)]
    if weight_format == "mxfp4":
        matrices = ((packed, scales), (packed2, scales2))
        want = np.concatenate([mxfp4_grouped_matmul_reference(x, p, s, gs) for p, s in matrices], axis=1)
    else:
        matrices = tuple((w,) for w in w16)
        want = np.concatenate([grouped_matmul_reference(x, w, gs) for w in w16], axis=1)
    got = grouped_gemm_concat_pallas(x, matrices, gs, weight_format=weight_format, **tiles(split_k=split_k))
    assert got.shape == (NUM_ROWS, 48)
    assert_rows_close(got, want)
    assert not np.asarray(got[35:], np.float32).any()
    one = [grouped_gemm_pallas(x, m, gs, weight_format=weight_format, **tiles(split_k=split_k))
           for m in matrices]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.concatenate(one, axis=1).astype(np.float32))


def test_concat_ops_read_the_stacked_layer():
    """The public concat ops pick layer ``l`` of stacked [L, E, ...] weights (other layers NaN) and match their
    reference; their tile fits every width."""
    x, packed, scales, gs = random_problem(43, [4, 0, 20], NUM_ROWS)
    _, packed2, scales2, _ = random_problem(44, [4, 0, 20], NUM_ROWS, n=32)
    nan = lambda s: jnp.stack([jnp.full_like(s, 255), s])  # noqa: E731 - E8M0 255 = NaN in layer 0
    parts = [(jnp.stack([packed, packed]), nan(scales)), (jnp.stack([packed2, packed2]), nan(scales2))]
    want = mxfp4_grouped_matmul_concat(x, parts, gs, layer=1, impl="reference")
    assert want.shape == (NUM_ROWS, 48) and np.isfinite(np.asarray(want, np.float32)).all()
    assert_rows_close(mxfp4_grouped_matmul_concat(x, parts, gs, layer=1, impl="pallas"), want)
    rng = np.random.default_rng(8)
    ws = [jnp.asarray(rng.standard_normal((2, 3, 64, n)), jnp.bfloat16).at[0].set(jnp.nan) for n in (32, 16)]
    want = grouped_matmul_concat(x, ws, gs, layer=1, impl="reference")
    assert_rows_close(grouped_matmul_concat(x, ws, gs, layer=1, impl="pallas"), want)
    np.testing.assert_array_equal(want[:, :32], grouped_matmul_reference(x, ws[0][1], gs))


@pytest.mark.parametrize("weight_format,split_k", [("mxfp4", 1), ("bf16", 2)])
def test_per_row_experts_in_any_order(weight_format, split_k):
    """``row_experts``: each row multiplies its own expert (rows unsorted, experts repeated, layer 1 of a stack
    whose layer 0 is NaN), as the row-by-row reference does, through the public ops and the kernel."""
    rng = np.random.default_rng(9)
    row_experts = jnp.asarray([2, 0, 2, 1, 2, 0, 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((7, 64)), jnp.bfloat16)
    if weight_format == "mxfp4":
        _, packed, scales, _ = random_problem(45, [1, 1, 1], 7)
        _, packed2, scales2, _ = random_problem(46, [1, 1, 1], 7, n=32)
        nan = lambda s: jnp.stack([jnp.full_like(s, 255), s])  # noqa: E731 - E8M0 255 = NaN in layer 0
        parts = [(jnp.stack([packed, packed]), nan(scales)), (jnp.stack([packed2, packed2]), nan(scales2))]
        got = mxfp4_grouped_matmul_concat(x, parts, row_experts=row_experts, layer=1, impl="pallas")
        want = mxfp4_grouped_matmul_concat(x, parts, row_experts=row_experts, layer=1, impl="reference")
        dense = [jnp.swapaxes(dequantize(p[1], s[1], jnp.float32), 1, 2) for p, s in parts]
    else:
        ws = [jnp.asarray(rng.standard_normal((2, 3, 64, n)), jnp.bfloat16).at[0].set(jnp.nan) for n in (32, 16)]
        got = grouped_matmul_concat(x, ws, row_experts=row_experts, layer=1, impl="pallas")
        want = grouped_matmul_concat(x, ws, row_experts=row_experts, layer=1, impl="reference")
        dense = [w[1].astype(jnp.float32) for w in ws]
        kernel = grouped_gemm_concat_pallas(x, tuple((w[1],) for w in ws), row_experts, weight_format="bf16",
                                            per_row=True, **tiles(split_k=split_k))
        assert_rows_close(kernel, want)
    assert got.shape == (7, 48) and np.isfinite(np.asarray(want, np.float32)).all()
    by_row = np.concatenate([np.stack([np.asarray(x[m], np.float32) @ np.asarray(w[e]) for m, e in
                                       enumerate(np.asarray(row_experts))]) for w in dense], axis=1)
    assert_rows_close(want, by_row)
    assert_rows_close(got, want)


@pytest.mark.parametrize("weight_format", ["mxfp4", "bf16"])
def test_per_row_experts_share_x_rows(weight_format):
    """3 tokens x 3 choices: ``row_experts [9]`` with ``x [3, K]``; output row m uses token m // 3, as the
    explicitly repeated x does (the decode MoE path, which no longer materialises the repeat)."""
    rng = np.random.default_rng(11)
    row_experts = jnp.asarray([2, 0, 1, 1, 2, 0, 0, 0, 2], jnp.int32)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    repeated = jnp.repeat(x, 3, axis=0)
    _, packed, scales, _ = random_problem(47, [1, 1, 1], 7)
    ws = [jnp.asarray(rng.standard_normal((1, 3, 64, 32)), jnp.bfloat16)]

    def run(x, impl):
        if weight_format == "mxfp4":
            return mxfp4_grouped_matmul_concat(x, [(packed[None], scales[None])], row_experts=row_experts, layer=0,
                                               impl=impl)
        return grouped_matmul_concat(x, ws, row_experts=row_experts, layer=0, impl=impl)

    want = run(repeated, "reference")
    assert_rows_close(run(x, "reference"), want)
    assert_rows_close(run(x, "pallas"), want)
    with pytest.raises(ValueError, match="not a multiple"):
        run(x[:2], "pallas")


@pytest.mark.parametrize("transpose_rhs,split_k", [(False, 1), (True, 2)])
def test_shared_expert_rows_join_the_routed_launch(transpose_rhs, split_k):
    """Rows naming SHARED_EXPERT multiply layer ``layer`` of the shared weights (other layers NaN), the rest
    their routed expert (layer 0 NaN), in one launch: 2 tokens x (3 routed + 1 shared) rows, two matrices side
    by side (the gate and up projections), as x @ W row by row."""
    rng = np.random.default_rng(13)
    row_experts = jnp.asarray([2, 0, 1, SHARED_EXPERT, 1, 1, 2, SHARED_EXPERT], jnp.int32)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.bfloat16)
    layout = (lambda w: jnp.swapaxes(w, -1, -2)) if transpose_rhs else (lambda w: w)  # noqa: E731
    routed = [jnp.asarray(rng.standard_normal((2, 3, 64, n)), jnp.float32).at[0].set(jnp.nan) for n in (32, 16)]
    shared = [jnp.asarray(rng.standard_normal((3, 64, n)), jnp.float32).at[jnp.asarray([0, 2])].set(jnp.nan)
              for n in (32, 16)]
    routed_bf16 = [layout(w).astype(jnp.bfloat16) for w in routed]
    shared_bf16 = [layout(w).astype(jnp.bfloat16) for w in shared]
    args = dict(row_experts=row_experts, layer=1, transpose_rhs=transpose_rhs, shared=shared_bf16)
    want = grouped_matmul_concat(x, routed_bf16, **args, impl="reference")
    got = grouped_matmul_concat(x, routed_bf16, **args, impl="pallas")
    by_row = []
    for m, e in enumerate(np.asarray(row_experts)):
        w = [v[1] if e == SHARED_EXPERT else r[1, e] for r, v in zip(routed, shared)]
        xm = np.asarray(x[m // 4], np.float32)
        by_row.append(np.concatenate([xm @ np.asarray(wi.astype(jnp.bfloat16), np.float32) for wi in w]))
    assert_rows_close(want, np.stack(by_row))
    assert_rows_close(got, want)
    kernel = grouped_gemm_concat_pallas(
        x, tuple((layout(w[1]).astype(jnp.bfloat16),) for w in routed), row_experts,
        weight_format="bf16_nk" if transpose_rhs else "bf16", per_row=True,
        shared=tuple((w,) for w in shared_bf16), shared_offset=1, **tiles(split_k=split_k))
    assert_rows_close(kernel, want)
    with pytest.raises(ValueError, match="shared needs"):
        grouped_matmul_concat(x, routed_bf16, group_sizes=jnp.asarray([4, 4, 0], jnp.int32), layer=1,
                              shared=shared_bf16)
    with pytest.raises(ValueError, match="shared needs"):
        grouped_gemm_concat_pallas(x, tuple((w[1],) for w in routed_bf16), row_experts,
                                   weight_format="bf16_nk" if transpose_rhs else "bf16", per_row=True,
                                   shared=((shared_bf16[1],), (shared_bf16[0],)), **tiles())


def test_exactly_one_row_map():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    w = jnp.zeros((3, 64, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="exactly one"):
        grouped_matmul_concat(x, [w], jnp.asarray([2, 0, 0], jnp.int32), row_experts=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="exactly one"):
        grouped_matmul_concat(x, [w])


def test_pair_halves_byte_order():
    """Byte 32p + j holds column 64p + j (low nibble) and 64p + 32 + j (high nibble); the inverse restores the
    checkpoint bytes; in not a multiple of 64 is a clear error."""
    _, packed, _, _ = random_problem(51, [1], 1, n=3, k=128)
    pairs = np.asarray(to_pair_halves(packed))
    codes = np.asarray(unpack_codes(packed))  # [E, N, K] in column order
    for p in range(2):
        np.testing.assert_array_equal(pairs[..., 32 * p:32 * p + 32] & 0xF, codes[..., 64 * p:64 * p + 32])
        np.testing.assert_array_equal(pairs[..., 32 * p:32 * p + 32] >> 4, codes[..., 64 * p + 32:64 * p + 64])
    np.testing.assert_array_equal(np.asarray(from_pair_halves(jnp.asarray(pairs))), np.asarray(packed))
    with pytest.raises(ValueError, match="in % 64"):
        to_pair_halves(packed[..., :16])
    with pytest.raises(ValueError, match="byte_order"):
        mxfp4_grouped_matmul_concat(jnp.zeros((1, 128), jnp.bfloat16), ((packed, packed[..., :4]),),
                                    jnp.ones((1,), jnp.int32), byte_order="nibbles")


def test_word_byte_order():
    """Word g of each 64-column pair holds columns 4g..4g+3 of both blocks at the bits of WORD_POSITIONS (every bit
    of the word used once); the inverse restores the checkpoint bytes; in not a multiple of 64 is a clear error."""
    assert sorted(p for block in WORD_POSITIONS for column in block for p in column) == list(range(32))
    _, packed, _, _ = random_problem(52, [1], 1, n=3, k=128)
    words = np.asarray(to_word_order(packed))
    codes = np.asarray(unpack_codes(packed))  # [E, N, K] in column order
    b = words.reshape(*words.shape[:-1], 2, 8, 4).astype(np.uint32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # [E, N, pair, g]
    blocks = codes.reshape(*codes.shape[:-1], 2, 2, 8, 4)  # [E, N, pair, block, g, column]
    for block, columns in enumerate(WORD_POSITIONS):
        for column, positions in enumerate(columns):
            got = sum(((word >> position) & 1) << bit for bit, position in enumerate(positions))
            np.testing.assert_array_equal(got, blocks[..., block, :, column])
    np.testing.assert_array_equal(np.asarray(from_word_order(jnp.asarray(words))), np.asarray(packed))
    with pytest.raises(ValueError, match="in % 64"):
        to_word_order(packed[..., :16])


@pytest.mark.parametrize("layout,extreme", [
    (dict(weights_lhs=False, block_k=256), True),  # 4 pairs per K step: both scale words, every byte of them
    (dict(weights_lhs=False, block_k=128, split_k=2), False),  # K split over two programs
    (dict(weights_lhs=False, block_k=128, per_row=True), False),  # one row per (token, expert) pair, unsorted
    (dict(weights_lhs=False, block_k=128, block_m=64), True),  # prefill-sized row tile
])
def test_mxfp4_words_kernel_matches_reference(layout, extreme):
    """The word-order kernel path (scales read as uint32 words of 4 blocks) equals the float32 reference on the
    checkpoint bytes, within the bf16 output rounding of TOL; block_k not a multiple of 128, and the weights as
    the MMA's A operand, are clear errors."""
    x, packed, scales, gs = random_problem(62, [20, 0, 17], NUM_ROWS, n=32, k=256)
    if extreme:
        x, scales = extreme_scales(x, scales)
    layout = dict(layout)
    per_row = layout.pop("per_row", False)
    kwargs = tiles(**layout)
    words = to_word_order(packed)
    if per_row:
        rows = jnp.asarray([2, 0, 2, 1, 2, 0, 1], jnp.int32)
        want = jnp.concatenate([mxfp4_matmul_reference(x[i:i + 1], packed[e], scales[e])
                                for i, e in enumerate(np.asarray(rows))])
        got = grouped_gemm_concat_pallas(x[:7], ((words, scales),), rows, weight_format="mxfp4_words",
                                         per_row=True, **kwargs)
    else:
        want = mxfp4_grouped_matmul_reference(x, packed, scales, gs)
        got = grouped_gemm_pallas(x, (words, scales), gs, weight_format="mxfp4_words", **kwargs)
    assert_rows_close(got, want)
    with pytest.raises(ValueError, match="multiple of 128"):
        grouped_gemm_pallas(x, (words, scales), gs, weight_format="mxfp4_words", **tiles(block_k=64))
    with pytest.raises(ValueError, match="weights_lhs=False"):
        grouped_gemm_pallas(x, (words, scales), gs, weight_format="mxfp4_words",
                            **tiles(block_k=128, weights_lhs=True))
    with pytest.raises(ValueError, match="narrow_scales"):
        grouped_gemm_pallas(x, (packed, scales), gs, weight_format="mxfp4", narrow_scales=True, **tiles())


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Triton's register layout exists on the GPU only")
# decode tiles with 4 / 2 warps, the 32-row tile, the prefill tile
@pytest.mark.parametrize("group_sizes", [[1, 0, 0], [20, 0, 9], [20, 0, 60], [20, 0, 250]])
@pytest.mark.parametrize("narrow", [False, True])
def test_mxfp4_words_at_tile_config_tilings_on_gpu(group_sizes, narrow):
    """On the GPU, at the tilings tile_config picks, the word-order decode (which needs Triton to hand its asm 4
    memory-consecutive bytes) equals the pair-halves kernel at the same tiling bit for bit (both decode the same
    bf16 weights exactly) and the fp32 reference within TOL."""
    from pallas_kernels.mxfp4.ops import tile_config

    x, packed, scales, gs = random_problem(63, group_sizes, sum(group_sizes) + 3, n=128, k=512,
                                           scale_range=(100, 129) if narrow else (120, 134))
    if not narrow:
        x, scales = extreme_scales(x, scales)
    assert scales_are_narrow(scales) == narrow
    m, n, k = x.shape[0], packed.shape[1], x.shape[1]
    cfg = tile_config(m, len(group_sizes), n, k, "mxfp4_words")
    config = GroupedGemmConfig(**cfg)
    got = grouped_gemm_pallas(x, (to_word_order(packed), scales), gs, weight_format="mxfp4_words",
                              narrow_scales=narrow, config=config)
    pairs = grouped_gemm_pallas(x, (to_pair_halves(packed), scales), gs, weight_format="mxfp4_pairs", config=config)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(pairs, np.float32))
    assert_rows_close(got, mxfp4_grouped_matmul_reference(x, packed, scales, gs))


@pytest.mark.parametrize("weight_format,layout,extreme", [
    ("mxfp4_pairs", dict(weights_lhs=True, split_k=2), False),   # decode orientation, K split over two programs
    ("mxfp4_pairs", dict(weights_lhs=False, split_k=1), True),   # scales 2**-125..2**-123 / 2**121..2**125
    ("mxfp4_pairs", dict(weights_lhs=True, per_row=True), False),  # one row per (token, expert) pair, unsorted
    ("mxfp4_pairs_jnp", dict(weights_lhs=True, split_k=1), True),  # the jnp decode (on the GPU too)
    ("mxfp4_pairs", dict(weights_lhs=False, block_m=64), True),  # prefill-sized row tile: scaled weights
    ("mxfp4_pairs_jnp", dict(weights_lhs=True, block_m=64), False),
])
def test_mxfp4_pairs_kernel_matches_reference(weight_format, layout, extreme):
    """The pair-halves kernel path (one K=32 dot per MX block, the scale applied to its fp32 product, or to the
    decoded weights for row tiles of 64 and more) equals the float32 reference on the checkpoint bytes, within the bf16 output rounding of TOL."""
    group_sizes = [20, 0, 17]
    x, packed, scales, gs = random_problem(61, group_sizes, NUM_ROWS, n=32, k=128)
    if extreme:
        x, scales = extreme_scales(x, scales)
    kwargs = tiles(block_k=64, **{name: v for name, v in layout.items() if name != "per_row"})
    if layout.get("per_row"):
        rows = jnp.asarray([2, 0, 2, 1, 2, 0, 1], jnp.int32)
        want = jnp.concatenate([mxfp4_matmul_reference(x[i:i + 1], packed[e], scales[e])
                                for i, e in enumerate(np.asarray(rows))])
        got = grouped_gemm_concat_pallas(x[:7], ((to_pair_halves(packed), scales),), rows,
                                         weight_format=weight_format, per_row=True, **kwargs)
    else:
        want = mxfp4_grouped_matmul_reference(x, packed, scales, gs)
        got = grouped_gemm_pallas(x, (to_pair_halves(packed), scales), gs, weight_format=weight_format, **kwargs)
        assert not np.asarray(got[sum(group_sizes):], np.float32).any()
    assert_rows_close(got, want)
    with pytest.raises(ValueError, match="pairs of them"):
        grouped_gemm_pallas(x, (packed, scales), gs, weight_format="mxfp4_pairs", **tiles())


def run_ptx(ptx: str, inputs: dict[str, int]) -> list[int]:
    """Execute a decode's PTX (mov, prmt, and, shl, shr, or, add, max.u16x2, mul.rn.bf16x2 on .b32 registers)
    for input registers ``inputs`` (``{"$2": word, ...}``); -> the output registers ``[$0, $1]``. A small
    interpreter, so the exact asm text is tested on CPU."""
    regs = dict(inputs)

    def val(op):
        return regs[op] if op in regs else int(op, 0)

    def bf16(bits):
        return float(np.array([bits << 16], np.uint32).view(np.float32)[0])

    def to_bf16_bits(x):  # the decode's products are exact bf16 values (normal or subnormal): no rounding here
        bits = int(np.array([x], np.float32).view(np.uint32)[0])
        assert bits & 0xFFFF == 0, x
        return bits >> 16

    body = ptx.strip()[1:-1].split(";")
    for statement in (s.strip() for s in body if s.strip()):
        if statement.startswith(".reg"):
            continue
        op, args = statement.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[args[0]] = val(args[1])
        elif op == "prmt.b32":
            source = val(args[1]).to_bytes(4, "little") + val(args[2]).to_bytes(4, "little")
            selector = val(args[3])
            regs[args[0]] = int.from_bytes(bytes(source[(selector >> (4 * i)) & 7] for i in range(4)), "little")
        elif op == "and.b32":
            regs[args[0]] = val(args[1]) & val(args[2])
        elif op == "shl.b32":
            regs[args[0]] = (val(args[1]) << val(args[2])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[args[0]] = val(args[1]) >> val(args[2])
        elif op == "add.u32":
            regs[args[0]] = (val(args[1]) + val(args[2])) & 0xFFFFFFFF
        elif op == "max.u16x2":
            a, b = val(args[1]), val(args[2])
            regs[args[0]] = max(a & 0xFFFF, b & 0xFFFF) | (max(a >> 16, b >> 16) << 16)
        elif op == "or.b32":
            regs[args[0]] = val(args[1]) | val(args[2])
        elif op == "mul.rn.bf16x2":
            a, b = val(args[1]), val(args[2])
            lo, hi = (to_bf16_bits(bf16((a >> s) & 0xFFFF) * bf16((b >> s) & 0xFFFF)) for s in (0, 16))
            regs[args[0]] = lo | (hi << 16)
        else:
            raise AssertionError(f"unknown PTX op {op}")
    return [regs["$0"], regs["$1"]]


def test_inline_ptx_decode_is_exact_for_every_byte():
    """The pair-halves decode's PTX (interpreted above) maps byte k of a packed word to bf16 element k: E2M1 of
    its low nibble for one block, of its high nibble for the other, times the block's scale (a bf16 pair per
    register, as Triton packs the broadcast scale), signs, the subnormal code 1 and subnormal products included."""
    from pallas_kernels.mxfp4.kernel import _HIGH_NIBBLES_PTX, _LOW_NIBBLES_PTX

    rng = np.random.default_rng(7)
    words = [int.from_bytes(bytes([b, 255 - b, (7 * b) % 256, (b + 85) % 256]), "little") for b in range(256)]
    words += [int(w) for w in rng.integers(0, 1 << 32, 64, dtype=np.uint64)]
    codes = [0, 1, 2, 120, 127, 133, 250]  # E8M0 exponents: 2**-127 (a bf16 subnormal) .. 2**123
    for i, word in enumerate(words):
        data = word.to_bytes(4, "little")
        code = codes[i % len(codes)]
        scale_bits = 0x40 if code == 0 else code << 7
        for ptx, nibble in ((_LOW_NIBBLES_PTX, lambda b: b & 0xF), (_HIGH_NIBBLES_PTX, lambda b: b >> 4)):
            out = run_ptx(ptx, {"$2": word, "$3": scale_bits * 0x10001, "$4": scale_bits * 0x10001})
            bits = np.array([(out[k // 2] >> (16 * (k % 2))) & 0xFFFF for k in range(4)], np.uint32) << 16
            got = bits.view(np.float32)
            want = (E2M1_VALUES[[nibble(b) for b in data]].astype(np.float64) * 2.0 ** (code - 127)).astype(np.float32)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("narrow", [False, True])
def test_word_order_ptx_decode_is_exact(narrow):
    """The word-order decode's PTX (interpreted) maps bf16 element k of its two output pairs to E2M1 of column k of
    the block (first or second of the pair, as :func:`word_order_codes` reads it) times the scale in byte
    ``scale_byte`` of the scales' word, passed as :func:`_scale_pair` forms it, for every scale code (narrow: codes
    0..128, the folded bias), with signed zeros kept."""
    from pallas_kernels.mxfp4.kernel import _scale_pair, _word_ptx

    rng = np.random.default_rng(11)
    words = [int.from_bytes(bytes([b, 255 - b, (7 * b) % 256, (b + 85) % 256]), "little") for b in range(256)]
    words += [int(w) for w in rng.integers(0, 1 << 32, 64, dtype=np.uint64)]
    codes = [0, 1, 2, 64, 120, 127, 128] if narrow else [0, 1, 2, 120, 127, 128, 133, 200, 250, 254]
    for i, word in enumerate(words):
        data = np.frombuffer(word.to_bytes(4, "little"), np.uint8)
        scale_codes = [codes[(i + j) % len(codes)] for j in range(4)]
        scale_word = jnp.asarray([int.from_bytes(bytes(scale_codes), "little")], jnp.uint32)
        for block in range(2):
            block_codes = np.asarray(word_order_codes(jnp.asarray(data))[block])
            for scale_byte in (block, 2 + block):
                scale = int(_scale_pair(scale_word, scale_byte, narrow)[0])
                out = run_ptx(_word_ptx(block, narrow), {"$2": word, "$3": scale})
                bits = np.array([(out[k // 2] >> (16 * (k % 2))) & 0xFFFF for k in range(4)], np.uint32) << 16
                got = bits.view(np.float32)
                want = (E2M1_VALUES[block_codes].astype(np.float64)
                        * 2.0 ** (scale_codes[scale_byte] - 127)).astype(np.float32)
                np.testing.assert_array_equal(got, want)
                np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA compiler (no GPU needed)")
def test_inline_ptx_assembles_for_hopper(tmp_path):
    """The decodes' asm, in the operand form Triton gives it (two b32 outputs; pair halves: three b32 inputs,
    word order: one packed word and four copies of its scale's bf16 pair), compiles for sm_90 with nvcc + ptxas:
    syntax, operand kinds and the availability on Hopper of the bf16x2 multiply and the u16x2 max."""
    from pallas_kernels.mxfp4.kernel import (
        _HIGH_NIBBLES_PTX,
        _LOW_NIBBLES_PTX,
        _word_ptx,
    )

    asm = lambda i, ptx, inputs: (f'  asm volatile("{ptx.replace("$", "%")}" : "=r"(out[{2 * i}]), '  # noqa: E731
                                  f'"=r"(out[{2 * i + 1}]) : {inputs});')
    pairs = [asm(i, ptx, '"r"(word), "r"(scale), "r"(scale)') for i, ptx in enumerate((_LOW_NIBBLES_PTX,
                                                                                        _HIGH_NIBBLES_PTX))]
    words = [asm(2 + i, _word_ptx(block, narrow), ", ".join(['"r"(word)'] + ['"r"(scale)'] * 4))
             for i, (block, narrow) in enumerate(((0, False), (1, True)))]
    source = tmp_path / "decode.cu"
    source.write_text("#include <cstdint>\n__global__ void decode(const uint32_t* in, uint32_t* o) {\n"
                      "  uint32_t word = in[threadIdx.x]; uint32_t scale = in[threadIdx.x + 32]; uint32_t out[8];\n"
                      + "\n".join(pairs + words) +
                      "\n  for (int i = 0; i < 8; ++i) o[8 * threadIdx.x + i] = out[i];\n}\n")
    result = subprocess.run(["nvcc", "-arch=sm_90", "-c", str(source), "-o", str(tmp_path / "decode.o")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
