"""Pure-jnp references for Kimi Delta Attention (fp32 math, flash-linear-attention layouts).

Glossary letters as in ``docs/design.md``. q/k heads ``H`` serve value heads ``HV = H * G`` (head ``h`` serves
``h*G .. h*G+G-1``). The state of one value head is ``S [K, V]`` (rows = key channels), always fp32.

* :func:`kda_gate` / :func:`l2_normalize`: the per-token gate and q/k normalisation (spec 1.3, 1.4).
* :func:`naive_recurrent_kda`: the exact token-by-token recurrence (spec 1.5), the oracle.
* :func:`chunk_kda_reference`: the chunkwise WY/UT form (spec 1.7) with varlen packing and state checkpoints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST
SOFTPLUS_THRESHOLD = 20.0


def gate_from_logits(z, a, lower_bound: float | None = None):
    """Log-decay from fp32 gate logits ``z = g_raw + dt_bias`` and ``a = exp(A_log)`` (broadcastable).

    ``lower_bound=None``: ``-a * softplus(z)`` (identity above 20, like the kernels);
    else ``lower_bound * sigmoid(a * z)``. Shared by the references and the Pallas kernels.
    """
    if lower_bound is None:
        softplus = jnp.where(z > SOFTPLUS_THRESHOLD, z, jnp.log1p(jnp.exp(jnp.minimum(z, SOFTPLUS_THRESHOLD))))
        return -a * softplus
    return lower_bound * jax.nn.sigmoid(a * z)


def kda_gate(g_raw, A_log, dt_bias, lower_bound: float | None = None):
    """Per-channel log-decay from the raw gate input.

    Args:
      g_raw: ``[..., HV, K]`` raw gate input (``f_b_proj(f_a_proj(x))``).
      A_log: ``[HV]``; dt_bias: ``[HV*K]``.
      lower_bound: ``None`` -> ``-exp(A_log) * softplus(z)`` (threshold 20); else
        ``lower_bound * sigmoid(exp(A_log) * z)``, with ``z = g_raw + dt_bias``.

    Returns:
      g: ``[..., HV, K]`` fp32, ``<= 0``.
    """
    num_value_heads, head_dim = g_raw.shape[-2:]
    z = g_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(num_value_heads, head_dim)
    return gate_from_logits(z, jnp.exp(A_log.astype(jnp.float32))[:, None], lower_bound)


def l2_normalize(x, eps: float = 1e-6):
    """``x / sqrt(sum(x**2, -1) + eps)`` in fp32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    return (xf * lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _expand_heads(x, num_value_heads):
    """``[..., H, K]`` -> ``[..., HV, K]`` (q/k head h serves value heads h*G .. h*G+G-1)."""
    return jnp.repeat(x, num_value_heads // x.shape[-2], axis=-2)


def _packed_layout(q, cu_seqlens):
    """Flatten ``[B, T, ...]`` to one packed stream; returns ``(cu_seqlens [N+1] int32, N)``."""
    batch, seq_len = q.shape[:2]
    if cu_seqlens is None:
        return jnp.arange(batch + 1, dtype=jnp.int32) * seq_len, batch
    if batch != 1:
        raise ValueError(f"cu_seqlens requires B == 1, got B={batch}")
    return cu_seqlens.astype(jnp.int32), cu_seqlens.shape[0] - 1


def _token_sequence_ids(cu_seqlens, num_tokens):
    """Sequence id of every packed token ``[T]``; tokens at or past ``cu_seqlens[N]`` get id ``N``."""
    return jnp.searchsorted(cu_seqlens[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right").astype(jnp.int32)


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Shared input handling: packed fp32 tensors with q/k expanded to HV heads and q scaled."""
    batch, seq_len, _, head_dim = q.shape
    num_value_heads, value_dim = v.shape[-2:]
    if scale is None:
        scale = head_dim**-0.5
    cu, num_seqs = _packed_layout(q, cu_seqlens)
    flat = lambda x: x.reshape((batch * seq_len,) + x.shape[2:]).astype(jnp.float32)
    qf = _expand_heads(flat(q), num_value_heads) * scale
    kf = _expand_heads(flat(k), num_value_heads)
    if initial_state is None:
        initial_state = jnp.zeros((num_seqs, num_value_heads, head_dim, value_dim), jnp.float32)
    return qf, kf, flat(v), flat(g), flat(beta), initial_state.astype(jnp.float32), cu, num_seqs


def naive_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                        checkpoint_positions=None):
    """Token-by-token KDA recurrence (spec 1.5).

    Args:
      q, k: ``[B, T, H, K]`` (already L2-normalised); v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]`` log-decay;
      beta: ``[B, T, HV]``.
      scale: multiplies q; default ``K**-0.5``.
      initial_state: ``[N, HV, K, V]`` (zeros if None).
      cu_seqlens: int32 ``[N+1]`` packed sequence boundaries (requires ``B == 1``); tokens past
        ``cu_seqlens[N]`` are ignored and get a zero output.
      checkpoint_positions: int32 ``[N, P]`` token counts into sequence n (0..len_n) at which to export the
        state, ``-1`` = unused (zeros there), as in :func:`chunk_kda_reference`.

    Returns:
      ``(o [B, T, HV, V] in q.dtype, final_state [N, HV, K, V] fp32)``, plus ``checkpoints [N, P, HV, K, V]``
      fp32 as a third element when ``checkpoint_positions`` is given.
    """
    batch, seq_len = q.shape[:2]
    qf, kf, vf, gf, bf, s0, cu, num_seqs = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    seq_ids = _token_sequence_ids(cu, batch * seq_len)
    counts = jnp.arange(batch * seq_len, dtype=jnp.int32) + 1 - cu[jnp.minimum(seq_ids, num_seqs - 1)]
    pool = jnp.concatenate([s0, jnp.zeros_like(s0[:1])])  # slot N absorbs tokens past the last sequence
    want = checkpoint_positions is not None
    positions = (jnp.full((num_seqs + 1, 1), -1, jnp.int32) if not want else
                 jnp.concatenate([checkpoint_positions.astype(jnp.int32),
                                  jnp.full((1, checkpoint_positions.shape[1]), -1, jnp.int32)]))
    ckpts = jnp.where((positions == 0)[:, :, None, None, None], pool[:, None], 0.0)

    def step(carry, xs):
        pool, ckpts = carry
        q_t, k_t, v_t, g_t, b_t, n, c = xs  # [HV, K], [HV, K], [HV, V], [HV, K], [HV], [], []
        state = pool[n] * jnp.exp(g_t)[:, :, None]
        error = v_t - jnp.einsum("hkv,hk->hv", state, k_t, precision=HIGHEST)
        state = state + b_t[:, None, None] * k_t[:, :, None] * error[:, None, :]
        o_t = jnp.einsum("hkv,hk->hv", state, q_t, precision=HIGHEST)
        hit = (positions[n] == c)[:, None, None, None]
        ckpts = ckpts.at[n].set(jnp.where(hit, state[None], ckpts[n]))
        return (pool.at[n].set(state), ckpts), jnp.where(n < num_seqs, o_t, 0.0)

    (pool, ckpts), o = lax.scan(step, (pool, ckpts), (qf, kf, vf, gf, bf, seq_ids, counts))
    o = o.reshape((batch, seq_len) + o.shape[1:]).astype(q.dtype)
    return (o, pool[:num_seqs], ckpts[:num_seqs]) if want else (o, pool[:num_seqs])


def _chunk_layout(cu_seqlens, num_seqs, num_tokens, chunk_size):
    """Static-shape scatter plan of a packed stream into per-sequence chunk-padded regions.

    Returns a dict with ``dest [T]`` (padded index of each token; out of range for tokens past the last
    sequence), ``chunk_start [N]`` / ``num_chunks [N]`` (first chunk and chunk count per sequence),
    ``chunk_seq [NC]`` (owning sequence of each chunk, ``N`` for unused chunks) and ``NC``.
    """
    max_chunks = num_tokens // chunk_size + num_seqs + 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    num_chunks = (lengths + chunk_size - 1) // chunk_size
    chunk_end = jnp.cumsum(num_chunks)
    chunk_start = chunk_end - num_chunks
    seq_ids = _token_sequence_ids(cu_seqlens, num_tokens)
    valid = seq_ids < num_seqs
    safe_ids = jnp.minimum(seq_ids, num_seqs - 1)
    position = jnp.arange(num_tokens, dtype=jnp.int32) - cu_seqlens[safe_ids]
    dest = jnp.where(valid, chunk_start[safe_ids] * chunk_size + position, max_chunks * chunk_size)
    chunk_seq = jnp.searchsorted(chunk_end, jnp.arange(max_chunks, dtype=jnp.int32), side="right")
    return dict(dest=dest, chunk_start=chunk_start, num_chunks=num_chunks, lengths=lengths,
                chunk_seq=chunk_seq.astype(jnp.int32), max_chunks=max_chunks)


def _chunk_step(state, q, k, v, G, beta):
    """One chunk for all value heads (spec 1.7). state ``[HV, K, V]``; q, k, G ``[C, HV, K]``; v ``[C, HV, V]``;
    beta ``[C, HV]``. Returns ``(state at chunk end, o [C, HV, V], u_tilde [C, HV, V])``."""
    chunk = q.shape[0]
    tril_incl = jnp.tril(jnp.ones((chunk, chunk), bool))
    tril_strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    log_ratio = G[:, None] - G[None, :]  # [C(r), C(c), HV, K]
    decay = jnp.exp(jnp.where(tril_incl[:, :, None, None], log_ratio, -jnp.inf))  # mask BEFORE exp
    a_kk = jnp.einsum("rhk,rchk,chk->hrc", k, decay, k, precision=HIGHEST)
    a_kk = jnp.where(tril_strict, a_kk * beta.T[:, :, None], 0.0)
    a_qk = jnp.where(tril_incl, jnp.einsum("rhk,rchk,chk->hrc", q, decay, k, precision=HIGHEST), 0.0)
    gamma = jnp.exp(G)
    rhs = jnp.concatenate([beta[:, :, None] * v, beta[:, :, None] * gamma * k], axis=-1).transpose(1, 0, 2)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    uw = lax.linalg.triangular_solve(eye + a_kk, rhs, left_side=True, lower=True, unit_diagonal=True)
    value_dim = v.shape[-1]
    u, w = uw[..., :value_dim], uw[..., value_dim:]  # [HV, C, V], [HV, C, K]
    u_tilde = u - jnp.einsum("hck,hkv->hcv", w, state, precision=HIGHEST)
    o = jnp.einsum("chk,hkv->chv", q * gamma, state, precision=HIGHEST)
    o = o + jnp.einsum("hrc,hcv->rhv", a_qk, u_tilde, precision=HIGHEST)
    k_to_end = k * jnp.exp(G[-1][None] - G)
    new_state = jnp.exp(G[-1])[:, :, None] * state
    new_state = new_state + jnp.einsum("chk,hcv->hkv", k_to_end, u_tilde, precision=HIGHEST)
    return new_state, o, u_tilde.transpose(1, 0, 2)


def _checkpoint_states(positions, layout, chunk_size, s0, chunk_states, chunk_G, chunk_k, chunk_u):
    """States after ``positions [N, P]`` tokens from chunk-start states plus a partial-chunk correction."""
    num_seqs = positions.shape[0]
    lengths = layout["lengths"][:, None]
    valid = (positions >= 0) & (positions <= lengths)
    p = jnp.maximum(positions, 1)
    chunk_id = layout["chunk_start"][:, None] + (p - 1) // chunk_size  # [N, P]
    chunk_id = jnp.clip(chunk_id, 0, layout["max_chunks"] - 1)
    rows = (p - 1) % chunk_size + 1  # tokens of that chunk included, 1..C
    G = chunk_G[chunk_id]  # [N, P, C, HV, K]
    G_r = jnp.take_along_axis(G, (rows - 1)[:, :, None, None, None], axis=2)  # [N, P, 1, HV, K]
    included = jnp.arange(chunk_size)[None, None, :] < rows[:, :, None]  # [N, P, C]
    k_decay = jnp.where(included[..., None, None], chunk_k[chunk_id] * jnp.exp(jnp.minimum(G_r - G, 0.0)), 0.0)
    states = jnp.exp(G_r[:, :, 0])[..., None] * chunk_states[chunk_id]
    states = states + jnp.einsum("npchk,npchv->nphkv", k_decay, chunk_u[chunk_id], precision=HIGHEST)
    states = jnp.where((positions == 0)[..., None, None, None], s0[:num_seqs, None], states)
    return jnp.where(valid[..., None, None, None], states, 0.0)


def chunk_kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                        checkpoint_positions=None, chunk_size: int = 64):
    """Chunkwise KDA (WY/UT form, spec 1.7), fp32, static shapes (jits with traced ``cu_seqlens``).

    Every sequence is scattered into its own chunk-padded region of ``NC = T//C + N + 1`` chunks (padding:
    zero q/k/v/beta, g = 0, which leaves the state unchanged); a ``lax.scan`` over chunks reads and writes each
    sequence's state in a pool, so states reset at sequence starts and zero-length sequences keep their
    initial state.

    Args:
      q, k, v, g, beta, scale, initial_state, cu_seqlens: as :func:`naive_recurrent_kda`.
      checkpoint_positions: int32 ``[N, P]`` token counts into sequence n (``0`` -> initial state,
        ``len_n`` -> final state); ``-1`` (or any value outside ``0..len_n``) gives zeros.
      chunk_size: ``C``.

    Returns:
      ``(o [B, T, HV, V] in q.dtype, final_state [N, HV, K, V] fp32, checkpoints [N, P, HV, K, V] fp32 | None)``.
    """
    batch, seq_len = q.shape[:2]
    num_tokens = batch * seq_len
    qf, kf, vf, gf, bf, s0, cu, num_seqs = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    layout = _chunk_layout(cu, num_seqs, num_tokens, chunk_size)
    num_padded = layout["max_chunks"] * chunk_size

    def to_chunks(x):
        padded = jnp.zeros((num_padded,) + x.shape[1:], x.dtype).at[layout["dest"]].set(x, mode="drop")
        return padded.reshape((layout["max_chunks"], chunk_size) + x.shape[1:])

    q_c, k_c, v_c, g_c, b_c = map(to_chunks, (qf, kf, vf, gf, bf))
    G_c = jnp.cumsum(g_c, axis=1)  # [NC, C, HV, K]
    pool = jnp.concatenate([s0, jnp.zeros_like(s0[:1])])  # slot N: unused trailing chunks
    want_checkpoints = checkpoint_positions is not None

    def step(pool, xs):
        n, q_j, k_j, v_j, G_j, b_j = xs
        start = pool[n]
        end, o_j, u_j = _chunk_step(start, q_j, k_j, v_j, G_j, b_j)
        saved = (o_j, start, u_j) if want_checkpoints else (o_j,)
        return pool.at[n].set(end), saved

    pool, saved = lax.scan(step, pool, (layout["chunk_seq"], q_c, k_c, v_c, G_c, b_c))
    o_padded = saved[0].reshape((num_padded,) + saved[0].shape[2:])
    o = jnp.take(o_padded, layout["dest"], axis=0, mode="fill", fill_value=0.0)
    o = o.reshape((batch, seq_len) + o.shape[1:]).astype(q.dtype)
    checkpoints = None
    if want_checkpoints:
        checkpoints = _checkpoint_states(checkpoint_positions.astype(jnp.int32), layout, chunk_size, s0,
                                         saved[1], G_c, k_c, saved[2])
    return o, pool[:num_seqs], checkpoints


def split_mixed_qkv(mixed, num_heads, head_dim, num_value_heads, value_dim):
    """``[..., 2*H*K + HV*V]`` -> ``q, k [..., H, K]``, ``v [..., HV, V]`` (channel order q | k | v)."""
    qk = num_heads * head_dim
    lead = mixed.shape[:-1]
    return (mixed[..., :qk].reshape(lead + (num_heads, head_dim)),
            mixed[..., qk:2 * qk].reshape(lead + (num_heads, head_dim)),
            mixed[..., 2 * qk:].reshape(lead + (num_value_heads, value_dim)))


def gated_rms_norm(o, gate_logits, weight, eps: float = 1e-5):
    """``RMSNorm_V(o) * weight * sigmoid(gate)`` per head, fp32. o, gate_logits ``[..., V]``; weight ``[V]``."""
    o = o.astype(jnp.float32)
    normed = o * lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    return normed * weight.astype(jnp.float32) * jax.nn.sigmoid(gate_logits.astype(jnp.float32))


def fused_recurrent_kda_reference(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state,
                                  slots, out_slots, gate_logits, o_norm_weight, *, lower_bound=None, scale=None,
                                  eps: float = 1e-5):
    """Decode / speculative-verify step for ``Tq`` tokens per sequence over slot pools (spec 1.2-1.6, 1.8).

    Per sequence n: causal depthwise conv over the pre-conv inputs continuing ``conv_state[slots[n]]`` + SiLU,
    q/k L2 norm, q scale, gate, ``beta = sigmoid(beta_logits)``, the recurrence from ``state[slots[n]]``, and the
    gated RMSNorm of the output. The conv and recurrent states after token t go to slot ``out_slots[n, t]``
    (skipped where negative), so decode (``Tq = 1``, ``out_slots = slots[:, None]``) updates in place and
    verify keeps every position.

    Args:
      mixed_qkv: ``[N, Tq, 2*H*K + HV*V]`` pre-conv projections (q | k | v channels).
      conv_weight: ``[C, W]`` taps (``[:, W-1]`` multiplies the current token); conv_state: ``[S, W-1, C]``.
      g_raw: ``[N, Tq, HV*K]``; beta_logits: ``[N, Tq, HV]``; A_log: ``[HV]``; dt_bias: ``[HV*K]``.
      state: ``[S, HV, K, V]`` (fp32 or bf16); slots: int32 ``[N]``; out_slots: int32 ``[N, Tq]``.
      gate_logits: ``[N, Tq, HV*V]`` output-gate logits; o_norm_weight: ``[V]``.

    Returns:
      ``(y [N, Tq, HV*V] in mixed_qkv.dtype, conv_state, state)`` with the pools updated.
    """
    num_seqs, num_tokens, channels = mixed_qkv.shape
    _, num_value_heads, head_dim, value_dim = state.shape
    width = conv_weight.shape[1]
    num_heads = (channels - num_value_heads * value_dim) // (2 * head_dim)
    window = jnp.concatenate([conv_state[slots].astype(jnp.float32), mixed_qkv.astype(jnp.float32)], axis=1)
    taps = conv_weight.astype(jnp.float32).T  # [W, C]
    conv = sum(taps[j] * window[:, j:j + num_tokens] for j in range(width))  # [N, Tq, C]
    q, k, v = split_mixed_qkv(jax.nn.silu(conv), num_heads, head_dim, num_value_heads, value_dim)
    g = kda_gate(g_raw.reshape(num_seqs, num_tokens, num_value_heads, head_dim), A_log, dt_bias, lower_bound)
    beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))
    q, k = l2_normalize(q), l2_normalize(k)
    states = []

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        o, s = naive_recurrent_kda(q_t[:, None], k_t[:, None], v_t[:, None], g_t[:, None], b_t[:, None],
                                   scale=scale, initial_state=s)
        return s, (o[:, 0], s)

    to_time_major = lambda x: jnp.moveaxis(x, 1, 0)
    _, (o, states) = lax.scan(step, state[slots].astype(jnp.float32), tuple(map(to_time_major, (q, k, v, g, beta))))
    o, states = to_time_major(o), to_time_major(states)  # [N, Tq, HV, V], [N, Tq, HV, K, V]
    y = gated_rms_norm(o, gate_logits.reshape(o.shape), o_norm_weight, eps).reshape(num_seqs, num_tokens, -1)
    conv_states = jnp.stack([window[:, t + 1:t + width] for t in range(num_tokens)], axis=1)  # [N, Tq, W-1, C]
    dest = jnp.where(out_slots < 0, state.shape[0], out_slots).reshape(-1)
    state = state.at[dest].set(states.reshape((-1,) + state.shape[1:]).astype(state.dtype), mode="drop")
    conv_state = conv_state.at[dest].set(conv_states.reshape((-1,) + conv_state.shape[1:]).astype(conv_state.dtype),
                                         mode="drop")
    return y.astype(mixed_qkv.dtype), conv_state, state
