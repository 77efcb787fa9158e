"""Pallas KDA kernels in interpret mode (CPU) against the pure-jnp references.

Tolerances: fp32 inputs run exact fp32 dots in the kernels, so they agree with the references to 1e-4 of the
largest magnitude (observed ~3e-7). bf16 inputs run bf16 dot operands (fp32 accumulation) like
flash-linear-attention: observed ~6e-3 on o, ~2e-3 on states, bound 2e-2. The decode/verify kernels do
fp32 math like their reference (1e-4), except that a bf16 state pool can round one element one ulp apart.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda
from pallas_kernels.kda import ChunkKDAConfig, KDADecodeConfig
from pallas_kernels.kda import chunk as chunk_module
from tests.kernels.helpers import assert_close

from .test_kda_reference import naive_recurrent_kda

chunk_kda = jax.jit(kda.chunk_kda, static_argnames=("scale", "use_qk_l2norm", "lower_bound", "impl"))
fused_recurrent_kda = jax.jit(kda.fused_recurrent_kda,
                              static_argnames=("lower_bound", "scale", "eps", "layer", "impl", "config"))
fused_recurrent_kda_verify = jax.jit(kda.fused_recurrent_kda_verify,
                                     static_argnames=("lower_bound", "scale", "eps", "layer", "impl"))

FP32_TOL, BF16_TOL = 1e-4, 2e-2
def split(split_v):
    """The decode config that takes the split-V kernel with ``split_v``-wide slices at any batch (None: never)."""
    return KDADecodeConfig(split_v=split_v or 0, fused_max_rows=0)


CU = np.array([0, 0, 1, 70, 70, 101, 130], np.int32)  # empty, one token, 69 (> C=64), empty, 31, 29; 3 padding
POSITIONS = np.array([[0, -1], [1, 0], [64, 69], [0, -1], [31, 17], [16, 29]], np.int32)


def prefill_inputs(seed, dtype, num_tokens=133, heads=1, value_heads=2, head_dim=16, value_dim=16):
    rng = np.random.default_rng(seed)
    arr = lambda shape, dt=dtype: jnp.asarray(rng.standard_normal(shape), dt)
    return dict(q=arr((1, num_tokens, heads, head_dim)), k=arr((1, num_tokens, heads, head_dim)),
                v=arr((1, num_tokens, value_heads, value_dim)),
                g=jnp.asarray(rng.standard_normal((1, num_tokens, value_heads, head_dim)) + 1.0, jnp.float32),
                beta=jnp.asarray(rng.uniform(size=(1, num_tokens, value_heads)), dtype),
                A_log=jnp.asarray(rng.uniform(0.0, 2.5, value_heads), jnp.float32),
                dt_bias=arr((value_heads * head_dim,), jnp.float32),
                initial_state=arr((len(CU) - 1, value_heads, head_dim, value_dim), jnp.float32))


def varlen_pallas_and_reference(x, lower_bound):
    """(Pallas, reference) results of the varlen batch ``CU`` with in-kernel gate and L2 norm, initial states and
    the checkpoints ``POSITIONS``."""
    kwargs = dict(initial_state=x["initial_state"], cu_seqlens=jnp.asarray(CU),
                  checkpoint_positions=jnp.asarray(POSITIONS), use_qk_l2norm=True, A_log=x["A_log"],
                  dt_bias=x["dt_bias"], lower_bound=lower_bound)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    return chunk_kda(*args, impl="pallas", **kwargs), chunk_kda(*args, impl="reference", **kwargs)


@pytest.mark.slow  # ~15 s CPU per case: interpret-mode compile of the full intra + scan kernels
@pytest.mark.parametrize("dtype,lower_bound", [(jnp.float32, -5.0), (jnp.bfloat16, None), (jnp.float32, None)])
def test_chunk_varlen_gate_l2norm_checkpoints(dtype, lower_bound):
    """Varlen with empty / one-token sequences and padding, GVA, in-kernel gate (both forms; the -5 bound takes
    the midpoint diagonal path, softplus the dyadic one) and L2 norm, initial states, checkpoints."""
    x = prefill_inputs(0, dtype)
    ours, ref = varlen_pallas_and_reference(x, lower_bound)
    tol = FP32_TOL if dtype == jnp.float32 else BF16_TOL
    assert ours[0].dtype == dtype
    for name, a, b in zip(("o", "final_state", "checkpoints"), ours, ref):
        assert_close(a, b, tol, name)
    assert np.all(np.asarray(ours[0][0, 130:]) == 0)  # tokens past the last sequence


@pytest.mark.slow  # ~15 s CPU each: interpret-mode compile of the full kernels
@pytest.mark.parametrize("adaptive", [True, False])
def test_chunk_softplus_diagonal_forms_varlen_match_reference(adaptive):
    """Both diagonal-block forms of an unbounded gate (softplus, fp32): the per-block midpoint form where the span
    allows (the default; heads' spans from mild to far past 80, so both branches run) and the dyadic form on every
    block, equal the reference on the varlen batch with initial states and checkpoints."""
    x = prefill_inputs(2, jnp.float32)
    x["A_log"] = jnp.asarray([-1.0, 3.0], jnp.float32)  # exp: 0.37 (spans ~5) and 20 (spans ~250)
    kwargs = dict(initial_state=x["initial_state"], cu_seqlens=jnp.asarray(CU),
                  checkpoint_positions=jnp.asarray(POSITIONS), use_qk_l2norm=True, A_log=x["A_log"],
                  dt_bias=x["dt_bias"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    config = ChunkKDAConfig(adaptive_diagonal=adaptive)
    ours = jax.jit(lambda *a: chunk_module.chunk_kda_pallas(*a, config=config, **kwargs))(*args)
    ref = chunk_kda(*args, impl="reference", **kwargs)
    for name, a, b in zip(("o", "final_state", "checkpoints"), ours, ref):
        assert_close(a, b, FP32_TOL, name)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="shared-memory limits exist on the GPU only")
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunk_at_kimi_head_size_with_checkpoints_fits_and_matches(lower_bound):
    """K = V = 128 (Kimi's heads) with checkpoints and initial states: the 3-stage scan's prefetch of the chunk
    summaries plus the checkpoint branch's k / g loads must fit the GPU's shared memory, and agree with the
    reference (bf16 inputs, BF16_TOL)."""
    x = prefill_inputs(5, jnp.bfloat16, heads=2, value_heads=2, head_dim=128, value_dim=128)
    ours, ref = varlen_pallas_and_reference(x, lower_bound)
    for name, a, b in zip(("o", "final_state", "checkpoints"), ours, ref):
        assert_close(a, b, BF16_TOL, name)


def test_chunk_dense_log_decay_matches_naive():
    """Dense batch of 2, odd length, precomputed log-decay (dyadic diagonal), no initial state, custom scale."""
    rng = np.random.default_rng(1)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    norm = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    q, k, v = norm(arr(2, 77, 1, 16)), norm(arr(2, 77, 1, 16)), arr(2, 77, 2, 16)
    g = -jax.nn.softplus(arr(2, 77, 2, 16) + 1.0)
    beta = jnp.asarray(rng.uniform(size=(2, 77, 2)), jnp.float32)
    o, state, checkpoints = chunk_kda(q, k, v, g, beta, scale=0.3, impl="pallas")
    o_ref, state_ref = naive_recurrent_kda(q, k, v, g, beta, scale=0.3)
    assert checkpoints is None
    assert_close(o, o_ref, FP32_TOL, "o")
    assert_close(state, state_ref, FP32_TOL, "final_state")


def test_chunk_dyadic_diagonal_wide_keys_strong_decay():
    """K=64 with the dyadic diagonal block, dense batch of 2, odd length, log-decay as strong as
    -30 per step (exp(-G) overflows fp32 within a 16-token block, so only forms whose factors are all <= 1 hold),
    initial state; against the token recurrence."""
    rng = np.random.default_rng(7)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    norm = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    q, k, v = norm(arr(2, 45, 1, 64)), norm(arr(2, 45, 1, 64)), arr(2, 45, 1, 16)
    g = -jax.nn.softplus(arr(2, 45, 1, 64) * 3.0) * jnp.asarray(rng.uniform(0.0, 10.0, (2, 45, 1, 64)), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(2, 45, 1)), jnp.float32)
    s0 = arr(2, 1, 64, 16)
    o, state, _ = chunk_kda(q, k, v, g, beta, initial_state=s0, impl="pallas")
    o_ref, state_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    assert float(jnp.min(g)) < -25.0
    assert_close(o, o_ref, FP32_TOL, "o")
    assert_close(state, state_ref, FP32_TOL, "final_state")


_BLOCK_OPTS = chunk_module._Options(group=1, scale=1.0, normalize_qk=False, has_gate=True, lower_bound=None,
                                    dot_dtype=jnp.float32, fast_math=False)
_f32 = functools.partial(jnp.asarray, dtype=jnp.float32)


def _assert_pairwise_blocks(got, q, k, log_decay, *, keep_lower=False):
    """A diagonal block's fp32 ``(A_kk, A_qk)`` against the masked pairwise formula in float64 (to 1e-5: fp32 sums
    of 32 products of O(1) terms); ``keep_lower``: only on the strict / full lower triangles, which is what the
    kernel keeps of them."""
    G = np.cumsum(log_decay, axis=0)
    exponent = np.where(np.tril(np.ones((16, 16)))[:, :, None] > 0, G[:, None, :] - G[None, :, :], -np.inf)
    decay = np.exp(exponent)  # [r, c, K]
    got_kk, got_qk = map(np.asarray, got)
    if keep_lower:
        got_kk, got_qk = np.tril(got_kk, -1), np.tril(got_qk)
    np.testing.assert_allclose(got_kk, np.tril(np.einsum("rd,cd,rcd->rc", k, k, decay), -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_qk, np.einsum("rd,cd,rcd->rc", q, k, decay), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decay_scale", [0.01, 1.0, 40.0])
def test_dyadic_diagonal_blocks_match_pairwise_formula(decay_scale):
    """The dyadic factorisation of a 16-token diagonal block against the masked pairwise formula in float64, from
    no decay to -40 per step (where ``exp(+-G)`` alone overflows): every pair (r, c <= r) must come from exactly
    one level, and nothing may land on or above the diagonal of ``A_kk`` or above that of ``A_qk``."""
    rng = np.random.default_rng(int(decay_scale * 100))
    q, k = rng.standard_normal((16, 32)), rng.standard_normal((16, 32))
    log_decay = -decay_scale * rng.uniform(0, 1, (16, 32))
    got = chunk_module._diagonal_block_dyadic(*map(_f32, (q, k, log_decay)), _BLOCK_OPTS)
    _assert_pairwise_blocks(got, q, k, log_decay)


@pytest.mark.parametrize("half_span", [4.0, 74.0, 88.0, 240.0])
def test_any_gate_diagonal_blocks_match_pairwise_formula(half_span):
    """A gate that bounds nothing takes the midpoint form for a block whose cumsum stays within 80 of its midpoint
    row and the dyadic form beyond (4 / 74: midpoint; 88 / 240: dyadic, where the midpoint's exp(+-120) would
    overflow): either way the blocks equal the masked pairwise formula in float64."""
    rng = np.random.default_rng(int(half_span))
    q, k = rng.standard_normal((16, 32)), rng.standard_normal((16, 32))
    step = half_span / 8  # the steepest channel's decay per token: |G_0 - G_8| = 8 steps
    log_decay = -step * np.concatenate([np.ones((16, 1)), rng.uniform(0, 1, (16, 31))], axis=1)
    G = np.cumsum(log_decay, axis=0)
    assert np.isclose(np.abs(G - G[8]).max(), half_span)
    got = chunk_module._diagonal_block_any_gate(*map(_f32, (q, k, log_decay, G)), _BLOCK_OPTS)
    _assert_pairwise_blocks(got, q, k, log_decay, keep_lower=True)


def test_chunk_strongly_coupled_sub_chunks_match_naive():
    """Near-parallel keys, beta near 1 and almost no decay: every 16-token sub-chunk's solve leans on all earlier
    ones of its chunk (``M``, ``M^2``, ``M^3`` of the combine all matter; strong decay hides them), dense batch of
    2 with 77 tokens, initial state; against the token recurrence."""
    rng = np.random.default_rng(11)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    norm = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    q, k = norm(arr(2, 77, 1, 16)), norm(arr(1, 1, 1, 16) + 0.2 * arr(2, 77, 1, 16))
    v = arr(2, 77, 2, 16)
    g = -0.02 * jnp.asarray(rng.uniform(size=(2, 77, 2, 16)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.7, 1.0, (2, 77, 2)), jnp.float32)
    s0 = arr(2, 2, 16, 16)
    o, state, _ = chunk_kda(q, k, v, g, beta, initial_state=s0, impl="pallas")
    o_ref, state_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    assert_close(o, o_ref, FP32_TOL, "o")
    assert_close(state, state_ref, FP32_TOL, "final_state")


def recurrent_inputs(seed, num_tokens, state_dtype, heads=2, value_heads=4, dim=16, width=4, slots=7, seqs=3):
    rng = np.random.default_rng(seed)
    channels = 2 * heads * dim + value_heads * dim
    arr = lambda shape, scale=1.0, dt=jnp.float32: jnp.asarray(rng.standard_normal(shape) * scale, dt)
    return dict(mixed_qkv=arr((seqs, num_tokens, channels)), conv_weight=arr((channels, width), 0.5),
                conv_state=arr((slots, width - 1, channels)), g_raw=arr((seqs, num_tokens, value_heads * dim)),
                beta_logits=arr((seqs, num_tokens, value_heads)), A_log=jnp.asarray(rng.uniform(0, 2, value_heads),
                                                                                    jnp.float32),
                dt_bias=arr((value_heads * dim,)), state=arr((slots, value_heads, dim, dim), 0.3, state_dtype),
                slots=jnp.asarray([3, 1, 5], jnp.int32), gate_logits=arr((seqs, num_tokens, value_heads * dim)),
                o_norm_weight=jnp.asarray(rng.uniform(0.5, 1.5, dim), jnp.float32))


@pytest.mark.parametrize("split_v", [None, 8])
def test_decode_matches_reference_in_place(split_v):
    """bf16 state pool, lower-bound gate, GVA; slots not in ``slots`` stay untouched. ``split_v=8``: each state
    spread over two programs (V=16), conv shift and gated RMSNorm in XLA."""
    x = recurrent_inputs(2, 1, jnp.bfloat16)
    x = {n: (a[:, 0] if n in ("mixed_qkv", "g_raw", "beta_logits", "gate_logits") else a) for n, a in x.items()}
    ours = fused_recurrent_kda(**x, lower_bound=-5.0, config=split(split_v), impl="pallas")
    ref = fused_recurrent_kda(**x, lower_bound=-5.0, impl="reference")
    # fp32 math on both sides; the bf16 pool may round a near-tie the other way: one bf16 ulp (2^-8) on state.
    for name, a, b, tol in zip(("y", "conv_state", "state"), ours, ref, (FP32_TOL, FP32_TOL, BF16_TOL)):
        assert_close(a, b, tol, name)
    untouched = np.setdiff1d(np.arange(7), np.asarray(x["slots"]))
    np.testing.assert_array_equal(np.asarray(ours[2])[untouched], np.asarray(x["state"])[untouched])
    np.testing.assert_array_equal(np.asarray(ours[1])[untouched], np.asarray(x["conv_state"])[untouched])


@pytest.mark.slow
def test_verify_matches_token_by_token_decode():
    """Verify over 3 tokens (softplus gate; state after each token in its own slot, -1 = dropped) equals 3
    reference decode steps."""
    x = recurrent_inputs(3, 3, jnp.float32)
    out_slots = jnp.asarray([[3, 2, 6], [0, -1, 4], [5, 5, 5]], jnp.int32)
    y, conv_state, state = fused_recurrent_kda_verify(**x, out_slots=out_slots, impl="pallas")
    step = {n: x[n] for n in ("conv_weight", "A_log", "dt_bias", "o_norm_weight")}
    pools = dict(conv_state=x["conv_state"], state=x["state"])
    # Stepping in place moves each sequence's states along private slots; compare per token with the verify slots.
    stepped_slots = jnp.asarray([3, 1, 5], jnp.int32)
    for t in range(3):
        y_t, cs, st = fused_recurrent_kda(x["mixed_qkv"][:, t], conv_state=pools["conv_state"], g_raw=x["g_raw"][:, t],
                                          beta_logits=x["beta_logits"][:, t], state=pools["state"],
                                          slots=stepped_slots, gate_logits=x["gate_logits"][:, t], impl="reference",
                                          **step)
        pools = dict(conv_state=cs, state=st)
        assert_close(y[:, t], y_t, FP32_TOL, f"y[{t}]")
        for n, dest in enumerate(np.asarray(out_slots[:, t])):
            if dest >= 0 and not (n == 2 and t < 2):  # sequence 2 writes slot 5 at every token: only the last stays
                assert_close(state[dest], st[stepped_slots[n]], FP32_TOL, f"state seq {n} token {t}")
                assert_close(conv_state[dest], cs[stepped_slots[n]], FP32_TOL, f"conv seq {n} token {t}")


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_v_tiled_state_walk_matches_reference(num_tokens):
    """``block_v`` < V walks the state in [K, block_v] slices (gated RMSNorm over the whole V afterwards):
    decode and 2-token verify equal the reference (fp32 pool; softplus gate)."""
    from pallas_kernels.kda.recurrent import fused_recurrent_kda_pallas

    x = recurrent_inputs(4, num_tokens, jnp.float32)
    out_slots = jnp.asarray([[3, 2], [1, -1], [6, 5]], jnp.int32)[:, :num_tokens]
    args = [x[n] for n in ("mixed_qkv", "conv_weight", "conv_state", "g_raw", "beta_logits", "A_log", "dt_bias",
                           "state", "slots")] + [out_slots, x["gate_logits"], x["o_norm_weight"]]
    want = fused_recurrent_kda_verify(*args, impl="reference")
    got = fused_recurrent_kda_pallas(*args, config=KDADecodeConfig(block_v=4))
    for name, a, b in zip(("y", "conv_state", "state"), got, want):
        assert_close(a, b, FP32_TOL, name)
    with pytest.raises(ValueError, match="block_v"):
        fused_recurrent_kda_pallas(*args, config=KDADecodeConfig(block_v=3))


@pytest.mark.parametrize("heads,value_heads", [(2, 2), (1, 3)])
def test_split_v_decode_fp32_softplus_gate_matches_reference(heads, value_heads):
    """fp32 pool and inputs, softplus gate, block_v = V / 4: exact to fp32 rounding. (2, 2): 96 conv channels, 48
    per value head for the epilogue kernel (pieces of 32 + 16); (1, 3): 80 channels do not split over 3 value
    heads, so the norm and the conv scatter stay in XLA. A bad ``split_v`` is a clear error."""
    x = recurrent_inputs(6, 1, jnp.float32, heads=heads, value_heads=value_heads)
    x = {n: (a[:, 0] if n in ("mixed_qkv", "g_raw", "beta_logits", "gate_logits") else a) for n, a in x.items()}
    ours = fused_recurrent_kda(**x, config=split(4), impl="pallas")
    ref = fused_recurrent_kda(**x, impl="reference")
    for name, a, b in zip(("y", "conv_state", "state"), ours, ref):
        assert_close(a, b, FP32_TOL, name)
    with pytest.raises(ValueError, match="block_v=5"):
        fused_recurrent_kda(**x, config=split(5), impl="pallas")


@pytest.mark.parametrize("split_v", [None, 8])
def test_decode_reads_layer_row_of_stacked_weights(split_v):
    """``layer=1`` with 3-layer stacks of conv_weight, A_log, dt_bias and o_norm_weight (the model's stacked
    parameters, read in place by the split-V kernel) equals passing layer 1's rows alone."""
    x = recurrent_inputs(7, 1, jnp.float32)
    x = {n: (a[:, 0] if n in ("mixed_qkv", "g_raw", "beta_logits", "gate_logits") else a) for n, a in x.items()}
    per_layer = ("conv_weight", "A_log", "dt_bias", "o_norm_weight")
    rng = np.random.default_rng(8)
    stacked = {n: jnp.stack([jnp.asarray(rng.permutation(np.asarray(x[n]).ravel()).reshape(x[n].shape)), x[n],
                             -x[n]]) for n in per_layer}
    ours = fused_recurrent_kda(**{**x, **stacked}, layer=1, config=split(split_v), impl="pallas")
    ref = fused_recurrent_kda(**x, impl="reference")
    for name, a, b in zip(("y", "conv_state", "state"), ours, ref):
        assert_close(a, b, FP32_TOL, name)


def test_decode_takes_the_fused_kernel_up_to_its_row_limit():
    """Up to ``fused_max_rows`` (sequence, value head) rows the decode step takes the fused kernel (None), past
    it ``split_v``; a limit of 0 always splits, and ``split_v=0`` never does. The tuned H200 limit is 8192 rows."""
    from pallas_kernels import kda as kda_ops

    config = KDADecodeConfig(split_v=64, fused_max_rows=2048)
    assert [kda_ops.decode_split_v(n, 32, config) for n in (1, 16, 64, 65, 256)] == [None, None, None, 64, 64]
    assert [kda_ops.decode_split_v(n, 96, config) for n in (21, 22)] == [None, 64]
    config = KDADecodeConfig(split_v=64, fused_max_rows=0)
    assert kda_ops.decode_split_v(1, 32, config) == 64
    config = KDADecodeConfig(split_v=0, fused_max_rows=0)
    assert kda_ops.decode_split_v(64, 32, config) is None
    assert [kda_ops.decode_split_v(n, 32) for n in (256, 257)] == [None, 64]


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0])
def test_unit_lower_inverse_product_form(scale, rng):
    """The intra kernel's (I + A)^-1 as (I - A)(I + A^2)(I + A^4)(I + A^8) (A strictly lower, so A^16 = 0) equals
    the float64 inverse to 1e-5 of its largest entry: |A| <= 1 is the model's case (beta <= 1, unit q/k, decay
    <= 1); at 3 fp32 forward substitution itself is ~1e-6 off."""
    from pallas_kernels.kda.chunk import SUB, _unit_lower_inverse

    for _ in range(5):
        a = np.tril(rng.uniform(-1, 1, (SUB, SUB)) * scale, -1)
        want = np.linalg.inv(np.eye(SUB) + a)
        got = np.asarray(jax.jit(_unit_lower_inverse)(jnp.asarray(a, jnp.float32)), np.float64)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.slow  # interpret-mode compile of the intra + scan kernels
@pytest.mark.parametrize("name", ["small", "lowerbound"])
def test_chunk_kernel_golden_parity(name):
    """The Pallas chunk kernels against flash-linear-attention's own outputs (tests/data, made by its PyTorch
    reference): in-kernel gate (softplus / lower bound), in-kernel L2 norm, initial state."""
    from pathlib import Path

    d = dict(np.load(Path(__file__).parent.parent / "data" / f"kda_{name}.npz"))
    lower_bound = None if np.isnan(d["lower_bound"]) else float(d["lower_bound"])
    o, state, _ = chunk_kda(d["q"], d["k"], d["v"], d["g_raw"], d["beta"], initial_state=d["initial_state"],
                            A_log=d["A_log"], dt_bias=d["dt_bias"], lower_bound=lower_bound, use_qk_l2norm=True,
                            impl="pallas")
    assert_close(o, d["o"], FP32_TOL, "o")
    assert_close(state, d["final_state"], FP32_TOL, "final_state")
