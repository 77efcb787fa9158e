"""MoE routing: the Pallas kernels (interpret mode) and the jnp reference against a float64 NumPy router.

Tolerances: the logits are fp32 dot products of D <= 96 terms summed in a different order on each path (about
1e-7 relative apart), so the chosen ids must be identical on these random inputs (no near-ties) and the weights
agree to 1e-5 relative."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.router import KERNEL_MAX_ROWS, route

TOL = 1e-5


def float64_route(x, router, bias, k, renormalize, scaling):
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + np.asarray(bias, np.float64)
    ids = np.argsort(-choice, axis=1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, axis=1)
    if renormalize:
        weights = weights / (weights.sum(axis=1, keepdims=True) + 1e-20)
    return weights * scaling, ids


def inputs(rng, rows, dim, experts, layers=3):
    x = jnp.asarray(rng.standard_normal((rows, dim)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((layers, dim, experts)) * dim**-0.5, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((layers, experts)) * 0.1, jnp.float32)
    return x, router, bias


@pytest.mark.parametrize("rows,dim,experts,k,layer,renormalize,scaling", [
    (1, 64, 32, 4, 0, True, 1.0),      # batch 1, one expert block
    (5, 96, 48, 8, 2, True, 2.446),    # odd rows, E not a power of two (masked lanes), Kimi-Linear scaling
    (20, 64, 64, 1, 1, False, 1.0),    # two row tiles, k = 1, no renormalisation
])
def test_route_matches_float64(rows, dim, experts, k, layer, renormalize, scaling, rng):
    x, router, bias = inputs(rng, rows, dim, experts)
    want_w, want_ids = float64_route(x, router[layer], bias[layer], k, renormalize, scaling)
    for impl in ("reference", "pallas"):
        weights, ids = route(x, router, bias, k=k, renormalize=renormalize, scaling=scaling, layer=layer, impl=impl)
        assert weights.shape == ids.shape == (rows, k) and weights.dtype == jnp.float32 and ids.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(ids), want_ids, err_msg=impl)
        np.testing.assert_allclose(np.asarray(weights, np.float64), want_w, rtol=TOL, err_msg=impl)


def test_ties_take_the_lower_expert_first_like_top_k(rng):
    """Experts 3 and 9 get identical columns and bias: both paths list 3 before 9 (lax.top_k's order)."""
    x, router, bias = inputs(rng, 2, 32, 16, layers=1)
    router = router.at[0, :, 9].set(router[0, :, 3])
    bias = bias.at[0, 3].set(5.0).at[0, 9].set(5.0)  # both chosen first
    for impl in ("reference", "pallas"):
        _, ids = route(x, router, bias, k=3, layer=0, impl=impl)
        assert np.asarray(ids)[:, :2].tolist() == [[3, 9], [3, 9]], impl


def test_unstacked_weights_and_fallbacks_equal_the_reference(rng):
    """No ``layer`` (plain [D, E] / [E]); grouped routing and steps above KERNEL_MAX_ROWS run the reference."""
    x, router, bias = inputs(rng, 3, 32, 32, layers=1)
    ref = route(x, router[0], bias[0], k=2, impl="reference")
    ker = route(x, router[0], bias[0], k=2, impl="pallas")
    np.testing.assert_array_equal(np.asarray(ker[1]), np.asarray(ref[1]))
    grouped = dict(k=2, num_expert_group=4, topk_group=2, layer=0)
    np.testing.assert_array_equal(np.asarray(route(x, router, bias, impl="pallas", **grouped)[1]),
                                  np.asarray(route(x, router, bias, impl="reference", **grouped)[1]))
    big = jnp.zeros((KERNEL_MAX_ROWS + 1, 32), jnp.bfloat16)
    assert route(big, router, bias, k=2, layer=0, impl="pallas")[1].shape == (KERNEL_MAX_ROWS + 1, 2)


def test_bad_arguments_are_clear_errors():
    x = jnp.zeros((2, 32), jnp.float32)
    with pytest.raises(ValueError, match="router"):
        route(x, jnp.zeros((16, 8)), jnp.zeros(8), k=2)
    with pytest.raises(ValueError, match="k=9"):
        route(x, jnp.zeros((32, 8)), jnp.zeros(8), k=9)
    with pytest.raises(ValueError, match="layer=3"):
        route(x, jnp.zeros((2, 32, 8)), jnp.zeros((2, 8)), k=2, layer=3)
