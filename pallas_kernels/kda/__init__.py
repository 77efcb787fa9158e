"""Kimi Delta Attention ops with one call site and several implementations.

* :func:`chunk_kda`: chunked prefill over dense or packed varlen batches, with state checkpoints.
* :func:`fused_recurrent_kda`: one decode token per sequence (conv + gate + recurrence + gated RMSNorm) over
  slot pools, updated in place.
* :func:`fused_recurrent_kda_verify`: the same for up to 8 tokens per sequence (speculative verification),
  writing the states after every token to per-position slots.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.impl import resolve_impl
from pallas_kernels.kda.reference import (chunk_kda_reference, fused_recurrent_kda_reference, gated_rms_norm, kda_gate,
                                          l2_normalize, naive_recurrent_kda)

__all__ = ["chunk_kda", "chunk_kda_reference", "decode_split_v", "fused_recurrent_kda", "fused_recurrent_kda_reference",
           "fused_recurrent_kda_verify", "gated_rms_norm", "kda_gate", "l2_normalize", "naive_recurrent_kda"]

MAX_VERIFY_TOKENS = 8
DECODE_SPLIT_V: int | None = 64
"""``split_v`` the model's decode step passes to :func:`fused_recurrent_kda` past :data:`FUSED_DECODE_MAX_ROWS`
(None: always the single-program fused kernel). Chosen by the H200 decode sweep of ``kda/bench.py``
(BENCHMARKS.md); ``bench_decode --kda-split-v`` sets it for an engine run."""
FUSED_DECODE_MAX_ROWS = 8192
"""Decode steps with at most this many (sequence, value head) rows take the single-program fused kernel (one
launch, one program per (sequence, head) owning its whole state and conv channels). H200, H=32, profiler device us
per step, fused (whole state, 4 warps) against split-V 64 + its epilogue (session 16, fp32 pool): batch 1 5.3 /
7.3, 16 24.6 / 29.9, 64 89.6 / 97.9, 256 348.8 / 360.4; bf16 pool: batch 64 60.7 / 70.1, 256 220.4 / 247.2.
Walking the state in pipelined V slices (``block_v`` 32 or 64) was 2-10% slower than the whole state at every
batch. With 8 warps the fused kernel had lost to split-V at batch 64 (session 6). Past 8192 rows (not timed)
split-V stays."""


def decode_split_v(num_seqs: int, num_v_heads: int) -> int | None:
    """The decode step's ``split_v``: None (the fused kernel) up to :data:`FUSED_DECODE_MAX_ROWS` rows of
    ``num_seqs * num_v_heads``, else :data:`DECODE_SPLIT_V`."""
    return None if num_seqs * num_v_heads <= FUSED_DECODE_MAX_ROWS else DECODE_SPLIT_V


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, checkpoint_positions=None,
              use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None, impl=None):
    """Chunked KDA over dense ``[B, T]`` or packed varlen (``B == 1`` + ``cu_seqlens``) batches.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; beta: ``[B, T, HV]`` (already in (0, 1)).
      g: ``[B, T, HV, K]`` log-decay, or the raw gate input when ``A_log`` is given.
      scale: multiplies q; default ``K**-0.5``.
      initial_state: ``[N, HV, K, V]`` (zeros if None).
      cu_seqlens: int32 ``[N+1]`` from ``cu_seqlens[0] == 0``; tokens past ``cu_seqlens[N]`` get a zero output.
      checkpoint_positions: int32 ``[N, P]`` token counts into sequence n (0..len_n) at which to export the
        state; ``-1`` = unused (zeros).
      use_qk_l2norm: L2-normalise q and k (eps 1e-6 inside the sqrt) first.
      A_log ``[HV]``, dt_bias ``[HV*K]``, lower_bound: gate parameters (see :func:`kda_gate`).
      impl: ``None | "reference" | "recurrent" | "pallas"``: the chunked (WY/UT) reference, the token-recurrent
        reference (same results, 2-3x cheaper to compile: the CPU default inside the model), or the Pallas
        kernel (K and V powers of 2, >= 16; bf16 inputs use bf16 dot operands with fp32 accumulation like
        flash-linear-attention, fp32 inputs exact fp32).

    Returns:
      ``(o [B, T, HV, V] in q.dtype, final_state [N, HV, K, V] fp32, checkpoints [N, P, HV, K, V] fp32 | None)``.
    """
    recurrent = impl == "recurrent"
    if not recurrent and resolve_impl(impl) == "pallas":
        from pallas_kernels.kda.chunk import chunk_kda_pallas

        return chunk_kda_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                cu_seqlens=cu_seqlens, checkpoint_positions=checkpoint_positions,
                                use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias,
                                lower_bound=lower_bound)
    out_dtype = q.dtype
    if A_log is not None:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if use_qk_l2norm:
        q, k = l2_normalize(q.astype(jnp.float32)), l2_normalize(k.astype(jnp.float32))
    if recurrent:
        out = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                  checkpoint_positions=checkpoint_positions)
        o, final_state, checkpoints = out if checkpoint_positions is not None else (*out, None)
    else:
        o, final_state, checkpoints = chunk_kda_reference(q, k, v, g, beta, scale=scale,
                                                          initial_state=initial_state, cu_seqlens=cu_seqlens,
                                                          checkpoint_positions=checkpoint_positions)
    return o.astype(out_dtype), final_state, checkpoints


def fused_recurrent_kda_verify(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state, slots,
                               out_slots, gate_logits, o_norm_weight, *, lower_bound=None, scale=None,
                               eps: float = 1e-5, block_v: int | None = None, layer: int | None = None, impl=None):
    """KDA step for ``Tq <= 8`` tokens per sequence; states after token t land in slot ``out_slots[n, t]``.

    Args:
      mixed_qkv: ``[N, Tq, 2*H*K + HV*V]`` pre-conv q | k | v projections.
      conv_weight: ``[C, W]`` depthwise taps (``[:, W-1]`` multiplies the current token).
      conv_state: ``[S, W-1, C]`` pool of the last W-1 pre-conv inputs.
      g_raw: ``[N, Tq, HV*K]`` raw gate input; beta_logits: ``[N, Tq, HV]`` (sigmoid applied here).
      A_log: ``[HV]``; dt_bias: ``[HV*K]``; lower_bound: ``None`` (softplus gate) or e.g. ``-5.0``.
      state: ``[S, HV, K, V]`` recurrent-state pool (fp32 or bf16, fp32 math).
      slots: int32 ``[N]`` slot each sequence starts from; out_slots: int32 ``[N, Tq]`` slot receiving the
        conv and recurrent state after each token (negative: not written).
      gate_logits: ``[N, Tq, HV*V]`` output-gate logits; o_norm_weight: ``[V]``; eps: RMSNorm epsilon.
      scale: q scale, default ``K**-0.5``.
      block_v: Pallas tuning, the width of the state slices a program walks (default V; see recurrent.py).
      layer: conv_weight, A_log, dt_bias and o_norm_weight are per-layer stacks (leading axis L) and row ``layer``
        is used; the Pallas kernels read it in place (a slice handed to a Pallas call is copied first).
      impl: ``None | "reference" | "pallas"``.

    Returns:
      ``(y [N, Tq, HV*V] in mixed_qkv.dtype (gated-RMSNormed, before o_proj), conv_state, state)``. Donate the
      pools to update them in place.
    """
    if mixed_qkv.shape[1] > MAX_VERIFY_TOKENS:
        raise ValueError(f"at most {MAX_VERIFY_TOKENS} tokens per sequence, got {mixed_qkv.shape[1]}")
    if resolve_impl(impl) == "pallas":
        from pallas_kernels.kda.recurrent import fused_recurrent_kda_pallas

        return fused_recurrent_kda_pallas(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias,
                                          state, slots, out_slots, gate_logits, o_norm_weight, lower_bound=lower_bound,
                                          scale=scale, eps=eps, block_v=block_v, layer=layer)
    if layer is not None:
        conv_weight, A_log, dt_bias, o_norm_weight = (a[layer] for a in (conv_weight, A_log, dt_bias, o_norm_weight))
    return fused_recurrent_kda_reference(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state,
                                         slots, out_slots, gate_logits, o_norm_weight, lower_bound=lower_bound,
                                         scale=scale, eps=eps)


def fused_recurrent_kda(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state, slots,
                        gate_logits, o_norm_weight, *, lower_bound=None, scale=None, eps: float = 1e-5,
                        block_v: int | None = None, split_v: int | None = None, layer: int | None = None,
                        impl=None):
    """One decode token per sequence, pools updated in place at ``slots``.

    Shapes as :func:`fused_recurrent_kda_verify` without the token axis: mixed_qkv ``[N, 2*H*K + HV*V]``,
    g_raw ``[N, HV*K]``, beta_logits ``[N, HV]``, gate_logits ``[N, HV*V]``, slots int32 ``[N]``.
    ``split_v`` (Pallas): spread each state over ``V / split_v`` programs of ``[K, split_v]`` slices
    (``recurrent.fused_recurrent_kda_split_v_pallas``; the gated RMSNorm and conv-state write then run in its
    epilogue kernel) instead of one program per (sequence, head) doing everything (the model's choice:
    :func:`decode_split_v`).
    ``layer``: as in :func:`fused_recurrent_kda_verify`.

    Returns:
      ``(y [N, HV*V], conv_state [S, W-1, C], state [S, HV, K, V])``.
    """
    if split_v is not None and resolve_impl(impl) == "pallas":
        from pallas_kernels.kda.recurrent import fused_recurrent_kda_split_v_pallas

        return fused_recurrent_kda_split_v_pallas(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log,
                                                  dt_bias, state, slots, gate_logits, o_norm_weight,
                                                  lower_bound=lower_bound, scale=scale, eps=eps, block_v=split_v,
                                                  layer=layer)
    y, conv_state, state = fused_recurrent_kda_verify(
        mixed_qkv[:, None], conv_weight, conv_state, g_raw[:, None], beta_logits[:, None], A_log, dt_bias, state,
        slots, slots[:, None], gate_logits[:, None], o_norm_weight, lower_bound=lower_bound, scale=scale, eps=eps,
        block_v=block_v, layer=layer, impl=impl)
    return y[:, 0], conv_state, state
