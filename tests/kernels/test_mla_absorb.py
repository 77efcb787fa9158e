"""MLA absorption kernels (interpret mode on CPU) against a float64 numpy computation.

fp32 inputs: both sides sum the same Kn (or R) products; the kernel in fp32 with the MMA's order, so the
difference is fp32 rounding (< 1e-5 relative). bf16: the absorbed query is rounded to bf16 (2**-8 relative),
checked within 1e-2 of the row's largest value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import AbsorbOutputsConfig, AbsorbQueriesConfig, absorb_outputs, absorb_queries
from pallas_kernels.mla.absorb import absorb_outputs_pallas, absorb_queries_pallas

H, KN, KR, V, R, LAYERS = 4, 16, 16, 32, 32, 3


def _weights(rng):
    """kv_b [L, R, H*(Kn+V)] with layer 0 NaN (never read when layer 1 is asked for)."""
    kv_b = rng.standard_normal((LAYERS, R, H * (KN + V))).astype(np.float32)
    kv_b[0] = np.nan
    return kv_b


def _per_head(kv_b, layer):
    w = np.asarray(kv_b[layer], np.float64).reshape(R, H, KN + V)
    return w[..., :KN], w[..., KN:]  # [R, H, Kn], [R, H, V]


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_absorbed_query_and_output_match_float64(tokens):
    """1 and 3 decode rows, and 17 (two row tiles, the second masked)."""
    rng = np.random.default_rng(tokens)
    kv_b = _weights(rng)
    q = rng.standard_normal((tokens, H, KN + KR)).astype(np.float32)
    o_lat = rng.standard_normal((tokens, H, R)).astype(np.float32)
    w_uk, w_uv = _per_head(kv_b, 1)
    want_q = np.concatenate([np.einsum("thn,rhn->thr", q[..., :KN].astype(np.float64), w_uk), q[..., KN:]], -1)
    want_o = np.einsum("thr,rhv->thv", o_lat.astype(np.float64), w_uv)

    got_q = absorb_queries_pallas(jnp.asarray(q), jnp.asarray(kv_b), layer=1, k_nope=KN,
                                  config=AbsorbQueriesConfig(block_r=16))
    got_o = absorb_outputs_pallas(jnp.asarray(o_lat), jnp.asarray(kv_b), layer=1, v_dim=V,
                                  config=AbsorbOutputsConfig(block_k=16))
    assert got_q.shape == (tokens, H, R + KR) and got_o.shape == (tokens, H, V)
    np.testing.assert_allclose(np.asarray(got_q), want_q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_o), want_o, rtol=1e-5, atol=1e-5)
    # the public ops: kernel up to 16 rows, XLA above; same contract (XLA's fp32 GEMMs in IEEE fp32: on GPU its
    # default rounds their inputs to TF32)
    with jax.default_matmul_precision("highest"):
        for impl in ("pallas", "reference"):
            np.testing.assert_allclose(np.asarray(absorb_queries(jnp.asarray(q), jnp.asarray(kv_b), layer=1,
                                                                 k_nope=KN, impl=impl)), want_q, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(absorb_outputs(jnp.asarray(o_lat), jnp.asarray(kv_b), layer=1,
                                                                 v_dim=V, impl=impl)), want_o, rtol=1e-5, atol=1e-5)


def test_bf16_query_rounds_once():
    rng = np.random.default_rng(5)
    kv_b = jnp.asarray(_weights(rng), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, H, KN + KR)), jnp.bfloat16)
    got = absorb_queries_pallas(q, kv_b, layer=2, k_nope=KN)
    assert got.dtype == jnp.bfloat16
    w_uk, _ = _per_head(np.asarray(kv_b, np.float32), 2)
    want = np.concatenate([np.einsum("thn,rhn->thr", np.asarray(q[..., :KN], np.float64), w_uk),
                           np.asarray(q[..., KN:], np.float64)], -1)
    err = np.abs(np.asarray(got, np.float64) - want).max(-1) / np.abs(want).max(-1)
    assert err.max() <= 1e-2
    assert np.array_equal(np.asarray(got[..., R:]), np.asarray(q[..., KN:]))  # rotary part copied exactly


def test_bad_shapes_name_the_problem():
    kv_b = jnp.zeros((LAYERS, R, H * (KN + V)), jnp.float32)
    with pytest.raises(ValueError, match="layer=3 out of range"):
        absorb_queries_pallas(jnp.zeros((1, H, KN + KR)), kv_b, layer=3, k_nope=KN)
    with pytest.raises(ValueError, match=r"kv_b must be \[L, R, H\*\(Kn\+V\)\]"):
        absorb_outputs_pallas(jnp.zeros((1, 5, R)), kv_b, layer=0, v_dim=V)
    with pytest.raises(ValueError, match="v_dim=64"):
        absorb_outputs_pallas(jnp.zeros((1, H, R)), kv_b, layer=0, v_dim=64)
