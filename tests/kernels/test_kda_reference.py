"""KDA references: golden parity with flash-linear-attention 0.6.0, chunked form == token recurrence.

Tolerances: fp32 paths agree to 1e-4 of the reference's largest magnitude (the chunked form reorders fp32 sums
and solves a 64x64 triangular system; observed ~4e-6). bf16 inputs: both references upcast the same bf16
values and do fp32 math, so outputs differ only by the final bf16 rounding of o (2^-8 relative) -> 1e-2.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda
from pallas_kernels.kda import kda_gate, l2_normalize
from tests.kernels.helpers import assert_close

# Jitted once per shape: eager dispatch would compile every small op separately (most of the CPU test time).
naive_recurrent_kda = jax.jit(kda.naive_recurrent_kda, static_argnames=("scale",))
chunk_kda_reference = jax.jit(kda.chunk_kda_reference, static_argnames=("scale", "chunk_size"))
chunk_kda = jax.jit(kda.chunk_kda, static_argnames=("scale", "use_qk_l2norm", "lower_bound", "impl"))

DATA = Path(__file__).resolve().parents[1] / "data"
FP32_TOL = 1e-4


def random_inputs(seed, batch, seq_len, heads, value_heads, head_dim, value_dim, lower_bound=None,
                  num_seqs=None, dtype=jnp.float32):
    """Normalised q/k, v, gated g (from random raw gate), beta and an initial state ``[N, HV, K, V]``."""
    rng = np.random.default_rng(seed)
    q = l2_normalize(jnp.asarray(rng.standard_normal((batch, seq_len, heads, head_dim)), jnp.float32))
    k = l2_normalize(jnp.asarray(rng.standard_normal((batch, seq_len, heads, head_dim)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((batch, seq_len, value_heads, value_dim)), jnp.float32)
    g_raw = jnp.asarray(rng.standard_normal((batch, seq_len, value_heads, head_dim)) + 1.0, jnp.float32)
    A_log = jnp.asarray(rng.uniform(0.0, 2.5, value_heads), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(value_heads * head_dim), jnp.float32)
    g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((batch, seq_len, value_heads)), jnp.float32))
    state = jnp.asarray(rng.standard_normal((num_seqs or batch, value_heads, head_dim, value_dim)) * 0.3,
                        jnp.float32)
    cast = lambda x: x.astype(dtype)
    return cast(q), cast(k), cast(v), g, cast(beta), state


@pytest.mark.parametrize("name", ["small", "gva", "lowerbound"])
def test_golden_parity(name):
    d = dict(np.load(DATA / f"kda_{name}.npz"))
    lower_bound = None if np.isnan(d["lower_bound"]) else float(d["lower_bound"])
    assert_close(kda_gate(d["g_raw"], d["A_log"], d["dt_bias"], lower_bound), d["g"], FP32_TOL, "g")
    o, state = naive_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"])
    assert_close(o, d["o"], FP32_TOL, "naive o")
    assert_close(state, d["final_state"], FP32_TOL, "naive final_state")
    o, state, checkpoints = chunk_kda(d["q"], d["k"], d["v"], d["g_raw"], d["beta"], initial_state=d["initial_state"],
                                      A_log=d["A_log"], dt_bias=d["dt_bias"], lower_bound=lower_bound,
                                      use_qk_l2norm=True, impl="reference")
    assert checkpoints is None
    assert_close(o, d["o"], FP32_TOL, "chunk o")
    assert_close(state, d["final_state"], FP32_TOL, "chunk final_state")


def test_chunk_matches_naive_dense_odd_length():
    q, k, v, g, beta, state = random_inputs(0, batch=2, seq_len=83, heads=2, value_heads=2, head_dim=16,
                                            value_dim=8)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=state)
    o, s, _ = chunk_kda_reference(q, k, v, g, beta, initial_state=state, chunk_size=16)
    assert_close(o, o_ref, FP32_TOL, "o")
    assert_close(s, s_ref, FP32_TOL, "final_state")


VARLEN_CU = np.array([0, 0, 1, 70, 70, 101, 130], np.int32)  # empty, one token, 69 (> C=64), empty, 31, 29


def test_chunk_matches_naive_varlen_gva_lower_bound():
    """Zero-length and one-token sequences, padding tokens past cu[N], HV = 2H, strong decay (L = -5)."""
    num_seqs = len(VARLEN_CU) - 1
    q, k, v, g, beta, state = random_inputs(1, batch=1, seq_len=133, heads=2, value_heads=4, head_dim=16,
                                            value_dim=8, lower_bound=-5.0, num_seqs=num_seqs)
    assert float(g.min()) < -4.5
    cu = jnp.asarray(VARLEN_CU)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=state, cu_seqlens=cu)
    assert np.all(np.asarray(o_ref[0, 130:]) == 0)
    o, s, _ = chunk_kda_reference(q, k, v, g, beta, initial_state=state, cu_seqlens=cu)  # traced cu_seqlens
    assert_close(o, o_ref, FP32_TOL, "o")
    assert_close(s, s_ref, FP32_TOL, "final_state")
    np.testing.assert_array_equal(np.asarray(s[0]), np.asarray(state[0]))  # zero-length keeps its state


def test_checkpoints_match_recurrence_stopped_there():
    num_seqs = len(VARLEN_CU) - 1
    q, k, v, g, beta, state = random_inputs(2, batch=1, seq_len=130, heads=2, value_heads=2, head_dim=16,
                                            value_dim=8, num_seqs=num_seqs)
    lengths = np.diff(VARLEN_CU)
    positions = np.array([[0, -1, -1], [1, 0, -1], [64, 69, 33], [0, -1, 0], [31, 17, 1], [16, 29, 28]],
                         np.int32)
    _, s_final, checkpoints = chunk_kda_reference(q, k, v, g, beta, initial_state=state,
                                                  cu_seqlens=jnp.asarray(VARLEN_CU),
                                                  checkpoint_positions=jnp.asarray(positions), chunk_size=16)
    assert checkpoints.shape == (num_seqs, 3) + state.shape[1:]
    for col in range(positions.shape[1]):
        # Re-pack every sequence truncated to its checkpoint position and run the recurrence to the end.
        prefix = np.maximum(positions[:, col], 0)
        # Padded to the full length (tokens past cu[N] are ignored) so every column reuses one compilation.
        take = np.concatenate([np.arange(VARLEN_CU[n], VARLEN_CU[n] + prefix[n]) for n in range(num_seqs)])
        take = np.pad(take, (0, q.shape[1] - len(take)))
        cu = np.concatenate([[0], np.cumsum(prefix)]).astype(np.int32)
        _, expected = naive_recurrent_kda(q[:, take], k[:, take], v[:, take], g[:, take], beta[:, take],
                                          initial_state=state, cu_seqlens=jnp.asarray(cu))
        expected = np.where((positions[:, col] < 0)[:, None, None, None], 0.0, expected)
        assert_close(checkpoints[:, col], expected, FP32_TOL, f"checkpoints[:, {col}]")
    full = positions == lengths[:, None]
    assert_close(np.asarray(checkpoints)[full], np.asarray(s_final)[np.nonzero(full)[0]], FP32_TOL, "at len_n")


def test_bf16_inputs():
    q, k, v, g, beta, state = random_inputs(3, batch=2, seq_len=45, heads=1, value_heads=2, head_dim=16,
                                            value_dim=8, dtype=jnp.bfloat16)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=state)
    o, s, _ = chunk_kda_reference(q, k, v, g, beta, initial_state=state, chunk_size=16)
    assert o.dtype == jnp.bfloat16
    assert_close(o, o_ref, 1e-2, "o")
    assert_close(s, s_ref, FP32_TOL, "final_state")


def test_dispatcher_applies_gate_and_l2norm():
    rng = np.random.default_rng(4)
    q_raw = jnp.asarray(rng.standard_normal((1, 21, 2, 16)) * 3, jnp.float32)
    k_raw = jnp.asarray(rng.standard_normal((1, 21, 2, 16)) * 3, jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 21, 2, 8)), jnp.float32)
    g_raw = jnp.asarray(rng.standard_normal((1, 21, 2, 16)), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(1, 21, 2)), jnp.float32)
    A_log, dt_bias = jnp.asarray([0.3, 1.2], jnp.float32), jnp.asarray(rng.standard_normal(32), jnp.float32)
    o, s, _ = chunk_kda(q_raw, k_raw, v, g_raw, beta, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias,
                        scale=0.5, impl="reference")
    o_ref, s_ref = naive_recurrent_kda(l2_normalize(q_raw), l2_normalize(k_raw), v, kda_gate(g_raw, A_log, dt_bias),
                                       beta, scale=0.5)
    assert_close(o, o_ref, FP32_TOL, "o")
    assert_close(s, s_ref, FP32_TOL, "final_state")


def test_recurrent_reference_exports_checkpoints_like_chunked(rng):
    """The token-recurrent reference's checkpoints (the model's CPU path) equal the chunked reference's."""
    import jax.numpy as jnp
    from pallas_kernels.kda import chunk_kda

    t, h, k = 23, 2, 8
    q, kk = (jnp.asarray(rng.standard_normal((1, t, h, k)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, t, h, k)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((1, t, h, k)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (1, t, h)), jnp.float32)
    cu = jnp.asarray([0, 9, 9, 23], jnp.int32)
    init = jnp.asarray(rng.standard_normal((3, h, k, k)), jnp.float32)
    pos = jnp.asarray([[0, 4, 9], [0, -1, -1], [1, 14, -1]], jnp.int32)
    kw = dict(initial_state=init, cu_seqlens=cu, checkpoint_positions=pos, use_qk_l2norm=True,
              A_log=jnp.zeros(h), dt_bias=jnp.zeros(h * k), lower_bound=-5.0)
    want = chunk_kda(q, kk, v, g, beta, impl="reference", **kw)
    got = chunk_kda(q, kk, v, g, beta, impl="recurrent", **kw)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
