"""The pure-jnp MLA reference (paged cache write + absorbed attention) against a per-sequence numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import (
    NO_KEY_LSE,
    gather_latent,
    merge_partials,
    mla_paged_attention,
    mla_prefill_attention,
    quantize_latent_fp8,
    write_latent_cache,
    write_latent_cache_fp8,
)
from pallas_kernels.mla.testing import make_paged_batch, naive_mla_attention

R, K_ROPE, H = 32, 16, 4
W = R + K_ROPE
SCALE = W**-0.5
# fp32 reference vs float64 oracle: only summation order differs (softmax over <= 200 keys).
TOL = dict(rtol=1e-4, atol=1e-5)

CASES = {
    # name: (context_lens incl. new tokens, q_lens, padded num_tokens, block_size)
    "decode_one_token": ([37, 5, 64], [1, 1, 1], 4, 16),
    "decode_one_token_bs64": ([37, 5, 130], [1, 1, 1], 4, 64),
    "spec_verify": ([20, 33, 9], [4, 8, 3], 16, 16),
    "prefill_no_prefix": ([23, 1], [23, 1], 24, 16),
    "chunked_prefill_bs64": ([70, 17], [19, 17], 40, 64),
    "varied_lengths_with_empty": ([190, 1, 0, 45, 3, 121], [2, 1, 0, 45, 1, 5], 60, 16),
}


def _run(batch, **kwargs):
    args = (batch.q, batch.pages, batch.block_tables, batch.context_lens, batch.cu_q_lens)
    fn = jax.jit(lambda *a: mla_paged_attention(*a, scale=SCALE, kv_lora_rank=R, impl="reference", **kwargs))
    return [np.asarray(x) for x in fn(*map(jnp.asarray, args))]


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_oracle(case):
    context_lens, q_lens, num_tokens, block_size = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    batch = make_paged_batch(
        rng, context_lens, q_lens, num_heads=H, width=W, block_size=block_size, num_tokens=num_tokens
    )
    o, lse = _run(batch)
    want_o, want_lse = naive_mla_attention(batch, scale=SCALE, kv_lora_rank=R)
    real = int(batch.cu_q_lens[-1])
    assert o.shape == (num_tokens, H, R) and lse.shape == (num_tokens, H) and lse.dtype == np.float32
    np.testing.assert_allclose(o[:real], want_o[:real], **TOL)
    np.testing.assert_allclose(lse[:real], want_lse[:real], **TOL)
    np.testing.assert_array_equal(o[real:], 0.0)  # NaN-poisoned padding queries give zeros
    np.testing.assert_array_equal(lse[real:], np.float32(NO_KEY_LSE))


def test_reference_chunked_queries_match_single_pass(monkeypatch):
    """The lax.map path over query chunks (used for long prefill) agrees with the one-shot path."""
    from pallas_kernels.mla import reference

    rng = np.random.default_rng(3)
    batch = make_paged_batch(rng, [50, 31], [13, 31], num_heads=H, width=W, block_size=16, num_tokens=48)
    o_once, lse_once = _run(batch)
    monkeypatch.setattr(reference, "_REFERENCE_CHUNK_BYTES", 1)  # one token per chunk
    o_chunk, lse_chunk = _run(batch)
    np.testing.assert_allclose(o_chunk, o_once, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse_chunk, lse_once, rtol=1e-6, atol=1e-6)


def test_reference_stacked_layers_select_one_layer():
    rng = np.random.default_rng(4)
    batch = make_paged_batch(rng, [30, 12], [3, 1], num_heads=H, width=W, block_size=16)
    other = rng.standard_normal(batch.pages.shape).astype(np.float32)
    o, lse = _run(batch)
    stacked = np.stack([other, batch.pages])
    args = (batch.q, stacked, batch.block_tables, batch.context_lens, batch.cu_q_lens)
    attend = jax.jit(lambda *a: mla_paged_attention(*a, scale=SCALE, kv_lora_rank=R, layer=1, impl="reference"))
    o1, lse1 = attend(*map(jnp.asarray, args))
    np.testing.assert_array_equal(np.asarray(o1), o)
    np.testing.assert_array_equal(np.asarray(lse1), lse)


def test_write_latent_cache_scatters_and_skips_padding():
    rng = np.random.default_rng(5)
    pages = rng.standard_normal((3, 4, W)).astype(np.float32)
    latent = rng.standard_normal((5, W)).astype(np.float32)
    slots = np.array([9, -1, 0, 11, -1], np.int32)
    write = jax.jit(write_latent_cache, donate_argnums=0)
    got = np.asarray(write(jnp.asarray(pages), jnp.asarray(latent), jnp.asarray(slots)))
    want = pages.reshape(12, W).copy()
    want[[9, 0, 11]] = latent[[0, 2, 3]]
    np.testing.assert_array_equal(got, want.reshape(3, 4, W))


def test_write_latent_cache_stacked_layer_touches_only_that_layer():
    rng = np.random.default_rng(6)
    pages = rng.standard_normal((2, 3, 4, W)).astype(np.float32)
    latent = rng.standard_normal((2, W)).astype(np.float32)
    slots = np.array([5, -1], np.int32)
    got = np.asarray(write_latent_cache(jnp.asarray(pages), jnp.asarray(latent), jnp.asarray(slots), layer=1))
    want = pages.copy()
    want[1, 1, 1] = latent[0]
    np.testing.assert_array_equal(got, want)


def test_fp8_cache_round_trip_and_attention():
    """e4m3 keeps 3 mantissa bits: per-element relative error <= 2^-4 (half an ulp). Attention over the
    dequantised cache matches the oracle on the same dequantised rows to fp32 accuracy, and stays near the
    exact-cache result: mean |error| < 2e-2, max < 0.15 (unit-variance inputs; measured ~7e-3 / 7e-2)."""
    rng = np.random.default_rng(7)
    batch = make_paged_batch(rng, [40, 19], [2, 19], num_heads=H, width=W, block_size=16, poison=False)
    nb, bs, _ = batch.pages.shape
    pages8 = jnp.zeros((nb, bs, W), jnp.float8_e4m3fn)
    scales = jnp.ones((nb, bs), jnp.float32)
    slots = np.arange(nb * bs, dtype=np.int32)
    pages8, scales = jax.jit(write_latent_cache_fp8)(pages8, scales, jnp.asarray(batch.pages.reshape(-1, W)), slots)
    dequant = np.asarray(pages8.astype(jnp.float32)) * np.asarray(scales)[..., None]
    amax = np.abs(batch.pages).max(-1, keepdims=True)
    assert np.all(np.abs(dequant - batch.pages) <= 2.0**-4 * np.maximum(np.abs(batch.pages), amax / 448 * 2**-2))
    args = (batch.q, pages8, batch.block_tables, batch.context_lens, batch.cu_q_lens)
    attend = jax.jit(lambda *a, **k: mla_paged_attention(*a, scale=SCALE, kv_lora_rank=R, impl="reference", **k))
    o, lse = attend(*map(jnp.asarray, args), page_scales=scales)
    want_o, want_lse = naive_mla_attention(batch, scale=SCALE, kv_lora_rank=R, pages=dequant)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-4, atol=1e-5)
    exact_o, _ = naive_mla_attention(batch, scale=SCALE, kv_lora_rank=R)
    err = np.abs(np.asarray(o) - exact_o)
    assert err.mean() < 2e-2 and err.max() < 0.15, (err.mean(), err.max())


def test_quantize_latent_fp8_zero_row_is_exact():
    rows, scales = quantize_latent_fp8(jnp.zeros((2, W)))
    assert np.all(np.asarray(rows.astype(jnp.float32)) == 0) and np.all(np.asarray(scales) == 1.0)


def test_merge_partials_equals_attention_over_union():
    """Attention over keys split into two disjoint sets, merged by LSE, equals attention over all keys;
    a part with no key (NO_KEY_LSE) contributes nothing, and all-empty rows stay 0 / NO_KEY_LSE."""
    rng = np.random.default_rng(12)
    scores = rng.standard_normal((3, 2, 10)).astype(np.float32)
    values = rng.standard_normal((10, 5)).astype(np.float32)

    def attend(sl):
        s = scores[..., sl]
        lse = np.log(np.exp(s).sum(-1))
        return np.exp(s - lse[..., None]) @ values[sl], lse

    (o_a, l_a), (o_b, l_b), (o_all, l_all) = attend(slice(0, 4)), attend(slice(4, 10)), attend(slice(0, 10))
    empty_o, empty_l = np.zeros_like(o_a), np.full_like(l_a, NO_KEY_LSE)
    o, lse = merge_partials(jnp.asarray(np.stack([o_a, empty_o, o_b])), jnp.asarray(np.stack([l_a, empty_l, l_b])))
    np.testing.assert_allclose(np.asarray(o), o_all, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), l_all, rtol=1e-5, atol=1e-6)
    o, lse = merge_partials(jnp.asarray(np.stack([empty_o, empty_o])), jnp.asarray(np.stack([empty_l, empty_l])))
    assert np.all(np.asarray(o) == 0) and np.all(np.asarray(lse) == np.float32(NO_KEY_LSE))


def test_unabsorbed_form_equals_absorbed_form():
    """MLA identity (spec 2.2): attention with k_nope = W_UK c_kv, v = W_UV c_kv over the gathered context equals
    the absorbed attention with q_lat = W_UK^T q_nope followed by W_UV; same scores, so the same lse too."""
    rng = np.random.default_rng(14)
    k_nope_dim, v_dim = 16, 16
    context_lens, q_lens = [40, 1, 0, 21], [7, 1, 0, 21]
    batch = make_paged_batch(rng, context_lens, q_lens, num_heads=H, width=W, block_size=16)
    w_uk = rng.standard_normal((H, k_nope_dim, R)).astype(np.float32) * R**-0.5
    w_uv = rng.standard_normal((H, v_dim, R)).astype(np.float32) * R**-0.5
    q_nope = rng.standard_normal((batch.q.shape[0], H, k_nope_dim)).astype(np.float32)
    q_pe = batch.q[..., R:]
    hi = jax.lax.Precision.HIGHEST

    @jax.jit
    def both(pages, tables, ctx, cu_q):
        q_abs = jnp.concatenate([jnp.einsum("thk,hkr->thr", q_nope, w_uk, precision=hi), q_pe], axis=-1)
        o_lat, lse_abs = mla_paged_attention(q_abs, pages, tables, ctx, cu_q, scale=SCALE, kv_lora_rank=R, impl="reference")
        o_abs = jnp.einsum("thr,hvr->thv", o_lat, w_uv, precision=hi)
        cu_kv = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(ctx)]).astype(jnp.int32)
        latent = gather_latent(pages, tables, cu_kv, int(sum(context_lens)) + 5)
        k_nope = jnp.einsum("sr,hkr->shk", latent[:, :R], w_uk, precision=hi)
        v = jnp.einsum("sr,hvr->shv", latent[:, :R], w_uv, precision=hi)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        o, lse = mla_prefill_attention(q, k_nope, latent[:, R:], v, cu_q, cu_kv, scale=SCALE, impl="reference")
        return o_abs, lse_abs, o, lse

    o_abs, lse_abs, o, lse = map(np.asarray, both(*map(jnp.asarray, (batch.pages, batch.block_tables, batch.context_lens, batch.cu_q_lens))))
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, o_abs, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, lse_abs, rtol=1e-4, atol=1e-5)


def test_gather_latent_packs_contexts_and_zeroes_padding():
    rng = np.random.default_rng(15)
    batch = make_paged_batch(rng, [20, 0, 33], [1, 0, 1], num_heads=H, width=W, block_size=16)
    cu_kv = np.array([0, 20, 20, 53], np.int32)
    gather = jax.jit(gather_latent, static_argnums=3)
    got = np.asarray(gather(*map(jnp.asarray, (batch.pages, batch.block_tables, cu_kv)), 56))
    for n, (lo, hi) in enumerate(zip(cu_kv[:-1], cu_kv[1:])):
        want = batch.pages[batch.block_tables[n]].reshape(-1, W)[: hi - lo]
        np.testing.assert_array_equal(got[lo:hi], want)
    np.testing.assert_array_equal(got[53:], 0.0)
