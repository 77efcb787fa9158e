"""The Mosaic-GPU KDA decode (``pallas_kernels.kda.decode_mgpu``) in the Mosaic-GPU interpreter against float64 numpy
and the fused reference, and its CUDA lowering through ``jax.export`` on this CPU.

Tolerances: the kernel does fp32 math like the reference, in another summation order (two halves of K), so fp32
pools agree to 1e-5 of the largest magnitude (observed ~1e-7); a bf16 pool rounds the new state once (2^-8
relative: bound 2e-2 on the state, and the outputs, computed before that rounding, stay at 1e-5).

Every interpreted call is waited for before anything else is dispatched (:func:`ready`): the Mosaic-GPU interpreter
runs its kernel through host callbacks, and an eager op dispatched while one is still running deadlocked a 2-core
CI worker.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tuning
from pallas_kernels.kda.decode_mgpu import DIM, fused_recurrent_kda_mgpu, kda_state_update_mgpu
from pallas_kernels.kda.reference import fused_recurrent_kda_reference
from tests.kernels.helpers import assert_close

FP32_TOL, BF16_TOL = 1e-5, 2e-2


def ready(results):
    """``results`` of an interpreted kernel call, computed (see the module docstring)."""
    return jax.block_until_ready(results)


def update_inputs(seed, state_dtype, seqs=3, value_heads=2, slots=6):
    rng = np.random.default_rng(seed)
    vec = lambda: rng.standard_normal((seqs, value_heads, DIM)).astype(np.float32)
    k = vec()
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(state=(rng.standard_normal((slots, value_heads, DIM, DIM)) * 0.3).astype(np.float32),
                slots=np.array([4, 0, 5][:seqs], np.int32), out_slots=np.array([2, -1, 5][:seqs], np.int32),
                q=vec() * DIM**-0.5, k=k, g=rng.uniform(0.3, 1.0, (seqs, value_heads, DIM)).astype(np.float32),
                v=vec(), beta=rng.uniform(0.0, 1.0, (seqs, value_heads)).astype(np.float32)), state_dtype


def update_float64(x):
    """(o [N, HV, V], the new states [N, HV, K, V]) in float64 from the state each sequence reads."""
    s = x["state"][x["slots"]].astype(np.float64) * x["g"][..., None]
    error = x["v"] - np.einsum("nhk,nhkv->nhv", x["k"], s)
    s = s + x["beta"][..., None, None] * x["k"][..., None] * error[..., None, :]
    return np.einsum("nhk,nhkv->nhv", x["q"], s), s


@pytest.mark.parametrize("state_dtype,ctas,bf16_sums", [(jnp.float32, None, "wgmma"), (jnp.bfloat16, None, "wgmma"),
                                                         (jnp.bfloat16, None, "reduce"), (jnp.float32, 2, "wgmma"),
                                                         (jnp.bfloat16, 4, "wgmma")])
def test_state_update_matches_float64_in_place(state_dtype, ctas, bf16_sums):
    """Batch 3 with a skipped write (out slot -1) and one sequence moving to another slot: o and the written
    states match float64; every slot not written keeps its bytes. ``ctas``: the pipelined kernel, 6 pairs over 2
    CTAs (3 each: both stages reused) or 4 (runs of 2, the last CTA idle); a bf16 pool's column sums by ``wgmma``
    or by reductions."""
    x, dtype = update_inputs(0, state_dtype)
    pool = jnp.asarray(x["state"], dtype)
    x["state"] = np.asarray(pool.astype(jnp.float32))  # what the kernel reads
    o, state = ready(kda_state_update_mgpu(pool, *(jnp.asarray(x[n]) for n in ("slots", "out_slots", "q", "k", "g",
                                                                                "v", "beta")),
                                                  ctas=ctas, bf16_sums=bf16_sums))
    o_want, s_want = update_float64(x)
    assert_close(o, o_want, FP32_TOL, "o")
    written = [(n, d) for n, d in enumerate(x["out_slots"]) if d >= 0]
    for n, dest in written:
        assert_close(state[dest], s_want[n], FP32_TOL if dtype == jnp.float32 else BF16_TOL, f"state of seq {n}")
    kept = sorted(set(range(pool.shape[0])) - {d for _, d in written})
    np.testing.assert_array_equal(np.asarray(state)[kept], np.asarray(pool)[kept])


def decode_inputs(seed, heads=1, value_heads=2, width=4, slots=7, seqs=3):
    rng = np.random.default_rng(seed)
    channels = 2 * heads * DIM + value_heads * DIM
    arr = lambda shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
    return dict(mixed_qkv=arr((seqs, 1, channels)), conv_weight=arr((channels, width), 0.5),
                conv_state=arr((slots, width - 1, channels)), g_raw=arr((seqs, 1, value_heads * DIM)),
                beta_logits=arr((seqs, 1, value_heads)), A_log=jnp.asarray(rng.uniform(0, 2, value_heads),
                                                                            jnp.float32),
                dt_bias=arr((value_heads * DIM,)), state=arr((slots, value_heads, DIM, DIM), 0.3),
                slots=jnp.asarray([3, 1, 5][:seqs], jnp.int32), out_slots=jnp.asarray([[3], [6], [-1]][:seqs],
                                                                                      jnp.int32),
                gate_logits=arr((seqs, 1, value_heads * DIM)),
                o_norm_weight=jnp.asarray(rng.uniform(0.5, 1.5, DIM), jnp.float32))


@pytest.mark.parametrize("lower_bound,state_dtype,ctas", [(-5.0, jnp.float32, None), (None, jnp.float32, None),
                                                           (-5.0, jnp.bfloat16, None), (None, jnp.bfloat16, 2)])
def test_decode_matches_fused_reference(lower_bound, state_dtype, ctas):
    """Three launches (GVA: one q/k head for two value heads): conv shift, conv + SiLU, L2 norms, both gates, in
    place, a moved and a skipped write: y and both pools equal the fused reference's, with fp32 and bf16 state
    pools, one CTA per pair or pipelined runs of pairs."""
    x = decode_inputs(1)
    x["state"] = x["state"].astype(state_dtype)
    ours = ready(fused_recurrent_kda_mgpu(**x, lower_bound=lower_bound, ctas=ctas))
    want = fused_recurrent_kda_reference(**x, lower_bound=lower_bound)
    for name, a, b in zip(("y", "conv_state", "state"), ours, want):
        tol = BF16_TOL if name == "state" and state_dtype == jnp.bfloat16 else FP32_TOL
        assert_close(a.astype(jnp.float32), b.astype(jnp.float32), tol, name)


@pytest.mark.parametrize("lower_bound,state_dtype,inputs_dtype,bf16_sums", [
    (-5.0, jnp.float32, jnp.float32, "wgmma"), (None, jnp.float32, jnp.bfloat16, "wgmma"),
    (-5.0, jnp.bfloat16, jnp.float32, "wgmma"), (None, jnp.bfloat16, jnp.bfloat16, "reduce")])
def test_one_launch_matches_fused_reference(lower_bound, state_dtype, inputs_dtype, bf16_sums):
    """H = HV = 2 takes the one-launch kernel: the same cases as the three launches, with bf16 activations and
    conv pool (the kernel reads them as stored and does fp32 math like the reference, so only the bf16 y's own
    rounding, 2^-8, separates them) and a bf16 pool's column sums both ways."""
    x = decode_inputs(5, heads=2)
    x = {n: (a.astype(inputs_dtype) if n in ("mixed_qkv", "conv_state", "g_raw", "beta_logits", "gate_logits")
             else a) for n, a in x.items()}
    x["state"] = x["state"].astype(state_dtype)
    ours = ready(fused_recurrent_kda_mgpu(**x, lower_bound=lower_bound, bf16_sums=bf16_sums))
    want = fused_recurrent_kda_reference(**x, lower_bound=lower_bound)
    for name, a, b in zip(("y", "conv_state", "state"), ours, want):
        rounded = (name == "state" and state_dtype == jnp.bfloat16) or (name == "y" and inputs_dtype == jnp.bfloat16)
        assert_close(a.astype(jnp.float32), b.astype(jnp.float32), BF16_TOL if rounded else FP32_TOL, name)


@pytest.mark.parametrize("heads", [1, 2])
def test_decode_reads_layer_row_of_stacked_weights(heads):
    """Per-layer stacks read at ``layer``, in three launches (GVA) and in one."""
    x = decode_inputs(2, heads=heads)
    per_layer = ("conv_weight", "A_log", "dt_bias", "o_norm_weight")
    stacked = {n: jnp.stack([-x[n], x[n]]) for n in per_layer}
    ours = ready(fused_recurrent_kda_mgpu(**{**x, **stacked}, layer=1, lower_bound=-5.0))
    want = fused_recurrent_kda_reference(**x, lower_bound=-5.0)
    for name, a, b in zip(("y", "conv_state", "state"), ours, want):
        assert_close(a, b, FP32_TOL, name)


@pytest.mark.parametrize("state_dtype,ctas,bf16_sums", [(jnp.float32, None, "wgmma"), (jnp.bfloat16, None, "wgmma"),
                                                         (jnp.bfloat16, None, "reduce"), (jnp.float32, 5, "wgmma"),
                                                         (jnp.bfloat16, 5, "wgmma")])
def test_state_update_lowers_for_cuda(state_dtype, ctas, bf16_sums):
    """Mosaic-GPU's layout inference, TMA shapes and shared-memory transforms, run by ``jax.export`` for CUDA."""
    S = jax.ShapeDtypeStruct
    n, hv = 4, 3
    fn = functools.partial(kda_state_update_mgpu, ctas=ctas, bf16_sums=bf16_sums, interpret=False)
    module = jax.export.export(jax.jit(fn), platforms=["cuda"])(
        S((9, hv, DIM, DIM), state_dtype), S((n,), jnp.int32), S((n,), jnp.int32),
        *[S((n, hv, DIM), jnp.float32)] * 4, S((n, hv), jnp.float32)).mlir_module()
    assert "mosaic_gpu" in module


@pytest.mark.parametrize("state_dtype,bf16_sums", [(jnp.float32, "wgmma"), (jnp.bfloat16, "wgmma"),
                                                   (jnp.bfloat16, "reduce")])
def test_one_launch_lowers_for_cuda(state_dtype, bf16_sums):
    """The whole step with H = HV as one Mosaic-GPU kernel and no Triton one (bf16 activations, fp32 conv pool and
    taps, stacked layers), lowered by ``jax.export`` for CUDA."""
    S = jax.ShapeDtypeStruct
    n, heads, width, layers, slots = 4, 3, 4, 2, 9
    channels = 3 * heads * DIM
    act, f32 = jnp.bfloat16, jnp.float32
    fn = functools.partial(fused_recurrent_kda_mgpu, lower_bound=None, layer=1, bf16_sums=bf16_sums, interpret=False)
    module = jax.export.export(jax.jit(fn), platforms=["cuda"])(
        S((n, 1, channels), act), S((layers, channels, width), f32), S((slots, width - 1, channels), f32),
        S((n, 1, heads * DIM), act), S((n, 1, heads), act), S((layers, heads), f32), S((layers, heads * DIM), f32),
        S((slots, heads, DIM, DIM), state_dtype), S((n,), jnp.int32), S((n, 1), jnp.int32),
        S((n, 1, heads * DIM), act), S((layers, DIM), f32)).mlir_module()
    assert module.count("mosaic_gpu") >= 1 and "triton" not in module


def test_shapes_it_does_not_take_are_refused():
    x = decode_inputs(3)
    with pytest.raises(ValueError, match="one token"):
        fused_recurrent_kda_mgpu(**{**x, "mixed_qkv": jnp.concatenate([x["mixed_qkv"]] * 2, axis=1)})
    small = jnp.zeros((2, 1, 64, 64), jnp.float32)
    ints = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="K = V = 128"):
        kda_state_update_mgpu(small, ints, ints, *[jnp.zeros((1, 1, 64))] * 4, jnp.zeros((1, 1)))
    with pytest.raises(ValueError, match="bf16_sums"):
        fused_recurrent_kda_mgpu(**x, bf16_sums="mma")


def test_decode_dispatch_takes_it_from_its_row_threshold():
    """``KDADecodeConfig.mgpu_min_rows`` (fp32 pools) / ``mgpu_min_rows_bf16`` route ``fused_recurrent_kda`` here
    from that many rows (tuned: never, except on the H100: ``tuned/nvidia-h100-80gb-hbm3.json``), with the same
    results as the fused reference."""
    from pallas_kernels.kda import KDADecodeConfig, decode_takes_mgpu, fused_recurrent_kda

    def pool(heads, dtype=jnp.float32, dim=128):
        return jax.ShapeDtypeStruct((9, heads, dim, dim), dtype)

    assert not decode_takes_mgpu(256, pool(96), tuning.tuned(KDADecodeConfig, "NVIDIA H200"))  # tuned off
    assert decode_takes_mgpu(64, pool(96), tuning.tuned(KDADecodeConfig, "NVIDIA H100 80GB HBM3"))
    assert decode_takes_mgpu(3, pool(2), KDADecodeConfig(mgpu_min_rows=6))
    assert not decode_takes_mgpu(2, pool(2), KDADecodeConfig(mgpu_min_rows=6))
    assert not decode_takes_mgpu(64, pool(2, dim=64), KDADecodeConfig(mgpu_min_rows=1))
    assert not decode_takes_mgpu(3, pool(2, jnp.bfloat16), KDADecodeConfig(mgpu_min_rows=6, mgpu_min_rows_bf16=0))
    assert decode_takes_mgpu(3, pool(2, jnp.bfloat16), KDADecodeConfig(mgpu_min_rows=0, mgpu_min_rows_bf16=6))
    timed = KDADecodeConfig(mgpu_min_rows=6144, mgpu_min_rows_bf16=24576)  # the H100's: where it timed faster
    assert decode_takes_mgpu(64, pool(96), timed) and not decode_takes_mgpu(64, pool(32), timed)
    assert decode_takes_mgpu(256, pool(96, jnp.bfloat16), timed)
    assert not decode_takes_mgpu(256, pool(32, jnp.bfloat16), timed)
    x = decode_inputs(4)
    x = {n: (a[:, 0] if n in ("mixed_qkv", "g_raw", "beta_logits", "gate_logits") else a) for n, a in x.items()
         if n != "out_slots"}
    ours = ready(fused_recurrent_kda(**x, lower_bound=-5.0, impl="pallas", config=KDADecodeConfig(mgpu_min_rows=6)))
    want = fused_recurrent_kda(**x, lower_bound=-5.0, impl="reference")
    for name, a, b in zip(("y", "conv_state", "state"), ours, want):
        assert_close(a, b, FP32_TOL, name)


def test_decode_dispatch_takes_one_launch_where_configured():
    """``KDADecodeConfig.mgpu_one_launch`` with H = HV: no Triton inputs kernel in the step, the same results as
    the reference; GVA keeps the three launches."""
    from pallas_kernels.kda import KDADecodeConfig, fused_recurrent_kda

    per_token = ("mixed_qkv", "g_raw", "beta_logits", "gate_logits")

    def step_inputs(heads):
        x = decode_inputs(6, heads=heads)
        return {n: (a[:, 0] if n in per_token else a) for n, a in x.items() if n != "out_slots"}

    def launches_inputs_kernel(x, config):
        jaxpr = jax.make_jaxpr(functools.partial(fused_recurrent_kda, lower_bound=-5.0, impl="pallas",
                                                 config=config))(**x)
        return "kda_decode_update_inputs" in str(jaxpr)

    one = KDADecodeConfig(mgpu_min_rows=6, mgpu_one_launch=True)
    three = KDADecodeConfig(mgpu_min_rows=6, mgpu_one_launch=False)
    x = step_inputs(2)
    assert not launches_inputs_kernel(x, one) and launches_inputs_kernel(x, three)
    assert launches_inputs_kernel(step_inputs(1), one)
    ours = ready(fused_recurrent_kda(**x, lower_bound=-5.0, impl="pallas", config=one))
    want = fused_recurrent_kda(**x, lower_bound=-5.0, impl="reference")
    for name, a, b in zip(("y", "conv_state", "state"), ours, want):
        assert_close(a, b, FP32_TOL, name)
