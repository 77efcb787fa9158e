"""The Mosaic-GPU MLA decode kernel against the jnp reference: in Mosaic-GPU's interpreter on a CPU, for real on
a GPU.

Tolerance: the kernel rounds the softmax probabilities to bf16 for the P @ V wgmma (relative 2**-9 per term) and
the reference keeps them in fp32, and both round o to bf16 (one ulp apart is 2**-8 relative: 0.016 at 2-4), so o
agrees to 1e-2 absolute plus 1e-2 relative on unit-variance latents; the scores are fp32 accumulations of the
same bf16 products, so the lse agrees to 1e-4."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.impl import on_hopper
from pallas_kernels.mla import MLADecodeMGPUConfig
from pallas_kernels.mla.decode_mgpu import RANK, WIDTH, default_splits, mla_decode_mgpu
from pallas_kernels.mla.reference import NO_KEY_LSE, mla_paged_attention_reference
from pallas_kernels.mla.testing import make_paged_batch

SCALE = WIDTH**-0.5
O_TOL = dict(atol=1e-2, rtol=1e-2)


def decode_batch(rng, context_lens, num_heads, block_size, q_len=1):
    """``q_len`` query tokens per sequence; foreign and unused pages NaN; the rows past a context in its own last
    page finite garbage (what a reused page holds in the engine)."""
    batch = make_paged_batch(rng, context_lens, [q_len] * len(context_lens), num_heads=num_heads, width=WIDTH,
                             block_size=block_size)
    for table, length in zip(batch.block_tables, batch.context_lens):
        if length % block_size:
            last = table[(length - 1) // block_size]
            batch.pages[last, length % block_size:] = rng.standard_normal((block_size - length % block_size, WIDTH))
    return batch


def reference(batch, pages):
    o, lse = mla_paged_attention_reference(jnp.asarray(batch.q, jnp.bfloat16), pages, jnp.asarray(batch.block_tables),
                                           jnp.asarray(batch.context_lens), jnp.asarray(batch.cu_q_lens),
                                           scale=SCALE, kv_lora_rank=RANK)
    return np.asarray(o, np.float32), np.asarray(lse)


@pytest.mark.parametrize("context_lens,num_heads,block_size,splits,q_len", [
    ([150, 1, 64, 0], 16, 64, 2, 1),  # heads padded to 64 rows; one-token and empty contexts; 2 KV splits
    ([37, 200], 80, 128, 3, 1),       # two head blocks (the second half padding), 2 steps per page, 3 splits
    ([70, 3, 130], 16, 64, 2, 3),     # verification: 3 causal tokens x 16 heads = 48 rows
    ([66, 129], 40, 64, 1, 2),        # 2 tokens x 40 heads = 80 rows: a token's heads span two head blocks
])
def test_decode_matches_reference(context_lens, num_heads, block_size, splits, q_len, rng):
    batch = decode_batch(rng, context_lens, num_heads, block_size, q_len)
    pages = jnp.asarray(batch.pages, jnp.bfloat16)
    o, lse = mla_decode_mgpu(jnp.asarray(batch.q, jnp.bfloat16), pages, jnp.asarray(batch.block_tables),
                             jnp.asarray(batch.context_lens), scale=SCALE, q_len=q_len,
                             config=MLADecodeMGPUConfig(splits=splits))
    want_o, want_lse = reference(batch, pages)
    assert o.shape == (len(context_lens) * q_len, num_heads, RANK) and o.dtype == jnp.bfloat16
    o = np.asarray(o, np.float32)
    assert np.isfinite(o).all() and np.isfinite(np.asarray(lse)).all()  # NaN pages never meet a probability
    np.testing.assert_allclose(o, want_o, **O_TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-4)
    empty = np.repeat(np.asarray(context_lens) == 0, q_len)
    assert np.all(np.asarray(lse)[empty] == NO_KEY_LSE) and not o[empty].any()


def test_layer_of_stacked_pages_and_bad_arguments(rng):
    """``layer`` reads one layer of [L, B, bs, 576] in place (the other layer is NaN); wrong widths, dtypes and
    page sizes are clear errors."""
    batch = decode_batch(rng, [70, 5], 8, 64)
    pages = jnp.asarray(batch.pages, jnp.bfloat16)
    stacked = jnp.stack([jnp.full_like(pages, jnp.nan), pages])
    o, lse = mla_decode_mgpu(jnp.asarray(batch.q, jnp.bfloat16), stacked, jnp.asarray(batch.block_tables),
                             jnp.asarray(batch.context_lens), scale=SCALE, layer=1)
    want_o, want_lse = reference(batch, pages)
    np.testing.assert_allclose(np.asarray(o, np.float32), want_o, **O_TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-4)
    q = jnp.zeros((2, 8, WIDTH), jnp.bfloat16)
    with pytest.raises(ValueError, match="bf16 pages"):
        mla_decode_mgpu(q, pages.astype(jnp.float32), batch.block_tables, batch.context_lens, scale=SCALE)
    with pytest.raises(ValueError, match="multiple of 64"):
        mla_decode_mgpu(q, pages[:, :48], batch.block_tables, batch.context_lens, scale=SCALE)
    with pytest.raises(ValueError, match="q_len=2"):
        mla_decode_mgpu(q, pages, batch.block_tables, batch.context_lens, scale=SCALE, q_len=2)


def test_tables_sliced_from_a_packed_buffer(rng):
    """Block tables and context lengths that are unaligned slices of one int32 buffer (as the engine's packed step
    words are) inside a jit give the reference's result."""
    batch = decode_batch(rng, [150, 70], 32, 64)
    pages = jnp.asarray(batch.pages, jnp.bfloat16)
    tables = np.asarray(batch.block_tables, np.int32)
    words = jnp.asarray(np.concatenate([[7], tables.ravel(), np.asarray(batch.context_lens, np.int32)]))

    @jax.jit
    def run(q, pages, words):
        tables_view = words[1:1 + tables.size].reshape(tables.shape)
        return mla_decode_mgpu(q, pages, tables_view, words[1 + tables.size:], scale=SCALE,
                               config=MLADecodeMGPUConfig(splits=2))

    o, lse = run(jnp.asarray(batch.q, jnp.bfloat16), pages, words)
    want_o, want_lse = reference(batch, pages)
    np.testing.assert_allclose(np.asarray(o, np.float32), want_o, **O_TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-4)


def test_index_operands_are_computed_buffers():
    """Mosaic-GPU's custom call rejects operands off a 256-byte boundary, and XLA may hand a custom call a slice of
    a larger buffer in place: the 27-layer engine's batch-64 warm-up failed so with 64-token pages (a small
    graph like the test above did not reproduce it on the H200). The kernel's block-table and
    context-length operands must therefore be results of a computation (a max with 0), never slices or
    reshapes of its inputs: checked in the CUDA lowering."""
    import re

    from jax import export

    S = jax.ShapeDtypeStruct

    def run(q, pages, words):
        return mla_decode_mgpu(q, pages, words[1:129].reshape(16, 8), words[129:145], scale=SCALE, interpret=False)

    module = export.export(jax.jit(run), platforms=["cuda"])(
        S((16, 32, WIDTH), jnp.bfloat16), S((64, 64, WIDTH), jnp.bfloat16), S((200,), jnp.int32)).mlir_module()
    call = re.search(r"custom_call @mosaic_gpu\w*\((%\w+), (%\w+), (%\w+), (%\w+)\)", module)
    assert call is not None
    for name in call.groups()[2:]:
        assert re.search(rf"{name} = stablehlo\.maximum ", module), f"operand {name} is not a computed buffer"


def test_default_splits_fill_one_wave_without_empty_splits():
    assert default_splits(16, 1, 512) == 8  # batch 16, H=32, 32K context in 64-key steps: 128 CTAs
    assert default_splits(64, 2, 512) == 1  # batch 64, H=96: 128 CTAs already
    assert default_splits(1, 1, 2048) == 132  # batch 1, 128K context
    assert default_splits(1, 1, 5) == 5  # never more splits than tiles


@pytest.mark.parametrize("num_heads,stages", [(32, 2), (96, 2)])
def test_kernel_lowers_for_cuda(num_heads, stages):
    """``jax.export`` for CUDA runs Mosaic-GPU's lowering (layout inference, wgmma and TMA shapes, shared-memory
    budget checks) on the CPU: K3 per-device (H=32) and unsharded (H=96, two head blocks) decode at batch 16, 32K
    context, with 64-token pages of a layer stack."""
    import functools

    import jax
    from jax import export

    S = jax.ShapeDtypeStruct
    fn = functools.partial(mla_decode_mgpu, scale=SCALE, layer=2, config=MLADecodeMGPUConfig(stages=stages),
                           interpret=False)
    args = [S((16, num_heads, WIDTH), jnp.bfloat16), S((4, 9000, 64, WIDTH), jnp.bfloat16), S((16, 512), jnp.int32),
            S((16,), jnp.int32)]
    module = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in module and "wgmma.mma_async" in module


def _routed_case(rng, monkeypatch):
    """A decode batch (one query token of 32 heads per sequence, the last sequence the batch's padding: empty
    context) over 64-token pages, with the short-context threshold lowered so that the small batch counts as long."""
    from pallas_kernels.mla import attention

    monkeypatch.setattr(attention, "SHORT_KV_TOKENS", 64)
    return decode_batch(rng, [150, 70, 0], 32, 64)


def test_decode_steps_route_to_the_mgpu_kernel(rng, monkeypatch):
    """``mla_paged_attention(..., decode_q_len=1)`` under Pallas takes the Mosaic-GPU kernel when it fits (and gives
    the reference's result, padding sequence included); without ``decode_q_len`` it keeps the Triton kernel."""
    from pallas_kernels import mla as mla_ops
    from pallas_kernels.mla import decode_mgpu

    batch = _routed_case(rng, monkeypatch)
    calls = []
    real = decode_mgpu.mla_decode_mgpu
    monkeypatch.setattr(decode_mgpu, "mla_decode_mgpu", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(mla_ops, "MGPU_DECODE", True)
    pages = jnp.asarray(batch.pages, jnp.bfloat16)
    args = (jnp.asarray(batch.q, jnp.bfloat16), pages, jnp.asarray(batch.block_tables),
            jnp.asarray(batch.context_lens), jnp.asarray(batch.cu_q_lens))
    o, lse = mla_ops.mla_paged_attention(*args, scale=SCALE, kv_lora_rank=RANK, decode_q_len=1, impl="pallas")
    assert len(calls) == 1 and calls[0]["q_len"] == 1
    want_o, want_lse = reference(batch, pages)
    np.testing.assert_allclose(np.asarray(o, np.float32), want_o, **O_TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(lse)[2] == NO_KEY_LSE)  # the padding sequence
    mla_ops.mla_paged_attention(*args, scale=SCALE, kv_lora_rank=RANK, impl="pallas")
    assert len(calls) == 1
    monkeypatch.setattr(mla_ops, "MGPU_DECODE", False)
    mla_ops.mla_paged_attention(*args, scale=SCALE, kv_lora_rank=RANK, decode_q_len=1, impl="pallas")
    assert len(calls) == 1
    monkeypatch.setattr(mla_ops, "MGPU_DECODE", None)  # None: on Hopper GPUs only
    mla_ops.mla_paged_attention(*args, scale=SCALE, kv_lora_rank=RANK, decode_q_len=1, impl="pallas")
    assert len(calls) == (2 if on_hopper() else 1)


def test_mgpu_decode_fits_only_its_contract(rng, monkeypatch):
    """fp8 pages, f32 pages or queries, 16-token pages, other latent widths, more than 8 query tokens, a row count
    that is not N * q_len, fewer than 32 (token, head) rows per sequence, and short batches (the Triton kernel's
    short-context tiling) keep the Triton kernel."""
    from pallas_kernels.mla import attention, mgpu_decode_fits

    batch = _routed_case(rng, monkeypatch)
    q, tables = jnp.asarray(batch.q, jnp.bfloat16), jnp.asarray(batch.block_tables)
    pages = jnp.asarray(batch.pages, jnp.bfloat16)
    fits = lambda q=q, pages=pages, tables=tables, rank=RANK, scales=None, q_len=1: mgpu_decode_fits(
        q, pages, tables, kv_lora_rank=rank, page_scales=scales, q_len=q_len)
    assert fits()
    assert not fits(scales=jnp.ones(pages.shape[:2], jnp.float32))
    assert not fits(pages=pages.astype(jnp.float32))
    assert not fits(q=q.astype(jnp.float32))
    assert not fits(pages=pages.reshape(-1, 16, WIDTH), tables=jnp.repeat(tables, 4, axis=1))
    assert not fits(rank=448)
    assert not fits(q=q[:2])
    assert not fits(q=jnp.repeat(q, 9, axis=0), q_len=9)
    assert fits(q=jnp.repeat(q, 8, axis=0), q_len=8)
    assert not fits(q=q[:, :12])  # 12 heads: fewer rows than MIN_ROWS, where the Triton kernel is faster
    assert fits(q=jnp.repeat(q[:, :12], 3, axis=0), q_len=3)  # 3 verified tokens x 12 heads = 36 rows
    monkeypatch.setattr(attention, "SHORT_KV_TOKENS", 3 * tables.shape[1] * 64)
    assert not fits()
