"""The wide Mosaic-GPU MLA decode kernel (65-96 (token, head) rows per sequence) against the jnp reference: in
Mosaic-GPU's interpreter on a CPU, for real on a GPU. Tolerances as in ``test_mla_mgpu.py`` (P rounded to bf16 for
the ``P V`` wgmma, o rounded to bf16: 1e-2 absolute + 1e-2 relative; fp32 scores: lse to 1e-4)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import MLADecodeMGPUConfig
from pallas_kernels.mla.decode_mgpu import RANK, WIDTH
from pallas_kernels.mla.decode_mgpu_wide import mla_decode_mgpu_wide, rows_fit, smem_bytes
from pallas_kernels.mla.reference import NO_KEY_LSE

from .test_mla_mgpu import O_TOL, SCALE, decode_batch, reference


@pytest.mark.parametrize("context_lens,num_heads,block_size,splits,q_len,stages", [
    ([150, 1, 64, 0], 96, 64, 2, 1, 2),  # K3's 96 heads: rows 32-63 formed by both warpgroups; empty context
    ([150, 1, 64, 0], 96, 64, 2, 1, 3),  # the same with 3 stages and one P buffer
    ([37, 200], 80, 32, 3, 1, 2),        # 80 rows (48 formed twice), 32-token pages, 3 splits (one empty)
    ([70, 3, 129], 40, 64, 1, 2, 3),     # verification: 2 causal tokens x 40 heads; a token's heads in both halves
    ([95], 33, 128, 2, 2, 2),            # 66 rows padded to 72; 4 steps per page
])
def test_decode_matches_reference(context_lens, num_heads, block_size, splits, q_len, stages, rng):
    batch = decode_batch(rng, context_lens, num_heads, block_size, q_len)
    pages = jnp.asarray(batch.pages, jnp.bfloat16)
    o, lse = mla_decode_mgpu_wide(jnp.asarray(batch.q, jnp.bfloat16), pages, jnp.asarray(batch.block_tables),
                                  jnp.asarray(batch.context_lens), scale=SCALE, q_len=q_len,
                                  config=MLADecodeMGPUConfig(splits=splits, wide_stages=stages))
    want_o, want_lse = reference(batch, pages)
    assert o.shape == (len(context_lens) * q_len, num_heads, RANK) and o.dtype == jnp.bfloat16
    o = np.asarray(o, np.float32)
    assert np.isfinite(o).all() and np.isfinite(np.asarray(lse)).all()  # NaN pages never meet a probability
    np.testing.assert_allclose(o, want_o, **O_TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-4)
    empty = np.repeat(np.asarray(context_lens) == 0, q_len)
    assert np.all(np.asarray(lse)[empty] == NO_KEY_LSE) and not o[empty].any()


def test_layer_of_stacked_pages_and_bad_arguments(rng):
    """``layer`` reads one layer of [L, B, bs, 576] in place (the other layer NaN); row counts outside 65-96,
    f32 pages and 16-token pages are clear errors."""
    batch = decode_batch(rng, [70, 5], 96, 64)
    pages = jnp.asarray(batch.pages, jnp.bfloat16)
    stacked = jnp.stack([jnp.full_like(pages, jnp.nan), pages])
    o, lse = mla_decode_mgpu_wide(jnp.asarray(batch.q, jnp.bfloat16), stacked, jnp.asarray(batch.block_tables),
                                  jnp.asarray(batch.context_lens), scale=SCALE, layer=1)
    want_o, want_lse = reference(batch, pages)
    np.testing.assert_allclose(np.asarray(o, np.float32), want_o, **O_TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-4)
    q = jnp.zeros((2, 96, WIDTH), jnp.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        mla_decode_mgpu_wide(q[:, :64], pages, batch.block_tables, batch.context_lens, scale=SCALE)
    with pytest.raises(ValueError, match="rows"):
        mla_decode_mgpu_wide(jnp.zeros((2, 128, WIDTH), jnp.bfloat16), pages, batch.block_tables,
                             batch.context_lens, scale=SCALE)
    with pytest.raises(ValueError, match="bf16 pages"):
        mla_decode_mgpu_wide(q, pages.astype(jnp.float32), batch.block_tables, batch.context_lens, scale=SCALE)
    with pytest.raises(ValueError, match="wide_stages"):
        mla_decode_mgpu_wide(q, pages, batch.block_tables, batch.context_lens, scale=SCALE,
                             config=MLADecodeMGPUConfig(wide_stages=4))
    with pytest.raises(ValueError, match="multiple of 32"):
        mla_decode_mgpu_wide(q, pages[:, :16], batch.block_tables, batch.context_lens, scale=SCALE)


def test_rows_fit_and_shared_memory():
    assert [rows_fit(1, h) for h in (64, 65, 96, 97)] == [False, True, True, False]
    assert rows_fit(2, 48) and not rows_fit(2, 32)
    limit = 232_448  # the H200's (and H100's) opt-in shared memory per block
    assert smem_bytes(96, stages=2) <= limit and smem_bytes(96, stages=3) <= limit
    assert smem_bytes(96, stages=3) + 6144 > limit  # a second P buffer [96, 32] bf16 would not fit with 3 stages


@pytest.mark.parametrize("num_heads,stages", [(96, 2), (96, 3), (72, 2)])
def test_kernel_lowers_for_cuda(num_heads, stages):
    """``jax.export`` for CUDA runs Mosaic-GPU's lowering (layout inference, the transposed ``V^T`` operand, TMA
    shapes, shared-memory budget) on the CPU: batch 16, 32K context, 64-token pages of a layer stack."""
    from jax import export

    S = jax.ShapeDtypeStruct
    fn = functools.partial(mla_decode_mgpu_wide, scale=SCALE, layer=2, interpret=False,
                           config=MLADecodeMGPUConfig(wide_stages=stages))
    args = [S((16, num_heads, WIDTH), jnp.bfloat16), S((4, 9000, 64, WIDTH), jnp.bfloat16),
            S((16, 512), jnp.int32), S((16,), jnp.int32)]
    module = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in module and "wgmma.mma_async" in module

