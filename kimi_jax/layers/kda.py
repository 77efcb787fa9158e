"""Kimi Delta Attention layers (spec section 1), stacked over the model's KDA layers.

Per token: q/k/v projections -> depthwise causal conv (kernel W, SiLU) with per-sequence conv state ->
q/k L2 norm -> per-channel decay gate (softplus or lower-bound sigmoid) and beta -> delta-rule recurrence
(``pallas_kernels.kda.chunk_kda``) -> gated RMSNorm (per head over V, times sigmoid of the output gate) -> o_proj.
Sequences in a packed step never share conv or recurrent state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.config import ModelConfig
from kimi_jax.layers.common import (F32, constant, fan_in_normal, normal, stacked_linear, stacked_linear_unsummed,
                                    stacked_linears)
from kimi_jax.step import StepInputs, TokenLayout
from pallas_kernels import kda as kda_ops
from pallas_kernels.impl import resolve_impl
from pallas_kernels.rmsnorm import PartialSum


class KDAStack(nnx.Module):
    """Parameters of all KDA layers, leading axis = KDA layer index ``j`` (``config.kda_layers[j]``).

    q_proj, k_proj [L, D, H*K]; v_proj [L, D, HV*V]; conv [L, 2*H*K + HV*V, W] (fp32, q then k then v);
    f_a [L, D, K]; f_b [L, K, HV*K]; A_log [L, HV]; dt_bias [L, HV*K]; b_proj [L, D, HV];
    g_proj [L, D, HV*V] (full rank) or g_a [L, D, V] + g_b [L, V, HV*V]; o_norm [L, V]; o_proj [L, HV*V, D].

    ``conv_tp`` (static): 1 when ``conv``'s channels are in the ``[q | k | v]`` order the layer reads; ``t > 1``
    after ``sharding.place`` re-laid them rank-major for ``t`` tensor-parallel ranks (rank r's contiguous block is
    its heads' ``[q_r | k_r | v_r]``), which only ``sharding.Parallel.kda`` can run.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        n, d = len(cfg.kda_layers), cfg.hidden_size
        h, hv, k, v = cfg.kda_num_heads, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim
        self.q_proj = fan_in_normal(rngs, (n, d, h * k), dtype)
        self.k_proj = fan_in_normal(rngs, (n, d, h * k), dtype)
        self.v_proj = fan_in_normal(rngs, (n, d, hv * v), dtype)
        self.conv = normal(rngs, (n, cfg.kda_conv_channels, cfg.kda_conv_kernel), 0.5, F32)
        self.f_a = fan_in_normal(rngs, (n, d, k), dtype)
        self.f_b = fan_in_normal(rngs, (n, k, hv * k), dtype)
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (n, hv), F32, 1.0, 16.0)))
        self.dt_bias = normal(rngs, (n, hv * k), 0.5, F32)
        self.b_proj = fan_in_normal(rngs, (n, d, hv), dtype)
        if cfg.kda_full_rank_gate:
            self.g_proj = fan_in_normal(rngs, (n, d, hv * v), dtype)
        else:
            self.g_a = fan_in_normal(rngs, (n, d, v), dtype)
            self.g_b = fan_in_normal(rngs, (n, v, hv * v), dtype)
        self.o_norm = constant((n, v), 1.0)
        self.o_proj = fan_in_normal(rngs, (n, hv * v, d), dtype)
        self.conv_tp = 1  # channel order of ``conv``: 1 = [q | k | v]; t > 1 = rank-major for t TP ranks


def conv_windows(qkv: jax.Array, old_conv: jax.Array, step: StepInputs, layout: TokenLayout) -> jax.Array:
    """The W inputs each row's causal conv sees: ``[T, W, C]``, earlier rows of the same sequence, else the
    sequence's conv state (``old_conv [N, W-1, C]``, oldest first; zeros for fresh sequences)."""
    t_rows, _ = qkv.shape
    w = old_conv.shape[1] + 1
    rows = jnp.arange(t_rows)
    safe = jnp.minimum(layout.seq_ids, step.num_seqs - 1)
    in_step = rows - step.cu_seqlens[safe]  # [T]
    taps = []
    for j in range(w):
        rel = in_step - (w - 1) + j
        from_step = qkv[jnp.clip(rows - (w - 1) + j, 0, t_rows - 1)]
        from_state = old_conv[safe, jnp.clip(in_step + j, 0, w - 2)]
        taps.append(jnp.where((rel >= 0)[:, None], from_step, from_state.astype(qkv.dtype)))
    return jnp.stack(taps, axis=1)


def conv_state_at(qkv: jax.Array, old_conv: jax.Array, starts: jax.Array, counts: jax.Array) -> jax.Array:
    """Conv state after ``counts [N, P]`` new tokens of each sequence: ``[N, P, W-1, C]``.

    ``starts [N]`` is each sequence's first row in ``qkv [T, C]``; ``old_conv [N, W-1, C]`` the state before."""
    t_rows = qkv.shape[0]
    wm1 = old_conv.shape[1]
    out = []
    for i in range(wm1):
        rel = counts - wm1 + i  # relative position of state row i
        from_step = qkv[jnp.clip(starts[:, None] + rel, 0, t_rows - 1)]
        from_state = jnp.take_along_axis(old_conv[:, None], jnp.clip(counts + i, 0, wm1 - 1)[:, :, None, None],
                                         axis=2)[:, :, 0]
        out.append(jnp.where((rel >= 0)[..., None], from_step.astype(F32), from_state.astype(F32)))
    return jnp.stack(out, axis=2)


def gated_rms_norm(o: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``RMSNorm_V(o) * weight * sigmoid(gate)`` per head; o, gate ``[T, HV, V]``; fp32 inside."""
    of = o.astype(F32)
    y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps) * weight.astype(F32)
    return (y * jax.nn.sigmoid(gate.astype(F32))).astype(o.dtype)


def kda_layer(p: KDAStack, j: int, x: jax.Array, state: jax.Array, conv: jax.Array,
              step: StepInputs, layout: TokenLayout, cfg: ModelConfig, *, impl: str | None = None
              ) -> tuple[jax.Array | PartialSum, jax.Array, jax.Array]:
    """KDA layer ``j`` on a packed step.

    x [T, D]; state [L, S, HV, K, V]; conv [L, S, W-1, C] (all KDA layers' pools) -> (out [T, D], state, conv)
    with layer j's live slots (and requested checkpoint slots) updated; ``out`` may be a :class:`PartialSum`
    (o_proj's split-K parts, see :func:`stacked_linear_unsummed`).

    The ops see the pools flattened to ``[L*S, ...]`` (a free reshape) with slot ids offset by ``j*S``: a slice
    ``state[j]`` handed to a Pallas call would be copied whole, twice per layer and step."""
    if getattr(p, "conv_tp", 1) != 1:
        raise ValueError(f"kda.conv is laid out for {p.conv_tp} tensor-parallel ranks; run it with the "
                         f"sharding.Parallel of that mesh (forward(..., parallel=...))")
    num_layers, num_slots = state.shape[:2]
    offset = j * num_slots
    state_pool = state.reshape((num_layers * num_slots,) + state.shape[2:])
    conv_pool = conv.reshape((num_layers * num_slots,) + conv.shape[2:])
    out, state_pool, conv_pool = _kda_layer_flat(p, j, x, state_pool, conv_pool, step.state_slots + offset,
                                                 step.checkpoint_slots + offset, step, layout, cfg, impl)
    return out, state_pool.reshape(state.shape), conv_pool.reshape(conv.shape)


def _kda_layer_flat(p: KDAStack, j: int, x, state_pool, conv_pool, slots, checkpoint_slots, step: StepInputs,
                    layout: TokenLayout, cfg: ModelConfig, impl):
    """:func:`kda_layer` on flat pools ``[L*S, ...]`` with absolute slot ids ``slots [N]``,
    ``checkpoint_slots [N, P]``."""
    t_rows = x.shape[0]
    h, hv, k, v = cfg.kda_num_heads, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim
    proj = functools.partial(stacked_linear, j=j, impl=impl)
    full_rank = cfg.kda_full_rank_gate
    # two launches on the skinny path: the wide projections of x, then the narrow ones (their own tile width)
    q_lin, k_lin, v_lin, *g_full = stacked_linears(
        x, (p.q_proj, p.k_proj, p.v_proj) + ((p.g_proj,) if full_rank else ()), j, impl=impl)
    f_low, beta_logits, *g_low = stacked_linears(x, (p.f_a, p.b_proj) + (() if full_rank else (p.g_a,)), j,
                                                 impl=impl)
    qkv = jnp.concatenate([q_lin, k_lin, v_lin], axis=-1)
    g_raw = proj(f_low, p.f_b).reshape(t_rows, hv, k)  # x.dtype; the ops compute the gate in fp32
    gate = g_full[0] if full_rank else proj(g_low[0], p.g_b)
    if step.decode_only:  # the decode kernel casts in its loads: no separate convert kernel per layer
        return _decode(p, j, x, qkv, g_raw, beta_logits, gate, state_pool, conv_pool, slots, step, cfg, impl)
    if step.verify_len:
        return _verify(p, j, x, qkv, g_raw, beta_logits, gate, state_pool, conv_pool, slots, checkpoint_slots, step,
                       cfg, impl)
    g_raw, beta_logits = g_raw.astype(F32), beta_logits.astype(F32)  # [T, HV, K], [T, HV]

    fresh = (step.context_lens == 0)
    old_conv = jnp.where(fresh[:, None, None], 0.0, conv_pool[slots])  # [N, W-1, C]
    init_state = jnp.where(fresh[:, None, None, None], 0.0, state_pool[slots].astype(F32))

    windows = conv_windows(qkv, old_conv, step, layout)  # [T, W, C]
    conv = jnp.einsum("twc,cw->tc", windows.astype(F32), p.conv[j])
    qkv_act = jax.nn.silu(conv).astype(x.dtype)
    q = qkv_act[:, : h * k].reshape(t_rows, h, k)
    kk = qkv_act[:, h * k: 2 * h * k].reshape(t_rows, h, k)
    vv = qkv_act[:, 2 * h * k:].reshape(t_rows, hv, v)
    beta = jax.nn.sigmoid(beta_logits)

    ck_rel = jnp.where(step.checkpoint_positions >= 0, step.checkpoint_positions - step.context_lens[:, None], -1)
    ck_valid = (ck_rel >= 0) & (ck_rel <= layout.q_lens[:, None])
    ck_rel = jnp.where(ck_valid, ck_rel, -1)
    want_ck = step.checkpoint_positions.shape[1] > 0
    # The reference path uses the token-recurrent form: identical results, 2-3x cheaper to compile.
    chunk_impl = "recurrent" if resolve_impl(impl) == "reference" else impl
    o, final, ckpts = kda_ops.chunk_kda(
        q[None], kk[None], vv[None], g_raw[None], beta[None], initial_state=init_state,
        cu_seqlens=step.cu_seqlens, use_qk_l2norm=True, A_log=p.A_log[j], dt_bias=p.dt_bias[j],
        lower_bound=cfg.kda_gate_lower_bound, checkpoint_positions=ck_rel if want_ck else None, impl=chunk_impl)
    o = o[0]  # [T, HV, V]
    y = gated_rms_norm(o, gate.reshape(t_rows, hv, v), p.o_norm[j], cfg.rms_norm_eps)
    out = stacked_linear_unsummed(y.reshape(t_rows, hv * v), p.o_proj, j, impl=impl)

    # Write back the live state of every sequence (padded sequences write their unchanged scratch slot).
    starts = step.cu_seqlens[:-1]
    new_conv = conv_state_at(qkv, old_conv, starts, layout.q_lens[:, None])[:, 0]
    state_pool = state_pool.at[slots].set(final.astype(state_pool.dtype))
    conv_pool = conv_pool.at[slots].set(new_conv.astype(conv_pool.dtype))
    if want_ck:
        oob = state_pool.shape[0]  # dropped by the scatter
        dst = jnp.where(ck_valid, checkpoint_slots, oob).reshape(-1)
        ck_conv = conv_state_at(qkv, old_conv, starts, jnp.maximum(ck_rel, 0))
        state_pool = state_pool.at[dst].set(ckpts.reshape((-1,) + final.shape[1:]).astype(state_pool.dtype),
                                            mode="drop")
        conv_pool = conv_pool.at[dst].set(ck_conv.reshape((-1,) + new_conv.shape[1:]).astype(conv_pool.dtype),
                                          mode="drop")
    return out, state_pool, conv_pool


def _decode(p: KDAStack, j: int, x, qkv, g_raw, beta_logits, gate, state_pool, conv_pool, slots,
            step: StepInputs, cfg: ModelConfig, impl):
    """One token per sequence (row i = sequence i, all with cached context): the fused decode op updates the
    slots' conv and recurrent state in place and returns the gated-normed output."""
    t_rows = x.shape[0]
    if t_rows != step.num_seqs:
        raise ValueError(f"decode_only steps need one row per sequence, got T={t_rows}, N={step.num_seqs}")
    y, conv_pool, state_pool = kda_ops.fused_recurrent_kda(
        qkv, p.conv[...], conv_pool, g_raw.reshape(t_rows, -1), beta_logits, p.A_log[...], p.dt_bias[...],
        state_pool, slots, gate, p.o_norm[...], lower_bound=cfg.kda_gate_lower_bound, eps=cfg.rms_norm_eps, layer=j,
        impl=impl)
    return stacked_linear_unsummed(y.astype(x.dtype), p.o_proj, j, impl=impl), state_pool, conv_pool


def _verify(p: KDAStack, j: int, x, qkv, g_raw, beta_logits, gate, state_pool, conv_pool, slots, checkpoint_slots,
            step: StepInputs, cfg: ModelConfig, impl):
    """Speculative verification: every sequence owns ``Tq = step.verify_len`` consecutive rows (its last token and
    its drafts, padded), all with cached context. The fused verify op starts from each live slot, leaves it as it
    is, and writes the conv + recurrent state after fed token t into ``checkpoint_slots[n, t]`` where
    ``checkpoint_positions[n, t] >= 0``: the engine keeps the one of the accepted prefix, so a rejected draft
    never reaches the state the request continues from."""
    n, tq = step.num_seqs, step.verify_len
    if x.shape[0] != n * tq:
        raise ValueError(f"verify steps need {tq} rows per sequence, got T={x.shape[0]}, N={n}")
    out_slots = jnp.where(step.checkpoint_positions >= 0, checkpoint_slots, -1)
    y, conv_pool, state_pool = kda_ops.fused_recurrent_kda_verify(
        qkv.reshape(n, tq, -1), p.conv[...], conv_pool, g_raw.reshape(n, tq, -1), beta_logits.reshape(n, tq, -1),
        p.A_log[...], p.dt_bias[...], state_pool, slots, out_slots, gate.reshape(n, tq, -1), p.o_norm[...],
        lower_bound=cfg.kda_gate_lower_bound, eps=cfg.rms_norm_eps, layer=j, impl=impl)
    return stacked_linear_unsummed(y.reshape(n * tq, -1).astype(x.dtype), p.o_proj, j, impl=impl), state_pool, conv_pool
