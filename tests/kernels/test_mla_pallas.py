"""Pallas MLA kernels (interpret mode on CPU) against the pure-jnp references, on tiny shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import NO_KEY_LSE, mla_paged_attention, write_latent_cache_fp8
from pallas_kernels.mla import MLADecodeConfig, MLAPrefillConfig
from pallas_kernels.mla.attention import choose_tiling, mla_paged_attention_pallas
from pallas_kernels.mla.prefill import mla_prefill_attention_pallas
from pallas_kernels.mla.reference import mla_paged_attention_reference, mla_prefill_attention_reference
from pallas_kernels.mla.testing import make_paged_batch

R, K_ROPE, H = 32, 16, 4
W = R + K_ROPE
SCALE = W**-0.5
# fp32 inputs: kernel and reference differ in summation order and the online-softmax rescaling only.
TOL = dict(rtol=2e-4, atol=2e-5)


@pytest.fixture(autouse=True)
def ieee_fp32_products():
    """fp32 products in IEEE fp32 on every backend (on GPU, XLA's and the interpreted kernel's default is TF32)."""
    with jax.default_matmul_precision("highest"):
        yield


def _attend(batch, impl, **kwargs):
    args = map(jnp.asarray, (batch.q, batch.pages, batch.block_tables, batch.context_lens, batch.cu_q_lens))
    if impl == "reference":
        fn = functools.partial(mla_paged_attention_reference, scale=SCALE, kv_lora_rank=R)
        fn = jax.jit(fn)
    else:
        fn = functools.partial(mla_paged_attention_pallas, scale=SCALE, kv_lora_rank=R, interpret=True,
                               config=MLADecodeConfig(**kwargs))
    return [np.asarray(x) for x in fn(*args)]


CASES = {
    # name: (context_lens incl. new tokens, q_lens, num_tokens, block_size, kernel tiling)
    "decode_splits": ([37, 5, 64, 0], [1, 1, 1, 0], 5, 16, dict(block_q=4, block_h=4, block_k=16, num_splits=2)),
    "spec_and_chunk_bs64": ([70, 9, 130], [8, 3, 5], 18, 64, dict(block_q=4, block_h=4, block_k=32, num_splits=2)),
    "prefill_no_prefix_one_split": ([23, 1], [23, 1], 24, 16, dict(block_q=8, block_h=2, block_k=16, num_splits=1)),
    # choose_tiling's short-decode tiling: 16-head programs over 4 heads, 2 splits (the 5-token one's second empty)
    "decode_auto_short": ([37, 5, 64], [1, 1, 1], 3, 16, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_absorbed_kernel_matches_reference(case):
    context_lens, q_lens, num_tokens, block_size, tiling = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    batch = make_paged_batch(
        rng, context_lens, q_lens, num_heads=H, width=W, block_size=block_size, num_tokens=num_tokens
    )
    o, lse = _attend(batch, "pallas", **tiling)
    want_o, want_lse = _attend(batch, "reference")
    assert np.isfinite(o).all() and np.isfinite(lse).all()  # NaN-poisoned foreign pages never read
    np.testing.assert_allclose(o, want_o, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    assert np.all(lse[int(batch.cu_q_lens[-1]) :] == np.float32(NO_KEY_LSE))


def test_short_decode_tiling():
    """Decode over a short cache: 16 heads per program and splits of >= 32 keys toward ~128 programs (the H200
    probe's fastest); long caches and multi-token tiles keep the 32-row tiling."""
    pick = lambda *a: {k: choose_tiling(*a)[k] for k in ("block_q", "block_h", "num_splits")}  # noqa: E731
    assert pick(1, 1, 32, 560) == dict(block_q=1, block_h=16, num_splits=16)
    assert pick(1, 1, 32, 4096) == dict(block_q=1, block_h=16, num_splits=32)
    assert pick(16, 16, 32, 560) == dict(block_q=1, block_h=16, num_splits=4)
    assert pick(1, 1, 32, 40) == dict(block_q=1, block_h=16, num_splits=1)
    assert pick(16, 16, 32, 32768)["block_h"] == 32
    assert pick(64, 16, 32, 560)["block_h"] == 32


def test_absorbed_kernel_fp8_cache_and_stacked_layer():
    """fp8 pages with per-token scales, read from layer 1 of a stacked [L, ...] cache; bf16 queries.
    Same dequantised cache on both sides: bf16 q and bf16 probabilities bound the error (<= 2e-2)."""
    rng = np.random.default_rng(11)
    batch = make_paged_batch(rng, [45, 20], [2, 5], num_heads=H, width=W, block_size=16, poison=False)
    nb, bs, _ = batch.pages.shape
    pages8 = jnp.zeros((2, nb, bs, W), jnp.float8_e4m3fn)
    scales = jnp.ones((2, nb, bs), jnp.float32)
    slots = jnp.arange(nb * bs, dtype=jnp.int32)
    pages8, scales = write_latent_cache_fp8(pages8, scales, jnp.asarray(batch.pages.reshape(-1, W)), slots, layer=1)
    q = jnp.asarray(batch.q, jnp.bfloat16)
    args = (q, pages8, jnp.asarray(batch.block_tables), jnp.asarray(batch.context_lens), jnp.asarray(batch.cu_q_lens))
    kwargs = dict(scale=SCALE, kv_lora_rank=R, page_scales=scales, layer=1)
    o, lse = mla_paged_attention_pallas(*args, **kwargs, config=MLADecodeConfig(block_q=4, block_h=4, block_k=16),
                                        interpret=True)
    want_o, want_lse = mla_paged_attention(*args, **kwargs, impl="reference")
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want_o, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-2, atol=2e-2)


def test_unabsorbed_prefill_kernel_matches_reference():
    """Packed up-projected keys (NaN past the last sequence), a sequence with no queries, padding queries."""
    rng = np.random.default_rng(13)
    k_nope_dim, k_rope, v_dim, heads = 16, 16, 16, 2
    kv_lens, q_lens = np.array([40, 6, 17, 5]), np.array([9, 0, 17, 1])
    num_keys, num_tokens = kv_lens.sum() + 3, q_lens.sum() + 2
    q = rng.standard_normal((num_tokens, heads, k_nope_dim + k_rope)).astype(np.float32)
    k_nope = rng.standard_normal((num_keys, heads, k_nope_dim)).astype(np.float32)
    k_pe = rng.standard_normal((num_keys, k_rope)).astype(np.float32)
    v = rng.standard_normal((num_keys, heads, v_dim)).astype(np.float32)
    k_nope[-3:], v[-3:], q[-2:] = np.nan, np.nan, np.nan
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    args = [jnp.asarray(x) for x in (q, k_nope, k_pe, v, cu_q, cu_kv)]
    o, lse = mla_prefill_attention_pallas(*args, scale=0.3, config=MLAPrefillConfig(block_q=16, block_k=16),
                                          interpret=True)
    want_o, want_lse = jax.jit(functools.partial(mla_prefill_attention_reference, scale=0.3))(*args)
    assert np.isfinite(np.asarray(o)).all()
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), **TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **TOL)
