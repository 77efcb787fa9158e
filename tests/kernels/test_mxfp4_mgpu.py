"""The Mosaic-GPU MXFP4 grouped decode GEMM against the float32 reference on the checkpoint bytes: in Mosaic-GPU's
interpreter on a CPU, for real on a GPU.

Tolerance (``assert_rows_close`` of the Triton kernel's tests): per-row max error <= 1e-2 of the row's largest
reference magnitude. The kernel decodes the weights exactly to bf16 (scaled by a power of two), accumulates
bf16 products in fp32 and rounds the output once to bf16 (2**-8 relative); a wrong nibble, scale, row or
expert is an O(1) error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mxfp4 import MXFP4MGPUConfig
from pallas_kernels.mxfp4.decode_mgpu import mxfp4_grouped_matmul_mgpu, prepare_weights, restore_weights
from pallas_kernels.mxfp4.ops import mgpu_tile_config
from pallas_kernels.mxfp4.reference import mxfp4_grouped_matmul_reference
from tests.kernels.test_mxfp4_kernels import assert_rows_close, extreme_scales, random_problem

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("group_sizes,num_rows,n,k,block_k,block_m,wgs,extreme", [
    ([5, 0, 30], 37, 64, 256, 256, 16, 1, False),  # empty expert, a 30-row expert in two tiles, 2 rows past
    ([0, 37, 0], 37, 128, 512, 256, 16, 1, True),   # one expert takes every row; two column tiles, two K steps
    ([1, 2, 0], 3, 64, 384, 128, 16, 1, False),     # decode: a few rows, K not a power of two, three K steps
    ([5, 0, 11], 17, 64, 256, 128, 8, 1, False),    # 8-row tiles (wgmma N=8): an expert over two tiles
    ([70, 0, 60], 131, 128, 128, 64, 64, 2, True),  # prefill-sized 64-row tiles, two compute warpgroups
])
def test_grouped_decode_matches_reference(group_sizes, num_rows, n, k, block_k, block_m, wgs, extreme):
    x, packed, scales, gs = random_problem(71, group_sizes, num_rows, n=n, k=k)
    if extreme:
        x, scales = extreme_scales(x, scales)
    want = mxfp4_grouped_matmul_reference(x, packed, scales, gs)
    got = mxfp4_grouped_matmul_mgpu(x, [prepare_weights(packed, scales)], gs,
                                    config=MXFP4MGPUConfig(block_k=block_k, block_m=block_m, stages=2, wgs=wgs))
    assert got.shape == (num_rows, n) and got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    assert not got[sum(group_sizes):].any()  # rows past sum(group_sizes) are zero
    assert_rows_close(got, want)


def test_two_matrices_of_a_layer_stack_in_one_launch():
    """Gate and up side by side from one launch, layer 1 of ``[L*E, ...]`` stacks by ``expert_offset`` (layer 0's
    scales are E8M0 NaN, so reading it shows)."""
    x, packed, scales, gs = random_problem(73, [3, 0, 9], 14, n=64, k=128)
    _, packed2, scales2, _ = random_problem(74, [3, 0, 9], 14, n=128, k=128)
    nan = lambda s: jnp.stack([jnp.full_like(s, 255), s]).reshape(-1, *s.shape[1:])  # noqa: E731
    stack = lambda p: jnp.concatenate([p, p])  # noqa: E731
    matrices = [prepare_weights(stack(packed), nan(scales)), prepare_weights(stack(packed2), nan(scales2))]
    got = np.asarray(mxfp4_grouped_matmul_mgpu(x, matrices, gs, 3, config=MXFP4MGPUConfig(block_k=128, stages=2)),
                     np.float32)
    want = np.concatenate([np.asarray(mxfp4_grouped_matmul_reference(x, p, s, gs), np.float32)
                           for p, s in ((packed, scales), (packed2, scales2))], axis=1)
    assert got.shape == (14, 192) and np.isfinite(got).all()
    assert_rows_close(got[:12], want[:12])
    assert not got[12:].any()


def test_per_row_experts_in_any_order():
    """``row_experts``: 3 tokens x 3 choices, each output row its own 8-row tile, experts repeated and unsorted,
    layer 1 of a stack by the offset; as the row-by-row product."""
    from pallas_kernels.mxfp4.reference import mxfp4_matmul_reference

    x, packed, scales, _ = random_problem(75, [1, 1, 1], 3, n=64, k=128)
    stack = [prepare_weights(jnp.concatenate([packed, packed]), jnp.concatenate([jnp.full_like(scales, 255), scales]))]
    row_experts = jnp.asarray([2, 0, 2, 1, 1, 0, 0, 2, 1], jnp.int32)
    got = mxfp4_grouped_matmul_mgpu(x, stack, None, 3, row_experts=row_experts,
                                    config=MXFP4MGPUConfig(block_m=8, block_k=64, stages=2))
    want = np.concatenate([np.asarray(mxfp4_matmul_reference(x[m // 3:m // 3 + 1], packed[e], scales[e]), np.float32)
                           for m, e in enumerate(np.asarray(row_experts))])
    assert got.shape == (9, 64)
    assert_rows_close(got, want)
    with pytest.raises(ValueError, match="exactly one"):
        mxfp4_grouped_matmul_mgpu(x, stack, None)
    with pytest.raises(ValueError, match="exactly one"):
        mxfp4_grouped_matmul_mgpu(x, stack, None, row_experts=row_experts[:8])  # not a multiple of x's 3 rows


def test_prepared_layout_and_bad_arguments():
    """prepare_weights: byte group g of row n holds columns 64g + j (low nibble) and 64g + 32 + j (high nibble),
    restore_weights gives the checkpoint bytes back; wrong layouts and block sizes are clear errors."""
    x, packed, scales, gs = random_problem(72, [2, 1], 3, n=64, k=128)
    pairs, moved = prepare_weights(packed, scales)
    assert pairs.shape == (2, 2, 64, 32) and moved.shape == (2, 4, 64)
    codes = np.stack([np.asarray(packed) & 15, np.asarray(packed) >> 4], -1).reshape(2, 64, 128)  # [E, N, K]
    for g in range(2):
        np.testing.assert_array_equal(np.asarray(pairs[:, g]) & 15, codes[..., 64 * g:64 * g + 32])
        np.testing.assert_array_equal(np.asarray(pairs[:, g]) >> 4, codes[..., 64 * g + 32:64 * g + 64])
    np.testing.assert_array_equal(np.asarray(moved), np.swapaxes(np.asarray(scales), 1, 2))
    for got, original in zip(restore_weights(pairs, moved), (packed, scales)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(original))
    with pytest.raises(ValueError, match="prepare_weights"):
        mxfp4_grouped_matmul_mgpu(x, [(packed, scales)], gs)
    with pytest.raises(ValueError, match="prepare_weights"):
        mxfp4_grouped_matmul_mgpu(x, [(pairs[:1], moved[:1])], gs)  # fewer weight rows than experts
    with pytest.raises(ValueError, match="block_k"):
        mxfp4_grouped_matmul_mgpu(x, [(pairs, moved)], gs, config=MXFP4MGPUConfig(block_k=96))
    with pytest.raises(ValueError, match="block_m"):
        mxfp4_grouped_matmul_mgpu(x, [(pairs, moved)], gs, config=MXFP4MGPUConfig(block_m=24))
    with pytest.raises(ValueError, match="multiple of 128"):
        mxfp4_grouped_matmul_mgpu(x, [(pairs, moved)], gs, config=MXFP4MGPUConfig(wgs=2))  # N = 64
    with pytest.raises(ValueError, match="multiple of 64"):
        prepare_weights(packed[:, :48], scales[:, :48])


@pytest.mark.parametrize("rows,block_k,stages,block_m,wgs", [(64, 256, 4, 16, 1), (16, 512, 3, 16, 1),
                                                             (8, 256, 6, 8, 1), (8192, 128, 3, 256, 1),
                                                             (8192, 64, 4, 256, 2), (64, 256, 4, 16, 2)])
def test_kernel_lowers_for_cuda(rows, block_k, stages, block_m, wgs):
    """``jax.export`` for CUDA runs Mosaic-GPU's lowering on the CPU (layout inference of the byte tile's upcast
    into the wgmma A layout, TMA boxes, shared memory): K3's expert gate + up over 56 experts, at decode and at
    an 8K-token prefill with 256-row tiles (three 68 KB stages; two compute warpgroups)."""
    fn = functools.partial(mxfp4_grouped_matmul_mgpu, interpret=False,
                           config=MXFP4MGPUConfig(block_k=block_k, block_m=block_m, stages=stages, wgs=wgs))
    gate_up = [(S((56, 56, 3072, 32), jnp.uint8), S((56, 112, 3072), jnp.uint8))] * 2
    module = jax.export.export(jax.jit(fn), platforms=["cuda"])(S((rows, 3584), jnp.bfloat16), gate_up,
                                                                S((56,), jnp.int32)).mlir_module()
    assert "mosaic_gpu" in module


def test_tile_config_by_rows_per_expert():
    assert mgpu_tile_config(256, 56, (3072, 3072)) == dict(block_m=16, wgs=1)  # K3 decode, 256 tokens: 4.6 per expert
    assert mgpu_tile_config(8222, 56, (3072, 3072)) == dict(block_m=128, wgs=2)  # 8K-token prefill
    assert mgpu_tile_config(8222, 56, (3072, 64)) == dict(block_m=128, wgs=1)  # a width that 128 does not divide


def test_per_row_kernel_lowers_for_cuda():
    """K3's batch-1 decode as the MoE runs it: 16 (token, expert) rows, each its own 8-row tile, layer 2 of a
    stack of 3 x 56 experts."""
    fn = functools.partial(mxfp4_grouped_matmul_mgpu, config=MXFP4MGPUConfig(block_m=8), interpret=False)
    gate_up = [(S((168, 56, 3072, 32), jnp.uint8), S((168, 112, 3072), jnp.uint8))] * 2
    module = jax.export.export(jax.jit(fn), platforms=["cuda"])(
        S((1, 3584), jnp.bfloat16), gate_up, None, S((), jnp.int32), row_experts=S((16,), jnp.int32)).mlir_module()
    assert "mosaic_gpu" in module
