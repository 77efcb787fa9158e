"""Pallas (Triton-style) fused KDA decode / speculative-verify step over slot pools, updated in place.

One launch per layer, grid ``(N, H)``: the program of sequence n and q/k head h owns the conv channels of q/k
head h and of its ``G = HV // H`` value heads, so every conv-state channel and recurrent state is read and
written by one program (in place through ``input_output_aliases``). Per token: conv-state shift + causal conv +
SiLU on q/k/v, q/k L2 norm, gate, beta, the delta-rule update of the fp32 ``[K, V]`` state, and the gated
RMSNorm of the output. Semantics: :func:`pallas_kernels.kda.reference.fused_recurrent_kda_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.impl import interpret_mode
from pallas_kernels.kda.reference import gate_from_logits

L2_EPS = 1e-6


def _recurrent_kernel(mixed_ref, conv_w_ref, conv_state_in_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref,
                      state_in_ref, slots_ref, out_slots_ref, gate_ref, norm_w_ref, y_ref, conv_state_ref, state_ref,
                      *, num_heads, group, width, num_tokens, scale, lower_bound, eps, use_barrier):
    seq, head = pl.program_id(0), pl.program_id(1)
    head_dim, value_dim = state_ref.shape[-2:]
    slot = slots_ref[seq]
    out_slots = [out_slots_ref[seq, t] for t in range(num_tokens)]

    def conv_inputs(offset, size):
        """The W-1 cached pre-conv inputs then the Tq new ones, each fp32 ``[size]``, and the W taps."""
        rows = [conv_state_in_ref[slot, j, pl.ds(offset, size)].astype(jnp.float32) for j in range(width - 1)]
        rows += [mixed_ref[seq, t, pl.ds(offset, size)].astype(jnp.float32) for t in range(num_tokens)]
        taps = [conv_w_ref[pl.ds(offset, size), j].astype(jnp.float32) for j in range(width)]
        return rows, taps

    def conv_silu(rows, taps, t):
        c = sum(taps[j] * rows[t + j] for j in range(width))
        return c * jax.nn.sigmoid(c)

    def l2norm(x):
        return x * lax.rsqrt(jnp.sum(x * x) + L2_EPS)

    qk_width = num_heads * head_dim
    q_rows, q_taps = conv_inputs(head * head_dim, head_dim)
    k_rows, k_taps = conv_inputs(qk_width + head * head_dim, head_dim)
    qs = [l2norm(conv_silu(q_rows, q_taps, t)) * scale for t in range(num_tokens)]
    ks = [l2norm(conv_silu(k_rows, k_taps, t)) for t in range(num_tokens)]
    conv_writes = [(head * head_dim, q_rows), (qk_width + head * head_dim, k_rows)]
    norm_w = norm_w_ref[...].astype(jnp.float32)
    for i in range(group):
        hv = head * group + i
        v_offset = 2 * qk_width + hv * value_dim
        v_rows, v_taps = conv_inputs(v_offset, value_dim)
        conv_writes.append((v_offset, v_rows))
        decay_scale = jnp.exp(a_log_ref[hv].astype(jnp.float32))
        dt_bias = dt_bias_ref[hv, :].astype(jnp.float32)
        state = state_in_ref[slot, hv].astype(jnp.float32)  # [K, V]
        for t in range(num_tokens):
            g = gate_from_logits(g_ref[seq, t, pl.ds(hv * head_dim, head_dim)].astype(jnp.float32) + dt_bias,
                                 decay_scale, lower_bound)
            beta = jax.nn.sigmoid(beta_ref[seq, t, hv].astype(jnp.float32))
            k = ks[t][:, None]
            state = state * jnp.exp(g)[:, None]
            error = conv_silu(v_rows, v_taps, t) - jnp.sum(state * k, axis=0)
            state = state + beta * k * error[None, :]
            o = jnp.sum(state * qs[t][:, None], axis=0)  # [V]
            normed = o * lax.rsqrt(jnp.mean(o * o) + eps) * norm_w
            gate = gate_ref[seq, t, pl.ds(hv * value_dim, value_dim)].astype(jnp.float32)
            y_ref[seq, t, pl.ds(hv * value_dim, value_dim)] = (normed * jax.nn.sigmoid(gate)).astype(y_ref.dtype)

            @pl.when(out_slots[t] >= 0)
            def _():
                state_ref[out_slots[t], hv] = state.astype(state_ref.dtype)

    if use_barrier:  # every thread has read the old conv rows before any is overwritten (in-place decode)
        pltriton.debug_barrier()
    for t in range(num_tokens):
        @pl.when(out_slots[t] >= 0)
        def _():
            for offset, rows in conv_writes:
                for j in range(width - 1):
                    conv_state_ref[out_slots[t], j, pl.ds(offset, rows[0].shape[0])] = (
                        rows[t + 1 + j].astype(conv_state_ref.dtype))


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def fused_recurrent_kda_pallas(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state, slots,
                               out_slots, gate_logits, o_norm_weight, *, lower_bound=None, scale=None,
                               eps: float = 1e-5, num_warps: int = 8):
    """Pallas version of :func:`~pallas_kernels.kda.reference.fused_recurrent_kda_reference` (same arguments
    and returns; K and V powers of 2). The pools are updated in place when donated."""
    num_seqs, num_tokens, channels = mixed_qkv.shape
    _, num_value_heads, head_dim, value_dim = state.shape
    width = conv_weight.shape[1]
    num_heads = (channels - num_value_heads * value_dim) // (2 * head_dim)
    interpret = interpret_mode()
    kernel = functools.partial(
        _recurrent_kernel, num_heads=num_heads, group=num_value_heads // num_heads, width=width,
        num_tokens=num_tokens, scale=head_dim**-0.5 if scale is None else float(scale), lower_bound=lower_bound,
        eps=eps, use_barrier=not interpret)
    inputs = (mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log.astype(jnp.float32),
              dt_bias.astype(jnp.float32).reshape(num_value_heads, head_dim), state, slots.astype(jnp.int32),
              out_slots.astype(jnp.int32), gate_logits, o_norm_weight)
    out_shape = (jax.ShapeDtypeStruct((num_seqs, num_tokens, num_value_heads * value_dim), mixed_qkv.dtype),
                 jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                 jax.ShapeDtypeStruct(state.shape, state.dtype))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(num_seqs, num_heads),
        in_specs=[_full(x.shape) for x in inputs], out_specs=tuple(_full(s.shape) for s in out_shape),
        input_output_aliases={2: 1, 7: 2},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="kda_fused_recurrent",
    )(*inputs)
