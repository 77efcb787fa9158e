"""Residual add + RMSNorm: the Pallas kernel (interpret mode on CPU) and the reference against float64 numpy.

Tolerances: the residual sum is rounded once to the input dtype by both, so it must match exactly. The
normalised row differs only by the order of the float32 sum of squares (~1e-7 relative): below 1e-5 relative in
float32, and at most one bf16 rounding step (2**-7 relative) in bf16."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rmsnorm import PartialSum, add_rms_norm

EPS = 1e-5


def float64_expected(x, delta, weight):
    s = np.asarray(x, np.float64) + (0.0 if delta is None else np.asarray(delta, np.float64))
    s = np.asarray(jnp.asarray(s, x.dtype), np.float64)  # rounded to the residual dtype first
    y = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS) * np.asarray(weight, np.float64)
    return s, y


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,dim,with_delta", [(1, 100, True), (5, 256, True), (3, 72, False)])
def test_add_rms_norm(dtype, rows, dim, with_delta, rng):
    x = jnp.asarray(rng.standard_normal((rows, dim)) * rng.uniform(0.1, 10.0, (rows, 1)), dtype)
    delta = jnp.asarray(rng.standard_normal((rows, dim)), dtype) if with_delta else None
    weight = jnp.asarray(rng.uniform(0.5, 1.5, dim), jnp.float32)
    want_s, want_y = float64_expected(x, delta, weight)
    tol = 1e-5 if dtype == jnp.float32 else 2.0**-7
    for impl in ("reference", "pallas"):
        s, y = add_rms_norm(x, delta, weight, eps=EPS, impl=impl)
        assert s.dtype == y.dtype == dtype and s.shape == y.shape == x.shape
        np.testing.assert_array_equal(np.asarray(s, np.float64), want_s)
        err = np.abs(np.asarray(y, np.float64) - want_y) / np.maximum(np.abs(want_y), 1e-3)
        assert err.max() <= tol, f"{impl}: relative error {err.max():.2e} > {tol:.0e}"
    ref, ker = (add_rms_norm(x, delta, weight, eps=EPS, impl=i)[1] for i in ("reference", "pallas"))
    assert np.abs(np.asarray(ref, np.float64) - np.asarray(ker, np.float64)).max() <= tol * np.abs(want_y).max()


@pytest.mark.parametrize("layer", [0, 2])
def test_stacked_weight_row(layer, rng):
    """A ``[L, D]`` weight stack with a static ``layer`` equals passing that row alone, on both paths."""
    x, delta = (jnp.asarray(rng.standard_normal((3, 40)), jnp.float32) for _ in range(2))
    stack = jnp.asarray(rng.uniform(0.5, 1.5, (3, 40)), jnp.float32)
    want_s, want_y = float64_expected(x, delta, stack[layer])
    for impl in ("reference", "pallas"):
        s, y = add_rms_norm(x, delta, stack, eps=EPS, layer=layer, impl=impl)
        np.testing.assert_array_equal(np.asarray(s, np.float64), want_s)
        np.testing.assert_allclose(np.asarray(y, np.float64), want_y, rtol=1e-5, atol=1e-6)


def test_shapes_are_checked():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, jnp.zeros((2, 4)), jnp.ones(8), eps=EPS)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, jnp.ones(4), eps=EPS)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, jnp.ones((2, 8)), eps=EPS)  # a stack needs a layer
    with pytest.raises(ValueError, match="layer=2"):
        add_rms_norm(x, None, jnp.ones((2, 8)), eps=EPS, layer=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 100), (3, 256)])
def test_partial_sum_addend(dtype, rows, dim, rng):
    """A :class:`PartialSum` addend (split-K float32 parts; router-weighted expert rows in the activation dtype;
    a plain array term) is added into the residual like its float64 total. The kernel and the reference sum
    the float32 terms in different orders: allowed, float32 rounding of each of the 9 additions (bounded by
    ``9 * 2**-24`` times the sum of the terms' magnitudes) plus one ulp of ``dtype`` on the result."""
    x = jnp.asarray(rng.standard_normal((rows, dim)) * 3.0, dtype)
    split = jnp.asarray(rng.standard_normal((rows, 4, dim)), jnp.float32)
    experts = jnp.asarray(rng.standard_normal((rows, 3, dim)), dtype)
    weights = jnp.asarray(rng.uniform(0.0, 1.0, (rows, 3)), jnp.float32)
    shared = jnp.asarray(rng.standard_normal((rows, dim)), dtype)
    delta = PartialSum.of((split, None), (experts, weights), (shared[:, None, :], None))
    total64 = (np.asarray(split, np.float64).sum(1) + np.asarray(shared, np.float64)
               + np.einsum("tpd,tp->td", np.asarray(experts, np.float64), np.asarray(weights, np.float64)))
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, dim), jnp.float32)
    want_s, want_y = float64_expected(x, total64, norm_weight)
    magnitude = (np.abs(np.asarray(x, np.float64)) + np.abs(np.asarray(split, np.float64)).sum(1)
                 + np.abs(np.asarray(shared, np.float64)) + np.abs(np.asarray(experts, np.float64)).sum(1))
    # one ulp of dtype (a float32 sum a few ulps off can round to the neighbouring value) + the float32 additions
    step = np.abs(want_s) * (2.0**-23 if dtype == jnp.float32 else 2.0**-7) + 9 * 2.0**-24 * magnitude
    # y: the sum's bound carried through the norm (w / rms per element), plus fp32 rounding of the rsqrt and the two
    # products (a few ulps of y); bf16 rounds y itself (2**-8 relative, 2**-7 with the sum's rounding)
    rms = np.sqrt(np.mean(want_s * want_s, axis=-1, keepdims=True) + EPS)
    y_step = step * np.asarray(norm_weight, np.float64) / rms + np.abs(want_y) * (
        2.0**-20 if dtype == jnp.float32 else 2.0**-7) + 1e-30
    for impl in ("reference", "pallas"):
        s, y = add_rms_norm(x, delta, norm_weight, eps=EPS, impl=impl)
        assert s.dtype == y.dtype == dtype and s.shape == y.shape == x.shape
        assert (np.abs(np.asarray(s, np.float64) - want_s) <= step).all(), impl
        err = np.abs(np.asarray(y, np.float64) - want_y) / y_step
        assert err.max() <= 1.0, f"{impl}: error {err.max():.2f} of the bound"


def test_partial_sum_total_and_shapes(rng):
    parts = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
    coeffs = jnp.asarray(rng.standard_normal((2, 3)), jnp.float32)
    got = PartialSum.of((parts, coeffs)).total(jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.einsum("tpd,tp->td", np.asarray(parts), np.asarray(coeffs)),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="coeffs"):
        PartialSum.of((parts, coeffs[:, :2]))
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(jnp.zeros((2, 4)), PartialSum.of((parts, None)), jnp.ones(4), eps=EPS)
