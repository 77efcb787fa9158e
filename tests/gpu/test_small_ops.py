"""Routing, residual add + RMSNorm, greedy sampling and the AttnRes mix on the GPU against their references, at the
served widths (Kimi-Linear-48B: D = 2304, 256 experts, top 8; K3: D = 7168, 896 experts, top 16; vocabulary
163840).

Tolerances, as in tests/kernels: the router's fp32 logits differ by summation order (~1e-7 relative), so the ids
must be equal on these random inputs and the weights agree to 1e-5; the norm's residual sum is rounded once by
both (exact; a PartialSum's parts are added in fp32 in another order: 1e-6, or one bf16 step), the normalised
row to 1e-5 in fp32 and one bf16 step (2**-7) in bf16; greedy ids equal and
log-probabilities to 1e-5 absolute; the AttnRes mix 1e-5 in fp32, 1e-2 in bf16 (max error relative to the largest
reference value)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attnres import attnres_mix
from pallas_kernels.greedy import greedy
from pallas_kernels.rmsnorm import PartialSum, add_rms_norm
from pallas_kernels.router import route
from tests.gpu.helpers import relative_max_error
from tests.kernels.test_router_pallas import float64_route

ROUTERS = {"kimi_linear": (2304, 256, 8, 2.446), "k3": (7168, 896, 16, 1.0)}


@pytest.mark.kernel("router")
@pytest.mark.parametrize("model", sorted(ROUTERS))
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_route(model, rows, check):
    dim, experts, k, scaling = ROUTERS[model]
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, dim)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((2, dim, experts)) * dim**-0.5, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((2, experts)) * 0.1, jnp.float32)
    weights, ids = route(x, router, bias, k=k, scaling=scaling, layer=1, impl="pallas")
    want_w, want_ids = float64_route(x, router[1], bias[1], k, True, scaling)
    check(f"{model} T={rows} ids differing", float(np.mean(np.asarray(ids) != want_ids)), 0.0)
    check(f"{model} T={rows} weights", relative_max_error(weights, want_w), 1e-5)


@pytest.mark.kernel("add_rms_norm")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 2304), (16, 7168), (300, 2304)])
@pytest.mark.parametrize("addend", ["array", "partial_sum"])
def test_add_rms_norm(dtype, rows, dim, addend, check):
    rng = np.random.default_rng(rows + dim)
    x = jnp.asarray(rng.standard_normal((rows, dim)), dtype)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, (3, dim)), jnp.float32)
    if addend == "array":
        delta = jnp.asarray(rng.standard_normal((rows, dim)), dtype)
    else:  # split-K parts (fp32) and router-weighted expert rows (bf16), as the MoE leaves them
        delta = PartialSum.of((jnp.asarray(rng.standard_normal((rows, 4, dim)), jnp.float32), None),
                              (jnp.asarray(rng.standard_normal((rows, 8, dim)), jnp.bfloat16),
                               jnp.asarray(rng.uniform(size=(rows, 8)), jnp.float32)))
    s, y = add_rms_norm(x, delta, weight, eps=1e-5, layer=2, impl="pallas")
    want_s, want_y = add_rms_norm(x, delta, weight, eps=1e-5, layer=2, impl="reference")
    tol = 1e-5 if dtype == jnp.float32 else 2.0**-7
    name = f"{jnp.dtype(dtype).name} T={rows} D={dim} {addend}"
    sum_tol = 0.0 if addend == "array" else 1e-6 if dtype == jnp.float32 else 2.0**-7  # parts added in fp32, any order
    check(f"{name} sum", relative_max_error(s, want_s), sum_tol)
    check(f"{name} normed", relative_max_error(y, want_y), tol)


@pytest.mark.kernel("greedy")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_greedy(dtype, rows, check):
    rng = np.random.default_rng(rows)
    logits = rng.standard_normal((rows, 163840)) * rng.uniform(0.5, 8.0, (rows, 1))
    logits[0, [5, 163000]] = logits[0].max() + 1.0  # a tie across chunks: the first index wins
    logits = jnp.asarray(logits, dtype)
    ids, logprobs = greedy(logits, impl="pallas")
    want_ids, want_lp = greedy(logits, impl="reference")
    assert int(ids[0]) == 5
    name = f"{jnp.dtype(dtype).name} N={rows}"
    check(f"{name} ids differing", float(np.mean(np.asarray(ids) != np.asarray(want_ids))), 0.0)
    check(f"{name} logprobs (absolute)", float(np.abs(np.asarray(logprobs) - np.asarray(want_lp)).max()), 1e-5)


@pytest.mark.kernel("attnres_mix")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("outnorm", [False, True])
def test_attnres_mix(dtype, outnorm, check):
    rng = np.random.default_rng(11)
    sources_count, tokens, dim = 9, 64, 7168
    query = jnp.asarray(rng.standard_normal(dim) * 0.05, jnp.float32)
    sources = jnp.asarray(rng.standard_normal((sources_count, tokens, dim)), dtype)
    rms_w = jnp.asarray(rng.uniform(0.5, 1.5, dim), jnp.float32)
    out_w = jnp.asarray(rng.uniform(0.5, 1.5, dim), jnp.float32) if outnorm else None
    got = attnres_mix(query, sources, rms_w, output_rms_weight=out_w, eps=1e-5, impl="pallas")
    with jax.default_matmul_precision("highest"):
        want = attnres_mix(query, sources, rms_w, output_rms_weight=out_w, eps=1e-5, impl="reference")
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    name = f"{jnp.dtype(dtype).name}{' output norm' if outnorm else ''}"
    check(f"{name} mixed", relative_max_error(got[0], want[0]), tol)
    check(f"{name} weights", relative_max_error(got[1], want[1]), 1e-5)
