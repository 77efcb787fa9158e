"""KDA on the GPU against the token recurrence: chunked prefill (packed varlen with empty, 1-token and chunk-boundary
sequences, GVA, initial states, checkpoints, both gates) and the decode / verify step, at the served head sizes
(Kimi-Linear-48B: 32 heads, K = V = 128; K3: 96 heads, 12 per TP8 rank).

Tolerances (max error relative to the largest reference value, as in tests/kernels/test_kda_pallas.py): fp32
inputs run exact fp32 dots and fp32 gate math (PTX approximations of exp / log / rcp, ~2e-7 relative), 1e-4;
bf16 inputs run bf16 dot operands with fp32 accumulation like flash-linear-attention, 2e-2. Decode: fp32 math on
both sides, 1e-4, except a bf16 state pool, which may round an element one bf16 ulp apart (2e-2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda
from pallas_kernels.kda import KDADecodeConfig
from tests.gpu.helpers import relative_max_error

FP32_TOL, BF16_TOL = 1e-4, 2e-2
LENGTHS = [0, 1, 64, 65, 130, 3, 17]  # empty, one token, one chunk, one past it, two boundaries, short tails
POSITIONS = [[0, -1], [1, 0], [64, 32], [65, 64], [130, 128], [3, 2], [17, 16]]
PADDING = 5  # packed rows past the last sequence (zero output)


def prefill_inputs(seed, dtype, heads, value_heads, dim=128, state_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    total = sum(LENGTHS) + PADDING
    arr = lambda shape, dt=dtype: jnp.asarray(rng.standard_normal(shape), dt)  # noqa: E731
    return dict(q=arr((1, total, heads, dim)), k=arr((1, total, heads, dim)), v=arr((1, total, value_heads, dim)),
                g=arr((1, total, value_heads, dim)),
                beta=jnp.asarray(rng.uniform(size=(1, total, value_heads)), dtype),
                A_log=jnp.asarray(rng.uniform(0.0, 2.5, value_heads), jnp.float32),
                dt_bias=arr((value_heads * dim,), jnp.float32),
                initial_state=(arr((len(LENGTHS), value_heads, dim, dim), jnp.float32) * 0.3).astype(state_dtype))


CHUNK_CASES = {
    # name: (dtype, H, HV, lower bound, initial-state dtype)
    "kimi_linear_fp32_softplus": (jnp.float32, 32, 32, None, jnp.float32),
    "kimi_linear_fp32_lower_bound": (jnp.float32, 32, 32, -5.0, jnp.float32),
    "kimi_linear_bf16_softplus": (jnp.bfloat16, 32, 32, None, jnp.float32),
    "kimi_linear_bf16_lower_bound": (jnp.bfloat16, 32, 32, -5.0, jnp.bfloat16),
    "k3_tp8_fp32_lower_bound": (jnp.float32, 12, 12, -5.0, jnp.float32),
    "k3_tp8_bf16_lower_bound": (jnp.bfloat16, 12, 12, -5.0, jnp.float32),
    "k3_bf16_lower_bound": (jnp.bfloat16, 96, 96, -5.0, jnp.float32),
    "gva_fp32_softplus": (jnp.float32, 16, 32, None, jnp.float32),
    "gva_bf16_lower_bound": (jnp.bfloat16, 16, 32, -5.0, jnp.bfloat16),
}


def chunk_errors(name: str, seed: int = 0) -> dict:
    """(Pallas, token recurrence) errors of CHUNK_CASES[name]: ``{output: (error, tolerance)}``."""
    dtype, heads, value_heads, lower_bound, state_dtype = CHUNK_CASES[name]
    x = prefill_inputs(seed, dtype, heads, value_heads, state_dtype=state_dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]), jnp.int32)
    kwargs = dict(initial_state=x["initial_state"], cu_seqlens=cu, checkpoint_positions=jnp.asarray(POSITIONS),
                  use_qk_l2norm=True, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=lower_bound)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with jax.default_matmul_precision("highest"):
        ours = jax.jit(lambda *a: kda.chunk_kda(*a, impl="pallas", **kwargs))(*args)
        ref = jax.jit(lambda *a: kda.chunk_kda(*a, impl="recurrent", **kwargs))(*args)
    tol = FP32_TOL if dtype == jnp.float32 else BF16_TOL
    errors = {n: (relative_max_error(a, b), tol) for n, a, b in zip(("o", "final_state", "checkpoints"), ours, ref)}
    errors["o past the last sequence"] = (float(np.abs(np.asarray(ours[0][0, sum(LENGTHS):], np.float32)).max()), 0.0)
    assert ours[0].dtype == dtype
    return errors


@pytest.mark.kernel("kda_chunk")
@pytest.mark.parametrize("name", sorted(CHUNK_CASES))
def test_chunk_kda(name, check):
    for output, (err, tol) in chunk_errors(name).items():
        check(f"{name} {output}", err, tol)


def decode_inputs(seed, num_tokens, dtype, state_dtype, heads, value_heads, dim=128, width=4, seqs=5):
    """Pools of ``seqs * (num_tokens + 1) + 1`` slots: slot 0 unused, sequences read slots 1..seqs (in a shuffled
    order), verify writes to slots of their own, so no program writes a slot another one reads."""
    rng = np.random.default_rng(seed)
    slots = seqs * (num_tokens + 1) + 1
    channels = 2 * heads * dim + value_heads * dim
    arr = lambda shape, scale=1.0, dt=dtype: jnp.asarray(rng.standard_normal(shape) * scale, dt)  # noqa: E731
    x = dict(mixed_qkv=arr((seqs, num_tokens, channels)), conv_weight=arr((channels, width), 0.5, jnp.float32),
             conv_state=arr((slots, width - 1, channels)), g_raw=arr((seqs, num_tokens, value_heads * dim)),
             beta_logits=arr((seqs, num_tokens, value_heads)),
             A_log=jnp.asarray(rng.uniform(0, 2, value_heads), jnp.float32), dt_bias=arr((value_heads * dim,),
                                                                                           dt=jnp.float32),
             state=arr((slots, value_heads, dim, dim), 0.1, state_dtype),
             slots=jnp.asarray(rng.permutation(np.arange(1, seqs + 1)), jnp.int32),
             gate_logits=arr((seqs, num_tokens, value_heads * dim)),
             o_norm_weight=jnp.asarray(rng.uniform(0.5, 1.5, dim), jnp.float32))
    if num_tokens == 1:
        x = {n: (a[:, 0] if n in ("mixed_qkv", "g_raw", "beta_logits", "gate_logits") else a) for n, a in x.items()}
    return x


DECODE_CASES = {
    # name: (tokens, input dtype, state dtype, H, HV, lower bound, kernel)
    "kimi_linear_fp32_fused": (1, jnp.float32, jnp.float32, 32, 32, None, "fused"),
    "kimi_linear_bf16_bf16_state_fused": (1, jnp.bfloat16, jnp.bfloat16, 32, 32, -5.0, "fused"),
    "kimi_linear_bf16_split_v": (1, jnp.bfloat16, jnp.float32, 32, 32, None, "split_v"),
    "k3_bf16_fused": (1, jnp.bfloat16, jnp.float32, 96, 96, -5.0, "fused"),
    "k3_tp8_fp32_bf16_state_split_v": (1, jnp.float32, jnp.bfloat16, 12, 12, -5.0, "split_v"),
    "k3_tp8_fp32_sliced": (1, jnp.float32, jnp.float32, 12, 12, None, "sliced"),
    "gva_fp32_fused": (1, jnp.float32, jnp.float32, 16, 32, -5.0, "fused"),
    "kimi_linear_bf16_verify_3_tokens": (3, jnp.bfloat16, jnp.bfloat16, 32, 32, -5.0, "verify"),
    "k3_tp8_fp32_verify_8_tokens": (8, jnp.float32, jnp.float32, 12, 12, None, "verify"),
    "k3_bf16_mgpu_one_launch": (1, jnp.bfloat16, jnp.float32, 96, 96, -5.0, "mgpu_one_launch"),
    "kimi_linear_bf16_bf16_state_mgpu_one_launch": (1, jnp.bfloat16, jnp.bfloat16, 32, 32, None, "mgpu_one_launch"),
    "kimi_linear_bf16_bf16_state_mgpu_reduce": (1, jnp.bfloat16, jnp.bfloat16, 32, 32, -5.0, "mgpu_reduce"),
    "gva_fp32_mgpu_three_launches": (1, jnp.float32, jnp.float32, 16, 32, -5.0, "mgpu_three_launches"),
}
_MGPU = dict(mgpu_min_rows=1, mgpu_min_rows_bf16=1)
KERNEL_CONFIGS = {"fused": KDADecodeConfig(split_v=0), "split_v": KDADecodeConfig(split_v=64, fused_max_rows=0),
                  "sliced": KDADecodeConfig(split_v=0, block_v=32), "verify": KDADecodeConfig(),
                  "mgpu_one_launch": KDADecodeConfig(**_MGPU, mgpu_one_launch=True),
                  "mgpu_reduce": KDADecodeConfig(**_MGPU, mgpu_one_launch=True, mgpu_bf16_sums="reduce"),
                  "mgpu_three_launches": KDADecodeConfig(**_MGPU, mgpu_one_launch=False)}


def decode_errors(name: str, seed: int = 1) -> dict:
    """(Pallas, reference) errors of DECODE_CASES[name]: ``{output: (error, tolerance)}``; the verify cases write
    every token's states to their own slots (and drop one: slot -1)."""
    num_tokens, dtype, state_dtype, heads, value_heads, lower_bound, kernel = DECODE_CASES[name]
    x = decode_inputs(seed, num_tokens, dtype, state_dtype, heads, value_heads)
    config = KERNEL_CONFIGS[kernel]
    if kernel == "verify":
        seqs = x["slots"].shape[0]
        out_slots = (seqs + 1 + np.arange(seqs * num_tokens, dtype=np.int32)).reshape(seqs, num_tokens)
        out_slots[1, 0] = -1  # not written
        x["out_slots"] = jnp.asarray(out_slots)
        op = kda.fused_recurrent_kda_verify
    else:
        op = kda.fused_recurrent_kda
    with jax.default_matmul_precision("highest"):
        ours = jax.jit(lambda x: op(**x, lower_bound=lower_bound, impl="pallas", config=config))(x)
        ref = jax.jit(lambda x: op(**x, lower_bound=lower_bound, impl="reference"))(x)
    state_tol = FP32_TOL if state_dtype == jnp.float32 else BF16_TOL
    return {n: (relative_max_error(a, b), tol) for n, a, b, tol in zip(
        ("y", "conv_state", "state"), ours, ref, (FP32_TOL if dtype == jnp.float32 else BF16_TOL, FP32_TOL,
                                                  state_tol))}


@pytest.mark.kernel("kda_decode")
@pytest.mark.parametrize("name", sorted(DECODE_CASES))
def test_kda_decode(name, check):
    for output, (err, tol) in decode_errors(name).items():
        check(f"{name} {output}", err, tol)
