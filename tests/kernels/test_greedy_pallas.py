"""Greedy sampling: the Pallas kernel (interpret mode on CPU, small chunks so rows span several) against the
reference (``jnp.argmax`` + ``log_softmax``). Token ids must be equal, ties resolved to the first index like
``jnp.argmax``; log-probabilities differ only by the order of the float32 sums (online rescaling): < 1e-5
absolute on values of order 1-10."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.greedy import GreedyConfig, greedy, greedy_reference
from pallas_kernels.greedy.kernel import greedy_pallas


@pytest.mark.parametrize("rows,vocab,chunk", [(1, 100, 16), (5, 1000, 128), (3, 64, 64)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_matches_reference(rows, vocab, chunk, dtype, rng):
    logits = jnp.asarray(rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 8.0, (rows, 1)), dtype)
    want_ids, want_lp = greedy_reference(logits)
    got_ids, got_lp = greedy_pallas(logits, config=GreedyConfig(chunk=chunk))
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-5, rtol=0)
    x = np.asarray(logits, np.float64)  # the reference itself against float64
    np.testing.assert_array_equal(want_ids, x.argmax(-1))
    lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(want_lp, x[np.arange(rows), want_ids] - lse, atol=1e-5)


def test_ties_masked_entries_and_large_values():
    """Ties within a chunk and across chunks pick the first index; -inf entries (disallowed tokens) and a
    growing running maximum (rescaled sums) are exact."""
    logits = np.full((4, 70), -3.0, np.float32)
    logits[0, [5, 9]] = 2.0                  # tie inside the first chunk of 16
    logits[1, [3, 40]] = 2.0                 # tie across chunks
    logits[2, :] = -np.inf
    logits[2, [66, 68]] = 1.0                # only the tail chunk is allowed
    logits[3, :] = np.linspace(-1e4, 1e4, 70)  # the maximum grows chunk after chunk
    got_ids, got_lp = greedy_pallas(jnp.asarray(logits), config=GreedyConfig(chunk=16))
    want_ids, want_lp = greedy_reference(jnp.asarray(logits))
    np.testing.assert_array_equal(got_ids, [5, 3, 66, 69])
    np.testing.assert_array_equal(want_ids, got_ids)
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-5)
    np.testing.assert_allclose(got_lp[2], np.log(0.5), atol=1e-6)


def test_public_op_checks_rank_and_dispatches():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 50)), jnp.float32)
    for impl in ("reference", "pallas"):
        ids, lp = greedy(logits, impl=impl)
        assert ids.dtype == jnp.int32 and lp.dtype == jnp.float32 and ids.shape == lp.shape == (2,)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        greedy(logits[0])
