"""Pallas (Triton-style) fused KDA decode / speculative-verify step over slot pools, updated in place.

One launch per layer, grid ``(N, H)``: the program of sequence n and q/k head h owns the conv channels of q/k
head h and of its ``G = HV // H`` value heads, so every conv-state channel and recurrent state is read and
written by one program (in place through ``input_output_aliases``). Per token: conv-state shift + causal conv +
SiLU on q/k/v, q/k L2 norm, gate, beta, the delta-rule update of the fp32 ``[K, V]`` state, and the gated
RMSNorm of the output. Semantics: :func:`pallas_kernels.kda.reference.fused_recurrent_kda_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tuning
from pallas_kernels.impl import interpret_mode, layer_stacks
from pallas_kernels.kda.config import WIDE_SPLIT_V, KDADecodeConfig
from pallas_kernels.kda.reference import gate_from_logits, gated_rms_norm

L2_EPS = 1e-6


def _l2norm(x):
    """``x / sqrt(sum(x^2) + eps)`` of a ``[K]`` vector (eps inside the sqrt, as the reference)."""
    return x * lax.rsqrt(jnp.sum(x * x) + L2_EPS)


@dataclasses.dataclass(frozen=True)
class _ConvChannels:
    """One program's view of its sequence's conv channels: the cached pre-conv rows at ``slot`` and the new
    tokens' inputs (``num_tokens``), the per-layer taps, and the pool rows it writes at ``out_slots``."""

    mixed_ref: object  # [N, Tq, C]
    conv_w_ref: object  # [L, C, W]
    conv_state_in_ref: object  # [S, W-1, C]
    conv_state_ref: object  # the same pool, written
    seq: object
    slot: object
    out_slots: list
    layer: int
    num_tokens: int

    def window(self, offset, size):
        """The W-1 cached pre-conv inputs then the Tq new ones, each fp32 ``[size]``, and the W taps."""
        width = self.conv_w_ref.shape[-1]
        rows = [self.conv_state_in_ref[self.slot, j, pl.ds(offset, size)].astype(jnp.float32)
                for j in range(width - 1)]
        rows += [self.mixed_ref[self.seq, t, pl.ds(offset, size)].astype(jnp.float32) for t in range(self.num_tokens)]
        taps = [self.conv_w_ref[self.layer, pl.ds(offset, size), j].astype(jnp.float32) for j in range(width)]
        return rows, taps

    def write(self, writes) -> None:
        """Each token's next conv rows of the channels in ``writes`` [(offset, rows)] into its output slot."""
        width = self.conv_w_ref.shape[-1]
        for t in range(self.num_tokens):
            @pl.when(self.out_slots[t] >= 0)
            def _():
                for offset, rows in writes:
                    for j in range(width - 1):
                        self.conv_state_ref[self.out_slots[t], j, pl.ds(offset, rows[0].shape[0])] = (
                            rows[t + 1 + j].astype(self.conv_state_ref.dtype))


def _conv_silu(rows, taps, t):
    """Causal conv of token t's window, then SiLU: fp32 ``[size]``."""
    c = sum(taps[j] * rows[t + j] for j in range(len(taps)))
    return c * jax.nn.sigmoid(c)


def _decay(g_raw, a_log_ref, dt_bias_ref, hv, layer, lower_bound):
    """``exp(gate)`` of value head ``hv`` from its raw gate row ``g_raw [K]``: fp32 ``[K]``."""
    decay_scale = jnp.exp(a_log_ref[layer, hv].astype(jnp.float32))
    z = g_raw.astype(jnp.float32) + dt_bias_ref[layer, hv, :].astype(jnp.float32)
    return jnp.exp(gate_from_logits(z, decay_scale, lower_bound))


def _recurrent_kernel(mixed_ref, conv_w_ref, conv_state_in_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref,
                      state_in_ref, slots_ref, out_slots_ref, gate_ref, norm_w_ref, y_ref, conv_state_ref, state_ref,
                      *, num_heads, group, num_tokens, scale, lower_bound, eps, use_barrier, block_v, layer):
    seq, head = pl.program_id(0), pl.program_id(1)
    head_dim, value_dim = state_ref.shape[-2:]
    slot = slots_ref[seq]
    out_slots = [out_slots_ref[seq, t] for t in range(num_tokens)]
    conv = _ConvChannels(mixed_ref, conv_w_ref, conv_state_in_ref, conv_state_ref, seq, slot, out_slots, layer,
                         num_tokens)
    qk_width = num_heads * head_dim
    q_rows, q_taps = conv.window(head * head_dim, head_dim)
    k_rows, k_taps = conv.window(qk_width + head * head_dim, head_dim)
    qs = [_l2norm(_conv_silu(q_rows, q_taps, t)) * scale for t in range(num_tokens)]
    ks = [_l2norm(_conv_silu(k_rows, k_taps, t)) for t in range(num_tokens)]
    conv_writes = [(head * head_dim, q_rows), (qk_width + head * head_dim, k_rows)]
    for i in range(group):
        hv = head * group + i
        gs = [_decay(g_ref[seq, t, pl.ds(hv * head_dim, head_dim)], a_log_ref, dt_bias_ref, hv, layer,
                     lower_bound)[:, None] for t in range(num_tokens)]
        betas = [jax.nn.sigmoid(beta_ref[seq, t, hv].astype(jnp.float32)) for t in range(num_tokens)]
        num_tiles = value_dim // block_v
        tile_rows = lax.broadcasted_iota(jnp.int32, (num_tiles, block_v), 0)

        def v_tile(i, outs):
            """V tile ``i``: a ``[K, block_v]`` slice of the state (the delta rule's V columns are independent)
            through every token; ``outs[t]`` ``[num_tiles, block_v]`` collects token t's output row by row."""
            v0 = i * block_v if isinstance(i, int) else pl.multiple_of(i * block_v, block_v)
            v_offset = 2 * qk_width + hv * value_dim + v0
            v_rows, v_taps = conv.window(v_offset, block_v)
            cols = pl.ds(v0, block_v)
            state = state_in_ref[slot, hv, :, cols].astype(jnp.float32)  # [K, block_v]
            new_outs = []
            for t in range(num_tokens):
                k = ks[t][:, None]
                state = state * gs[t]
                error = _conv_silu(v_rows, v_taps, t) - jnp.sum(state * k, axis=0)
                state = state + betas[t] * k * error[None, :]
                o = jnp.sum(state * qs[t][:, None], axis=0)
                new_outs.append(jnp.where(tile_rows == i, o[None, :], outs[t]))

                @pl.when(out_slots[t] >= 0)
                def _():
                    state_ref[out_slots[t], hv, :, cols] = state.astype(state_ref.dtype)
            if num_tiles == 1:
                conv_writes.append((v_offset, v_rows))  # with q / k's, after the barrier below
            else:  # this tile's conv channels are read by this iteration only: shift them now
                if use_barrier:
                    pltriton.debug_barrier()
                conv.write([(v_offset, v_rows)])
            return tuple(new_outs)

        init = tuple(jnp.zeros((num_tiles, block_v), jnp.float32) for _ in range(num_tokens))
        outs = v_tile(0, init) if num_tiles == 1 else lax.fori_loop(0, num_tiles, v_tile, init)
        for t in range(num_tokens):  # gated RMSNorm over the whole V
            inv_rms = lax.rsqrt(jnp.sum(outs[t] * outs[t]) / value_dim + eps)
            cols = pl.ds(hv * value_dim, value_dim)
            gate = jax.nn.sigmoid(gate_ref[seq, t, cols].astype(jnp.float32))
            norm_w = norm_w_ref[layer, :].astype(jnp.float32)
            y_ref[seq, t, cols] = (outs[t].reshape(value_dim) * inv_rms * norm_w * gate).astype(y_ref.dtype)

    if use_barrier:  # every thread has read the old conv rows before any is overwritten (in-place decode)
        pltriton.debug_barrier()
    conv.write(conv_writes)


def recurrent_smem_bytes(num_stages: int, block_v: int, value_dim: int, head_dim: int, width: int, num_tokens: int,
                         state_dtype) -> int:
    """Shared memory of the fused kernel (:mod:`pallas_kernels.tuning`'s estimate; it has no dots): the cross-warp
    reductions over K of each token's ``[K, block_v]`` products (fp32), and when it walks V slices (``block_v <
    V``) each slice's ``[K, block_v]`` state and ``W - 1 + Tq`` conv rows, ``num_stages`` deep."""
    step = tuning.nbytes(state_dtype, head_dim, block_v) + tuning.nbytes(jnp.float32, width - 1 + num_tokens, block_v)
    return (block_v < value_dim) * num_stages * step + tuning.nbytes(jnp.float32, 2 * num_tokens, block_v)


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def fused_recurrent_kda_pallas(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state, slots,
                               out_slots, gate_logits, o_norm_weight, *, lower_bound=None, scale=None,
                               eps: float = 1e-5, layer: int | None = None, config: KDADecodeConfig | None = None):
    """Pallas version of :func:`~pallas_kernels.kda.reference.fused_recurrent_kda_reference` (same arguments
    and returns; K and V powers of 2). The pools are updated in place when donated. ``config.block_v`` (a power
    of 2 dividing V; tuned null: V) walks the ``[K, V]`` state in ``[K, block_v]`` slices by a loop that Triton
    software-pipelines over ``sliced_stages`` stages, so a program holds one slice in registers while the next is
    in flight (the state columns are independent in the delta rule). Warps: ``fused_warps`` for one token,
    ``verify_warps`` for several (:class:`~pallas_kernels.kda.config.KDADecodeConfig`).
    ``layer``: conv_weight, A_log, dt_bias and o_norm_weight are per-layer stacks read at row ``layer`` in place
    (see :func:`fused_recurrent_kda_split_v_pallas`)."""
    num_seqs, num_tokens, channels = mixed_qkv.shape
    _, num_value_heads, head_dim, value_dim = state.shape
    (conv_weight, A_log, dt_bias, o_norm_weight), layer = layer_stacks(layer, conv_weight, A_log, dt_bias,
                                                                        o_norm_weight)
    width = conv_weight.shape[2]
    num_heads = (channels - num_value_heads * value_dim) // (2 * head_dim)
    interpret = interpret_mode()
    cfg = tuning.resolve(KDADecodeConfig, config)
    block_v = value_dim if cfg.block_v is None else cfg.block_v
    if value_dim % block_v:
        raise ValueError(f"block_v={block_v} must divide V={value_dim}")
    estimate = functools.partial(recurrent_smem_bytes, block_v=block_v, value_dim=value_dim, head_dim=head_dim,
                                 width=width, num_tokens=num_tokens, state_dtype=state.dtype)
    num_stages = 1 if block_v == value_dim else tuning.fit(
        "kda_fused_recurrent", cfg.sliced_stages, estimate, range(cfg.sliced_stages - 1, 0, -1),
        what=f"K={head_dim}, block_v={block_v}")
    kernel = functools.partial(
        _recurrent_kernel, num_heads=num_heads, group=num_value_heads // num_heads, num_tokens=num_tokens,
        scale=head_dim**-0.5 if scale is None else float(scale), lower_bound=lower_bound,
        eps=eps, use_barrier=not interpret, block_v=block_v, layer=layer)
    inputs = (mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log.astype(jnp.float32),
              dt_bias.astype(jnp.float32).reshape(-1, num_value_heads, head_dim), state, slots.astype(jnp.int32),
              out_slots.astype(jnp.int32), gate_logits, o_norm_weight)
    out_shape = (jax.ShapeDtypeStruct((num_seqs, num_tokens, num_value_heads * value_dim), mixed_qkv.dtype),
                 jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                 jax.ShapeDtypeStruct(state.shape, state.dtype))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(num_seqs, num_heads),
        in_specs=[_full(x.shape) for x in inputs], out_specs=tuple(_full(s.shape) for s in out_shape),
        input_output_aliases={2: 1, 7: 2},
        compiler_params=pltriton.CompilerParams(
            num_warps=cfg.fused_warps if num_tokens == 1 else cfg.verify_warps, num_stages=num_stages),
        interpret=interpret, name="kda_fused_recurrent",
    )(*inputs)


def _update_inputs_kernel(mixed_ref, conv_w_ref, conv_state_in_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref,
                          slots_ref, out_slots_ref, vecs_ref, scalars_ref, conv_state_ref, *, num_heads, group, scale,
                          lower_bound, use_barrier, layer):
    """Program (sequence, q/k head): :func:`_recurrent_kernel`'s work before the state update, for one token, written
    out per value head (``vecs [N, HV, 4, K]``: q, k, exp(gate), v; ``scalars [N, HV, 2]``: beta, beta (q . k)), and
    the head's channels of the next conv rows written in place."""
    seq, head = pl.program_id(0), pl.program_id(1)
    head_dim = vecs_ref.shape[-1]
    conv = _ConvChannels(mixed_ref, conv_w_ref, conv_state_in_ref, conv_state_ref, seq, slots_ref[seq],
                         [out_slots_ref[seq]], layer, 1)
    qk_width = num_heads * head_dim
    q_rows, q_taps = conv.window(head * head_dim, head_dim)
    k_rows, k_taps = conv.window(qk_width + head * head_dim, head_dim)
    q = _l2norm(_conv_silu(q_rows, q_taps, 0)) * scale
    k = _l2norm(_conv_silu(k_rows, k_taps, 0))
    qk = jnp.sum(q * k)
    writes = [(head * head_dim, q_rows), (qk_width + head * head_dim, k_rows)]
    first = lax.broadcasted_iota(jnp.int32, (2,), 0) == 0
    for i in range(group):
        hv = head * group + i
        v_offset = 2 * qk_width + hv * head_dim
        v_rows, v_taps = conv.window(v_offset, head_dim)
        vecs_ref[seq, hv, 0, :] = q
        vecs_ref[seq, hv, 1, :] = k
        vecs_ref[seq, hv, 2, :] = _decay(g_ref[seq, 0, pl.ds(hv * head_dim, head_dim)], a_log_ref, dt_bias_ref, hv,
                                         layer, lower_bound)
        vecs_ref[seq, hv, 3, :] = _conv_silu(v_rows, v_taps, 0)
        beta = jax.nn.sigmoid(beta_ref[seq, 0, hv].astype(jnp.float32))
        scalars_ref[seq, hv, :] = jnp.where(first, beta, beta * qk)
        writes.append((v_offset, v_rows))
    if use_barrier:  # every thread has read the old conv rows before any is overwritten (in place)
        pltriton.debug_barrier()
    conv.write(writes)


def kda_update_inputs_pallas(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, slots, out_slots,
                             *, lower_bound=None, scale=None, layer: int | None = None,
                             config: KDADecodeConfig | None = None):
    """The inputs of a separate state update (:mod:`pallas_kernels.kda.decode_mgpu`) for one decode token per
    sequence: conv-state shift (in place), causal conv + SiLU, q / k L2 norm, gate and beta, as
    :func:`fused_recurrent_kda_pallas` forms them (K = V; arguments as there, ``out_slots [N]``), with
    ``config.epilogue_warps`` warps per (sequence, q/k head) program.

    Returns ``(vecs [N, HV, 4, K] fp32: q (scaled), k, exp(gate), v; scalars [N, HV, 2] fp32: beta, beta (q . k);
    conv_state)``."""
    num_seqs, num_tokens, channels = mixed_qkv.shape
    num_value_heads = beta_logits.shape[-1]
    head_dim = g_raw.shape[-1] // num_value_heads
    num_heads = (channels - num_value_heads * head_dim) // (2 * head_dim)
    if num_tokens != 1:
        raise ValueError(f"kda_update_inputs_pallas takes one token per sequence, got {num_tokens}")
    (conv_weight, A_log, dt_bias), layer = layer_stacks(layer, conv_weight, A_log, dt_bias)
    interpret = interpret_mode()
    kernel = functools.partial(
        _update_inputs_kernel, num_heads=num_heads, group=num_value_heads // num_heads,
        scale=head_dim**-0.5 if scale is None else float(scale), lower_bound=lower_bound, use_barrier=not interpret,
        layer=layer)
    inputs = (mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log.astype(jnp.float32),
              dt_bias.astype(jnp.float32).reshape(-1, num_value_heads, head_dim), slots.astype(jnp.int32),
              out_slots.astype(jnp.int32))
    out_shape = (jax.ShapeDtypeStruct((num_seqs, num_value_heads, 4, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((num_seqs, num_value_heads, 2), jnp.float32),
                 jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(num_seqs, num_heads),
        in_specs=[_full(x.shape) for x in inputs], out_specs=tuple(_full(s.shape) for s in out_shape),
        input_output_aliases={2: 2},
        compiler_params=pltriton.CompilerParams(num_warps=tuning.resolve(KDADecodeConfig, config).epilogue_warps,
                                                num_stages=1),
        interpret=interpret, name="kda_decode_update_inputs",
    )(*inputs)


def _split_v_kernel(mixed_ref, conv_w_ref, conv_state_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, state_in_ref,
                    slots_ref, o_ref, state_ref, shifted_ref, *, group, width, scale, lower_bound, block_v, layer):
    v_block, value_head, seq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = state_ref.shape[-2]
    qk_width = (mixed_ref.shape[1] - state_ref.shape[1] * state_ref.shape[-1]) // 2
    head = value_head // group
    slot = slots_ref[seq]
    cols = pl.ds(pl.multiple_of(v_block * block_v, block_v), block_v)
    state = state_in_ref[slot, value_head, :, cols]  # [K, block_v]; issued first, in flight during the conv math

    def conv_silu(offset, size):
        """Causal conv of the W-1 cached inputs + the new one, then SiLU: fp32 ``[size]``."""
        c = (conv_w_ref[layer, pl.ds(offset, size), width - 1].astype(jnp.float32)
             * mixed_ref[seq, pl.ds(offset, size)].astype(jnp.float32))
        for j in range(width - 1):
            c += (conv_w_ref[layer, pl.ds(offset, size), j].astype(jnp.float32)
                  * conv_state_ref[slot, j, pl.ds(offset, size)].astype(jnp.float32))
        return c * jax.nn.sigmoid(c)

    def shift(offset, size):
        """These channels of the sequence's next conv state: the W-2 newest cached inputs, then the new one."""
        chans = pl.ds(offset, size)
        for j in range(width - 2):
            shifted_ref[seq, j, chans] = conv_state_ref[slot, j + 1, chans]
        shifted_ref[seq, width - 2, chans] = mixed_ref[seq, chans].astype(shifted_ref.dtype)

    q = _l2norm(conv_silu(head * head_dim, head_dim)) * scale
    k = _l2norm(conv_silu(qk_width + head * head_dim, head_dim))
    v_col = value_head * state_ref.shape[-1] + v_block * block_v
    v = conv_silu(2 * qk_width + v_col, block_v)
    if width > 1:
        shift(2 * qk_width + v_col, block_v)  # every program owns its V columns; one program per head its q / k

        @pl.when((v_block == 0) & (value_head % group == 0))
        def _():
            shift(head * head_dim, head_dim)
            shift(qk_width + head * head_dim, head_dim)

    g = _decay(g_ref[seq, pl.ds(value_head * head_dim, head_dim)], a_log_ref, dt_bias_ref, value_head, layer,
               lower_bound)
    beta = jax.nn.sigmoid(beta_ref[seq, value_head].astype(jnp.float32))
    state = state.astype(jnp.float32) * g[:, None]
    error = v - jnp.sum(state * k[:, None], axis=0)
    state = state + beta * k[:, None] * error[None, :]
    state_ref[slot, value_head, :, cols] = state.astype(state_ref.dtype)
    o_ref[seq, pl.ds(pl.multiple_of(v_col, block_v), block_v)] = jnp.sum(state * q[:, None], axis=0)


def _pow2_pieces(size: int) -> list[tuple[int, int]]:
    """``size`` as consecutive power-of-two pieces ``[(offset, width)]`` (Triton blocks are powers of two)."""
    pieces, offset = [], 0
    for bit in reversed(range(size.bit_length())):
        if size >> bit & 1:
            pieces.append((offset, 1 << bit))
            offset += 1 << bit
    return pieces


def _split_v_epilogue_kernel(o_ref, gate_ref, norm_w_ref, shifted_ref, slots_ref, conv_in_ref, y_ref, conv_ref, *,
                             layer, eps, chunk):
    """Program (sequence, value head): the head's gated RMSNorm, and this program's ``chunk`` channels of the
    sequence's next conv rows written into the pool at its slot (in place; the pool is aliased)."""
    del conv_in_ref  # the same buffer as conv_ref
    seq, value_head = pl.program_id(0), pl.program_id(1)
    value_dim = norm_w_ref.shape[1]
    cols = pl.ds(pl.multiple_of(value_head * value_dim, value_dim), value_dim)
    o = o_ref[seq, cols].astype(jnp.float32)
    normed = o * jax.lax.rsqrt(jnp.sum(o * o) / value_dim + eps) * norm_w_ref[layer, :].astype(jnp.float32)
    y_ref[seq, cols] = (normed * jax.nn.sigmoid(gate_ref[seq, cols].astype(jnp.float32))).astype(y_ref.dtype)
    slot = slots_ref[seq]
    for row in range(shifted_ref.shape[1]):
        for offset, width in _pow2_pieces(chunk):
            chans = pl.ds(value_head * chunk + offset, width)
            conv_ref[slot, row, chans] = shifted_ref[seq, row, chans]


def fused_recurrent_kda_split_v_pallas(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state,
                                       slots, gate_logits, o_norm_weight, *, lower_bound=None, scale=None,
                                       eps: float = 1e-5, layer: int | None = None,
                                       config: KDADecodeConfig | None = None):
    """Decode step (one token per sequence) with the state split over programs along V.

    Same arguments and results as :func:`pallas_kernels.kda.fused_recurrent_kda` (mixed_qkv ``[N, C]``, g_raw
    ``[N, HV*K]``, beta_logits ``[N, HV]``, gate_logits ``[N, HV*V]``, pools updated in place at ``slots``).
    Grid ``(V / block_v, HV, N)``: each program updates a ``[K, block_v]`` slice of one state (the delta rule's
    V columns are independent) with few warps, like flash-linear-attention's decode kernel, instead of one
    program holding the whole ``[K, V]`` state. The V slices of one state are neighbouring programs (4% faster at
    H=96 with an fp32 pool, 4-12% with bf16, equal at H=32). Every program recomputes
    its head's q/k conv (K values), so no program may overwrite the conv state that others still read: the
    programs write each sequence's next conv rows to a separate ``[N, W-1, C]`` output (every program its V
    columns, the first program of a head its q / k channels). A second kernel, grid ``(N, HV)``, then applies
    the gated RMSNorm (which needs all of V) and writes those rows into the pool at the slots, in place: one
    launch instead of XLA's four (the norm's reduction and scaling, the scatter's select and update).
    ``layer``: conv_weight, A_log, dt_bias and o_norm_weight are per-layer stacks; the kernel reads row ``layer``
    of the first three in place, where a sliced operand would cost an XLA copy (a memcpy node of the step's CUDA
    graph) per call. ``config.split_v`` above V means V; warps: ``split_v_warps`` from
    :data:`~pallas_kernels.kda.config.WIDE_SPLIT_V` columns, ``narrow_split_v_warps`` below (BENCHMARKS.md, KDA
    decode)."""
    num_seqs, channels = mixed_qkv.shape
    _, num_value_heads, head_dim, value_dim = state.shape
    num_heads = (channels - num_value_heads * value_dim) // (2 * head_dim)
    (conv_weight, A_log, dt_bias, o_norm_weight), layer = layer_stacks(layer, conv_weight, A_log, dt_bias,
                                                                        o_norm_weight)
    cfg = tuning.resolve(KDADecodeConfig, config)
    block_v = min(cfg.split_v or value_dim, value_dim)
    if value_dim % block_v:
        raise ValueError(f"split_v: block_v={block_v} must divide V={value_dim}")
    kernel = functools.partial(
        _split_v_kernel, group=num_value_heads // num_heads, width=conv_weight.shape[2], layer=layer,
        scale=head_dim**-0.5 if scale is None else float(scale), lower_bound=lower_bound, block_v=block_v)
    inputs = (mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log.astype(jnp.float32),
              dt_bias.astype(jnp.float32).reshape(-1, num_value_heads, head_dim), state, slots.astype(jnp.int32))
    out_shape = (jax.ShapeDtypeStruct((num_seqs, num_value_heads * value_dim), jnp.float32),
                 jax.ShapeDtypeStruct(state.shape, state.dtype),
                 jax.ShapeDtypeStruct((num_seqs,) + conv_state.shape[1:], conv_state.dtype))
    o, state, shifted = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(value_dim // block_v, num_value_heads, num_seqs),
        in_specs=[_full(x.shape) for x in inputs], out_specs=tuple(_full(s.shape) for s in out_shape),
        input_output_aliases={7: 1},
        compiler_params=pltriton.CompilerParams(
            num_warps=cfg.split_v_warps if block_v >= WIDE_SPLIT_V else cfg.narrow_split_v_warps, num_stages=1),
        interpret=interpret_mode(), name="kda_decode_split_v",
    )(*inputs)
    if channels % num_value_heads:  # the epilogue splits the conv channels evenly over the value heads
        shape = (num_seqs, num_value_heads, value_dim)
        y = gated_rms_norm(o.reshape(shape), gate_logits.reshape(shape), o_norm_weight[layer], eps)
        return y.reshape(num_seqs, -1).astype(mixed_qkv.dtype), conv_state.at[slots].set(shifted), state
    inputs = (o, gate_logits, o_norm_weight, shifted, slots.astype(jnp.int32), conv_state)
    out_shape = (jax.ShapeDtypeStruct(o.shape, mixed_qkv.dtype), jax.ShapeDtypeStruct(conv_state.shape,
                                                                                       conv_state.dtype))
    y, conv_state = pl.pallas_call(
        functools.partial(_split_v_epilogue_kernel, layer=layer, eps=float(eps),
                          chunk=channels // num_value_heads),
        out_shape=out_shape, grid=(num_seqs, num_value_heads),
        in_specs=[_full(x.shape) for x in inputs], out_specs=tuple(_full(s.shape) for s in out_shape),
        input_output_aliases={5: 1},
        compiler_params=pltriton.CompilerParams(num_warps=cfg.epilogue_warps, num_stages=1),
        interpret=interpret_mode(), name="kda_decode_epilogue",
    )(*inputs)
    return y, conv_state, state
