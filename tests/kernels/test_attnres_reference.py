"""AttnRes mix reference: golden parity with flash-linear-attention's ``naive_attnres`` (float32).

Tolerance 1e-5 relative to the largest magnitude: the same fp32 math in a different summation order
(observed ~1e-7).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attnres import attnres_mix
from tests.kernels.helpers import assert_close

DATA = Path(__file__).resolve().parents[1] / "data"
TOL = 1e-5


@pytest.mark.parametrize("name", ["attnres_small", "attnres_outnorm"])
def test_golden(name):
    d = np.load(DATA / f"{name}.npz")
    out_w = d["output_rms_weight"] if bool(d["has_output_norm"]) else None
    mixed, weights = attnres_mix(d["query"], d["residuals"], d["rms_weight"], output_rms_weight=out_w,
                                 impl="reference")
    assert mixed.dtype == jnp.float32 and weights.dtype == jnp.float32
    assert_close(mixed, d["o"], TOL, "mixed")
    assert_close(weights, d["p"], TOL, "weights")


def test_bf16_sources_keep_dtype_and_weights_sum_to_one():
    rng = np.random.default_rng(0)
    sources = jnp.asarray(rng.standard_normal((3, 5, 64)), jnp.bfloat16)
    mixed, weights = attnres_mix(jnp.asarray(rng.standard_normal(64), jnp.float32), sources,
                                 jnp.ones(64, jnp.float32), scale=0.5, impl="reference")
    assert mixed.dtype == jnp.bfloat16 and weights.shape == (3, 5)
    np.testing.assert_allclose(np.asarray(weights).sum(0), 1.0, rtol=1e-6)
    want = np.einsum("ln,lnd->nd", np.asarray(weights), np.asarray(sources, np.float32))
    np.testing.assert_allclose(np.asarray(mixed, np.float32), want, rtol=1e-2, atol=1e-2)
