"""MLA on the GPU against the jnp references: the absorbed paged attention (Triton: decode, verification, chunked
prefill, padding rows in one packed batch, NaN-poisoned foreign pages; bf16, fp8 and fp32 caches; 16- and 64-token
pages), the Mosaic-GPU decode (Hopper), the un-absorbed prefill and the absorption GEMMs, at R = 512 + 64 with
the served head counts (Kimi-Linear-48B: 32 heads; K3: 96, 12 per TP8 rank).

Tolerances (max error relative to the largest reference value over the real rows): fp32 queries and caches, 1e-4
(summation order and the online softmax's rescaling; the references run IEEE fp32 products); bf16 (and fp8 caches,
against the reference on the same dequantised rows), 2e-2: the kernels round the probabilities to bf16 for the
P V product and both round o to bf16. The Mosaic-GPU kernel's lse: 1e-4 (fp32 sums of the same bf16 products)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla
from pallas_kernels.impl import on_hopper
from pallas_kernels.mla import reference as mla_reference
from pallas_kernels.mla.testing import make_paged_batch
from tests.gpu.helpers import relative_max_error

R, K_ROPE, K_NOPE, V_DIM = 512, 64, 128, 128
W = R + K_ROPE
SCALE = (K_NOPE + K_ROPE) ** -0.5
FP32_TOL, BF16_TOL = 1e-4, 2e-2
CONTEXTS, Q_LENS = [300, 1, 130, 64, 77, 0], [1, 1, 8, 64, 3, 0]  # decode x2, verify, prefill chunk, tail, padding


def paged_case(seed, num_heads, block_size, dtype):
    batch = make_paged_batch(np.random.default_rng(seed), CONTEXTS, Q_LENS, num_heads=num_heads, width=W,
                             block_size=block_size, num_tokens=sum(Q_LENS) + 3)
    return batch, [jnp.asarray(a, dtype) if a.dtype == np.float32 else jnp.asarray(a) for a in (
        batch.q, batch.pages, batch.block_tables, batch.context_lens, batch.cu_q_lens)]


TRITON_CASES = {
    # name: (heads, page size, dtype, fp8 cache)
    "k3_tp8_bf16_pages64": (12, 64, jnp.bfloat16, False),
    "kimi_linear_bf16_pages16": (32, 16, jnp.bfloat16, False),
    "k3_bf16_pages64": (96, 64, jnp.bfloat16, False),
    "kimi_linear_fp8_pages16": (32, 16, jnp.bfloat16, True),
    "k3_fp8_pages64": (96, 64, jnp.bfloat16, True),
    "kimi_linear_fp32_pages16": (32, 16, jnp.float32, False),
}


@pytest.mark.kernel("mla_paged_attention")
@pytest.mark.parametrize("name", sorted(TRITON_CASES))
def test_absorbed_paged_attention(name, check):
    num_heads, block_size, dtype, fp8 = TRITON_CASES[name]
    batch, (q, pages, tables, ctx, cu) = paged_case(0, num_heads, block_size, dtype)
    scales = None
    if fp8:
        rows, scales = mla_reference.quantize_latent_fp8(jnp.nan_to_num(pages).reshape(-1, W))
        pages, scales = rows.reshape(pages.shape), scales.reshape(pages.shape[:2])
    kwargs = dict(scale=SCALE, kv_lora_rank=R, page_scales=scales)
    with jax.default_matmul_precision("highest"):
        o, lse = jax.jit(lambda *a: mla.mla_paged_attention(*a, impl="pallas", **kwargs))(q, pages, tables, ctx, cu)
        want_o, want_lse = jax.jit(lambda *a: mla.mla_paged_attention(*a, impl="reference", **kwargs))(
            q, pages, tables, ctx, cu)
    real = int(batch.cu_q_lens[-1])
    tol = FP32_TOL if dtype == jnp.float32 else BF16_TOL
    assert np.isfinite(np.asarray(o, np.float32)).all()  # NaN-poisoned foreign pages never read
    check(f"{name} o", relative_max_error(o[:real], want_o[:real]), tol)
    check(f"{name} lse", relative_max_error(lse[:real], want_lse[:real]), tol)
    check(f"{name} padding rows", float(np.abs(np.asarray(o[real:], np.float32)).max()), 0.0)


MGPU_CASES = {"kimi_linear_decode": (32, 1), "k3_decode": (96, 1), "kimi_linear_verify_2": (32, 2),
              "k3_tp8_verify_3": (12, 3)}


@pytest.mark.kernel("mla_decode_mgpu")
@pytest.mark.skipif(not on_hopper(), reason="the Mosaic-GPU kernel needs wgmma and TMA (sm_90)")
@pytest.mark.parametrize("name", sorted(MGPU_CASES))
def test_mgpu_decode(name, check):
    from pallas_kernels.mla.decode_mgpu import mla_decode_mgpu
    from tests.kernels.test_mla_mgpu import decode_batch

    num_heads, q_len = MGPU_CASES[name]
    batch = decode_batch(np.random.default_rng(3), [700, 1, 0, 2000], num_heads, 64, q_len=q_len)
    q, pages = jnp.asarray(batch.q, jnp.bfloat16), jnp.asarray(batch.pages, jnp.bfloat16)
    tables, ctx, cu = (jnp.asarray(a) for a in (batch.block_tables, batch.context_lens, batch.cu_q_lens))
    o, lse = mla_decode_mgpu(q, pages, tables, ctx, scale=SCALE, q_len=q_len)
    with jax.default_matmul_precision("highest"):
        want_o, want_lse = mla.mla_paged_attention_reference(q, pages, tables, ctx, cu, scale=SCALE, kv_lora_rank=R)
    real = np.repeat(np.asarray(batch.context_lens) > 0, q_len)  # the empty sequence's rows: no keys on both
    check(f"{name} o", relative_max_error(o[real], want_o[real]), BF16_TOL)
    check(f"{name} lse", relative_max_error(lse[real], want_lse[real]), FP32_TOL)


PREFILL_CASES = {"kimi_linear_bf16": (32, jnp.bfloat16), "k3_bf16": (96, jnp.bfloat16),
                 "kimi_linear_fp32": (32, jnp.float32), "k3_tp8_fp32": (12, jnp.float32)}


@pytest.mark.kernel("mla_prefill_attention")
@pytest.mark.parametrize("name", sorted(PREFILL_CASES))
def test_unabsorbed_prefill(name, check):
    num_heads, dtype = PREFILL_CASES[name]
    q_lens, kv_lens = [130, 1, 64, 0], [400, 1, 64, 5]  # a chunk over cached context, one token, a full prefill
    rng = np.random.default_rng(4)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    q = arr(sum(q_lens) + 2, num_heads, K_NOPE + K_ROPE)
    k_nope, k_pe, v = arr(sum(kv_lens), num_heads, K_NOPE), arr(sum(kv_lens), K_ROPE), arr(sum(kv_lens), num_heads,
                                                                                          V_DIM)
    cu_q, cu_kv = (jnp.asarray(np.concatenate([[0], np.cumsum(n)]), jnp.int32) for n in (q_lens, kv_lens))
    with jax.default_matmul_precision("highest"):
        o, lse = jax.jit(lambda *a: mla.mla_prefill_attention(*a, scale=SCALE, impl="pallas"))(
            q, k_nope, k_pe, v, cu_q, cu_kv)
        want_o, want_lse = jax.jit(lambda *a: mla.mla_prefill_attention(*a, scale=SCALE, impl="reference"))(
            q, k_nope, k_pe, v, cu_q, cu_kv)
    real = sum(q_lens)
    tol = FP32_TOL if dtype == jnp.float32 else BF16_TOL
    check(f"{name} o", relative_max_error(o[:real], want_o[:real]), tol)
    check(f"{name} lse", relative_max_error(lse[:real], want_lse[:real]), tol)


ABSORB_CASES = {f"{model}_{rows}_rows_{jnp.dtype(dtype).name}": (heads, rows, dtype)
                for model, heads in (("kimi_linear", 32), ("k3", 96)) for rows in (1, 16)
                for dtype in (jnp.bfloat16, jnp.float32)}


@pytest.mark.kernel("mla_absorb")
@pytest.mark.parametrize("name", sorted(ABSORB_CASES))
def test_absorb_queries_and_outputs(name, check):
    heads, rows, dtype = ABSORB_CASES[name]
    rng = np.random.default_rng(5)
    kv_b = jnp.asarray(rng.standard_normal((3, R, heads * (K_NOPE + V_DIM))) * R**-0.5, dtype)
    q = jnp.asarray(rng.standard_normal((rows, heads, K_NOPE + K_ROPE)), dtype)
    o_lat = jnp.asarray(rng.standard_normal((rows, heads, R)), dtype)
    tol = FP32_TOL if dtype == jnp.float32 else BF16_TOL
    with jax.default_matmul_precision("highest"):
        for what, fn, arg in (("queries", lambda x, impl: mla.absorb_queries(x, kv_b, layer=2, k_nope=K_NOPE,
                                                                              impl=impl), q),
                              ("outputs", lambda x, impl: mla.absorb_outputs(x, kv_b, layer=1, v_dim=V_DIM,
                                                                              impl=impl), o_lat)):
            got = jax.jit(lambda x: fn(x, "pallas"))(arg)
            want = jax.jit(lambda x: fn(x, "reference"))(arg)
            check(f"{name} {what}", relative_max_error(got, want), tol)
