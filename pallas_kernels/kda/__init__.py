"""Kimi Delta Attention ops with one call site and several implementations.

* :func:`chunk_kda`: chunked prefill over dense or packed varlen batches, with state checkpoints.
* :func:`fused_recurrent_kda`: one decode token per sequence (conv + gate + recurrence + gated RMSNorm) over
  slot pools, updated in place.
* :func:`fused_recurrent_kda_verify`: the same for up to 8 tokens per sequence (speculative verification),
  writing the states after every token to per-position slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import tuning
from pallas_kernels.impl import resolve_impl
from pallas_kernels.kda.config import ChunkKDAConfig, KDADecodeConfig
from pallas_kernels.kda.reference import (chunk_kda_reference, fused_recurrent_kda_reference, gated_rms_norm, kda_gate,
                                          l2_normalize, naive_recurrent_kda)

__all__ = ["ChunkKDAConfig", "KDADecodeConfig", "chunk_kda", "chunk_kda_reference", "decode_split_v",
           "decode_takes_mgpu", "fused_recurrent_kda", "fused_recurrent_kda_reference", "fused_recurrent_kda_verify", "gated_rms_norm",
           "kda_gate", "l2_normalize", "naive_recurrent_kda"]

MAX_VERIFY_TOKENS = 8


def decode_split_v(num_seqs: int, num_v_heads: int, config: KDADecodeConfig | None = None) -> int | None:
    """The decode step's kernel: None (the fused kernel) up to ``fused_max_rows`` rows of ``num_seqs *
    num_v_heads``, else the split-V kernel's slice width ``split_v`` (None when it is 0: never split)."""
    cfg = tuning.resolve(KDADecodeConfig, config)
    return None if num_seqs * num_v_heads <= cfg.fused_max_rows or not cfg.split_v else cfg.split_v


def decode_takes_mgpu(num_seqs: int, state: jax.ShapeDtypeStruct, config: KDADecodeConfig | None = None) -> bool:
    """Whether a decode step of ``num_seqs`` sequences over ``state`` (a ``[S, HV, K, V]`` pool, or its shape and
    dtype) takes the Mosaic-GPU state update: K = V = 128 and at least ``mgpu_min_rows`` (fp32 pool) or
    ``mgpu_min_rows_bf16`` (bf16 pool) (sequence, value head) rows, a threshold of 0 meaning never."""
    cfg = tuning.resolve(KDADecodeConfig, config)
    threshold = cfg.mgpu_min_rows_bf16 if state.dtype == jnp.bfloat16 else cfg.mgpu_min_rows
    return bool(threshold) and num_seqs * state.shape[1] >= threshold and tuple(state.shape[-2:]) == (128, 128)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, checkpoint_positions=None,
              use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None, impl=None,
              config: ChunkKDAConfig | None = None):
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
      config: the Pallas kernel's launch knobs (None: tuned for the device; see :class:`ChunkKDAConfig`).

    Returns:
      ``(o [B, T, HV, V] in q.dtype, final_state [N, HV, K, V] fp32, checkpoints [N, P, HV, K, V] fp32 | None)``.
    """
    recurrent = impl == "recurrent"
    if not recurrent and resolve_impl(impl) == "pallas":
        from pallas_kernels.kda.chunk import chunk_kda_pallas

        return chunk_kda_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                cu_seqlens=cu_seqlens, checkpoint_positions=checkpoint_positions,
                                use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias,
                                lower_bound=lower_bound, config=config)
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
                               eps: float = 1e-5, layer: int | None = None, impl=None,
                               config: KDADecodeConfig | None = None):
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
      layer: conv_weight, A_log, dt_bias and o_norm_weight are per-layer stacks (leading axis L) and row ``layer``
        is used; the Pallas kernels read it in place (a slice handed to a Pallas call is copied first).
      impl: ``None | "reference" | "pallas"``.
      config: the Pallas kernel's launch knobs (None: tuned for the device; see :class:`KDADecodeConfig`).

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
                                          scale=scale, eps=eps, layer=layer, config=config)
    if layer is not None:
        conv_weight, A_log, dt_bias, o_norm_weight = (a[layer] for a in (conv_weight, A_log, dt_bias, o_norm_weight))
    return fused_recurrent_kda_reference(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state,
                                         slots, out_slots, gate_logits, o_norm_weight, lower_bound=lower_bound,
                                         scale=scale, eps=eps)


def fused_recurrent_kda(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state, slots,
                        gate_logits, o_norm_weight, *, lower_bound=None, scale=None, eps: float = 1e-5,
                        layer: int | None = None, impl=None, config: KDADecodeConfig | None = None):
    """One decode token per sequence, pools updated in place at ``slots``.

    Shapes as :func:`fused_recurrent_kda_verify` without the token axis: mixed_qkv ``[N, 2*H*K + HV*V]``,
    g_raw ``[N, HV*K]``, beta_logits ``[N, HV]``, gate_logits ``[N, HV*V]``, slots int32 ``[N]``.
    Pallas: from ``config.mgpu_min_rows`` rows (``mgpu_min_rows_bf16`` for a bf16 pool; :func:`decode_takes_mgpu`)
    the Mosaic-GPU state update (in one launch with ``config.mgpu_one_launch``); else up to
    ``config.fused_max_rows`` (sequence, value head) rows one program per (sequence, head) does everything; past it
    (:func:`decode_split_v`) each state is spread over ``V / split_v`` programs of ``[K, split_v]`` slices
    (``recurrent.fused_recurrent_kda_split_v_pallas``; the gated RMSNorm and conv-state write then run in its
    epilogue kernel).
    ``layer``: as in :func:`fused_recurrent_kda_verify`.

    Returns:
      ``(y [N, HV*V], conv_state [S, W-1, C], state [S, HV, K, V])``.
    """
    if decode_takes_mgpu(mixed_qkv.shape[0], state, config) and resolve_impl(impl) == "pallas":
        from pallas_kernels.kda.decode_mgpu import fused_recurrent_kda_mgpu

        cfg = tuning.resolve(KDADecodeConfig, config)
        y, conv_state, state = fused_recurrent_kda_mgpu(
            mixed_qkv[:, None], conv_weight, conv_state, g_raw[:, None], beta_logits[:, None], A_log, dt_bias,
            state, slots, slots[:, None], gate_logits[:, None], o_norm_weight, lower_bound=lower_bound, scale=scale,
            eps=eps, layer=layer, one_launch=cfg.mgpu_one_launch, bf16_sums=cfg.mgpu_bf16_sums)
        return y[:, 0], conv_state, state
    split_v = decode_split_v(mixed_qkv.shape[0], state.shape[1], config)
    if split_v is not None and resolve_impl(impl) == "pallas":
        from pallas_kernels.kda.recurrent import fused_recurrent_kda_split_v_pallas

        return fused_recurrent_kda_split_v_pallas(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log,
                                                  dt_bias, state, slots, gate_logits, o_norm_weight,
                                                  lower_bound=lower_bound, scale=scale, eps=eps, layer=layer,
                                                  config=config)
    y, conv_state, state = fused_recurrent_kda_verify(
        mixed_qkv[:, None], conv_weight, conv_state, g_raw[:, None], beta_logits[:, None], A_log, dt_bias, state,
        slots, slots[:, None], gate_logits[:, None], o_norm_weight, lower_bound=lower_bound, scale=scale, eps=eps,
        layer=layer, impl=impl, config=config)
    return y[:, 0], conv_state, state
