"""AttnRes Pallas kernel (interpret mode on CPU) vs the reference and the golden files.

Tolerance 1e-5 relative (fp32): same math, different summation order; the kernel gets |mixed|^2 from the
sources' Gram matrix instead of summing mixed^2 directly, which stays within a few fp32 ulps for these inputs.
bf16 sources: both paths upcast the same values, outputs differ by one bf16 rounding -> 1e-2.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attnres import AttnResConfig, attnres_mix
from pallas_kernels.attnres.kernel import attnres_mix_pallas
from tests.kernels.helpers import assert_close

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("name", ["attnres_small", "attnres_outnorm"])
def test_golden(name):
    d = np.load(DATA / f"{name}.npz")
    out_w = d["output_rms_weight"] if bool(d["has_output_norm"]) else None
    mixed, weights = attnres_mix(d["query"], d["residuals"], d["rms_weight"], output_rms_weight=out_w,
                                 impl="pallas")
    assert_close(mixed, d["o"], 1e-5, "mixed")
    assert_close(weights, d["p"], 1e-5, "weights")


@pytest.mark.parametrize("L,N,D,outnorm,dtype,block_n,max_chunk", [
    (5, 7, 96, True, jnp.float32, 2, 1024),    # D with an odd factor (three chunks of 32), N odd
    (1, 3, 64, False, jnp.bfloat16, 4, 32),    # single source, N smaller than the block, two D chunks
])
def test_matches_reference(L, N, D, outnorm, dtype, block_n, max_chunk):
    rng = np.random.default_rng(L * 100 + N)
    query = jnp.asarray(rng.standard_normal(D) * 0.3, jnp.float32)
    sources = jnp.asarray(rng.standard_normal((L, N, D)) * rng.uniform(0.5, 3, (L, N, 1)), dtype)
    rms_w = jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32)
    out_w = jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32) if outnorm else None
    got = attnres_mix_pallas(query, sources, rms_w, output_rms_weight=out_w, eps=1e-5, scale=0.7,
                             config=AttnResConfig(block_n=block_n, max_chunk=max_chunk))
    want = attnres_mix(query, sources, rms_w, output_rms_weight=out_w, eps=1e-5, scale=0.7, impl="reference")
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert got[0].dtype == dtype
    assert_close(got[0], want[0], tol, "mixed")
    assert_close(got[1], want[1], 1e-5, "weights")
