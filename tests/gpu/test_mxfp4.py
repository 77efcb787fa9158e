"""The grouped GEMMs on the GPU against the fp32 references on the checkpoint bytes: the Triton kernel in every byte
order (checkpoint, pair halves, word order with and without narrow scales) and bf16, at the tilings ``tile_config``
picks for decode, verify-sized and prefill row counts and per (token, expert) row, fp32 activations, and the
Mosaic-GPU kernel (Hopper) including its prefill tiling, whose 4 stages are shrunk to fit the shared memory.

Every problem holds all 16 E2M1 codes (``random_problem`` asserts it) and, where marked, the extreme E8M0 scales
2**-125..2**-123 and 2**121..2**125 on rows scaled by 2**100 / 2**-110. Tolerance: per-row max error <= 1e-2 of
the row's largest reference magnitude (the weights decode exactly, fp32 accumulation, bf16 output rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mxfp4 as gemm_ops
from pallas_kernels.impl import on_hopper
from pallas_kernels.mxfp4.kernel import scales_are_narrow
from pallas_kernels.mxfp4.quant import to_pair_halves, to_word_order
from tests.gpu.helpers import row_relative_error
from tests.kernels.test_mxfp4_kernels import extreme_scales, random_problem

TOL = 1e-2
N, K = 256, 512
GROUPS = {"decode": [20, 0, 9], "verify": [20, 0, 60], "prefill": [20, 0, 250]}  # 9.7, 27 and 90 rows per expert
ORDERS = {"checkpoint": lambda p: p, "pairs": to_pair_halves, "words": to_word_order}


def problem(regime, extreme, narrow=False, x_dtype=jnp.bfloat16):
    group_sizes = GROUPS[regime]
    x, packed, scales, gs = random_problem(7, group_sizes, sum(group_sizes) + 3, n=N, k=K,
                                           scale_range=(100, 129) if narrow else (120, 134))
    if extreme:
        x, scales = extreme_scales(x, scales)
    assert scales_are_narrow(scales) == narrow
    return x.astype(x_dtype), packed, scales, gs


CASES = {f"{order}_{regime}{'_extreme_scales' if extreme else ''}{'_narrow' if narrow else ''}":
         (order, regime, extreme, narrow)
         for order in ORDERS for regime in GROUPS for extreme, narrow in ((False, False), (True, False))
         } | {f"words_{regime}_narrow": ("words", regime, False, True) for regime in GROUPS}


@pytest.mark.kernel("mxfp4_grouped_gemm")
@pytest.mark.parametrize("name", sorted(CASES))
def test_mxfp4_grouped_gemm(name, check):
    order, regime, extreme, narrow = CASES[name]
    x, packed, scales, gs = problem(regime, extreme, narrow)
    want = gemm_ops.mxfp4_grouped_matmul_reference(x, packed, scales, gs)
    got = jax.jit(lambda x, p, s, g: gemm_ops.mxfp4_grouped_matmul_concat(
        x, ((p, s),), g, byte_order=order, narrow_scales=narrow, impl="pallas"))(x, ORDERS[order](packed), scales, gs)
    check(name, row_relative_error(got, want), TOL)
    check(f"{name} rows past the groups", float(np.abs(np.asarray(got[sum(GROUPS[regime]):], np.float32)).max()),
          0.0)


@pytest.mark.kernel("mxfp4_grouped_gemm")
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_mxfp4_per_row_decode(order, check):
    """A decode step's (token, expert) rows in any order, two matrices (gate and up) in one launch."""
    x, packed, scales, _ = problem("decode", extreme=False)
    _, packed2, scales2, _ = random_problem(8, [1, 1, 1], 3, n=128, k=K)
    rows = jnp.asarray([2, 0, 2, 1, 2, 0, 1, 1], jnp.int32)  # 4 tokens x 2 choices
    x = x[:4]
    got = gemm_ops.mxfp4_grouped_matmul_concat(x, ((ORDERS[order](packed), scales), (ORDERS[order](packed2), scales2)),
                                               row_experts=rows, byte_order=order, impl="pallas")
    want = gemm_ops.mxfp4_grouped_matmul_concat(x, ((packed, scales), (packed2, scales2)), row_experts=rows,
                                                impl="reference")
    check(f"per_row_{order}", row_relative_error(got, want), TOL)


@pytest.mark.kernel("mxfp4_grouped_gemm")
@pytest.mark.parametrize("regime", sorted(GROUPS))
def test_mxfp4_fp32_activations(regime, check):
    """An fp32 model's activations against MXFP4 weights: the decoded tile takes x's dtype (fp32 products)."""
    x, packed, scales, gs = problem(regime, extreme=False, x_dtype=jnp.float32)
    with jax.default_matmul_precision("highest"):
        got = gemm_ops.mxfp4_grouped_matmul(x, packed, scales, gs, impl="pallas")
        want = gemm_ops.mxfp4_grouped_matmul_reference(x, packed, scales, gs)
    assert got.dtype == jnp.float32
    check(f"fp32_{regime}", row_relative_error(got, want), 1e-4)


@pytest.mark.kernel("bf16_grouped_gemm")
@pytest.mark.parametrize("regime", sorted(GROUPS))
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_bf16_grouped_gemm(regime, transpose_rhs, check):
    group_sizes = GROUPS[regime]
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((sum(group_sizes) + 3, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, K, N)) * K**-0.5, jnp.bfloat16)
    gs = jnp.asarray(group_sizes, jnp.int32)
    got = gemm_ops.grouped_matmul(x, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, gs, transpose_rhs=transpose_rhs,
                                  impl="pallas")
    want = gemm_ops.grouped_matmul_reference(x, w, gs)
    check(f"bf16_{regime}{'_nk' if transpose_rhs else ''}", row_relative_error(got[:sum(group_sizes)],
                                                                               want[:sum(group_sizes)]), TOL)


@pytest.mark.kernel("mxfp4_mgpu")
@pytest.mark.skipif(not on_hopper(), reason="the Mosaic-GPU kernel needs wgmma and TMA (sm_90)")
@pytest.mark.parametrize("regime", ["decode", "prefill", "per_row"])
def test_mxfp4_mgpu(regime, check):
    """The Mosaic-GPU layout through the public op: 16-row tiles at decode, 128-row tiles over two warpgroups at
    prefill (whose 4 stages need 324 KB: 2 are taken), every (token, expert) row its own tile."""
    from pallas_kernels.mxfp4.decode_mgpu import prepare_weights

    x, packed, scales, gs = problem("decode" if regime == "per_row" else regime, extreme=regime != "per_row")
    prepared = prepare_weights(packed, scales)
    if regime == "per_row":
        rows = jnp.asarray([2, 0, 2, 1, 2, 0, 1, 1], jnp.int32)
        got = gemm_ops.mxfp4_grouped_matmul_concat(x[:4], (prepared,), row_experts=rows, byte_order="mgpu",
                                                   impl="pallas")
        want = gemm_ops.mxfp4_grouped_matmul_concat(x[:4], ((packed, scales),), row_experts=rows, impl="reference")
    else:
        got = gemm_ops.mxfp4_grouped_matmul_concat(x, (prepared,), gs, byte_order="mgpu", impl="pallas")
        want = gemm_ops.mxfp4_grouped_matmul_reference(x, packed, scales, gs)
    check(f"mgpu_{regime}", row_relative_error(got, want), TOL)
