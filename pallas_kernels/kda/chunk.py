"""Pallas (Triton-style) chunked KDA prefill over packed varlen batches, with state checkpoints.

Three launches (spec 1.7), all reading the packed ``[T, ...]`` inputs in place (no padding copy):

1. ``_diagonal_kernel``, grid ``(NC, 4, HV)``, one 16-token sub-chunk per program: the diagonal blocks of
   ``A_kk``/``A_qk``, through the sub-chunk midpoint where the exponent span is bounded (always under the
   lower-bound gate; per block with ``adaptive_diagonal``), else through dyadic reference rows, and the inverse
   of each unit-lower ``I + A_kk`` block (a product of four factors). It also writes the sub-chunk cumsum of the
   log-decays (fp32 ``[T, HV, K]``, gate applied), so that the gate and the cumsum are computed once.
2. ``_intra_kernel``, grid ``(NC, HV)``, one 64-token chunk of one value head per program: optional q/k L2
   norm, in-chunk cumsum ``G`` from the diagonal launch's sub-chunk cumsums, then the off-diagonal blocks of
   ``A_kk``/``A_qk`` by 16-token sub-chunks (they factor through the sub-chunk start, so every exponent is
   <= 0), the unit-lower triangular solve by block forward substitution with the diagonal launch's inverses,
   and the chunk summaries ``w, u, qg = q*Gamma, kg = k*exp(G_C - G), A_qk, exp(G_C)``.
3. ``_scan_kernel``, grid ``(HV, V // BV, N)``, sequential over the chunks of one sequence (the sequences in
   decreasing length, so that the GPU starts every program of the longest sequence first): ``U = u - w S``,
   ``o = qg S + A_qk U``, ``S <- exp(G_C) S + kg^T U``, and the states at the requested checkpoint positions
   (chunk-start state plus a partial-chunk correction, recomputing that chunk's ``G`` from the raw inputs).

Dot operands use the input dtype (bf16 inputs -> bf16 tensor-core dots with fp32 accumulation, as
flash-linear-attention does); fp32 inputs use exact fp32 dots. Gate, cumsum, decays, state: always fp32. The
chunk summaries ``w, u, qg, kg, A_qk`` are stored in the dot dtype, which is what the scan's dots read them as.
On the GPU, ``exp`` and the gate's ``log1p`` and reciprocal are PTX approximations (``ex2`` / ``lg2`` / ``rcp
.approx.ftz``; ~2e-7 relative plus the rounding of ``x log2(e)``, below 1e-5 for the exponents here; the fp32
tests hold 1e-4 on the H200): libdevice's exact ``expf`` took a large share of the intra kernel's elementwise
instructions (H32 T8K 998.6 us against 1076.8 us; BENCHMARKS.md, KDA prefill). Interpret mode keeps ``jnp.exp``.

Launch knobs: :class:`pallas_kernels.kda.config.ChunkKDAConfig`. Shared memory (:mod:`pallas_kernels.tuning`):
the scan's pipelined chunk summaries dominate (:func:`scan_smem_bytes`), and fewer stages or a narrower
``block_v`` are taken where they do not fit (fp32 inputs at K = V = 128: one stage).
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
from pallas_kernels.impl import interpret_mode
from pallas_kernels.kda.config import ChunkKDAConfig
from pallas_kernels.kda.reference import SOFTPLUS_THRESHOLD, gate_from_logits

CHUNK = 64
SUB = 16
NUM_SUB = CHUNK // SUB
L2_EPS = 1e-6
# The midpoint factorisation of a 16-token diagonal block forms exp(+-8 |g|); |g| <= 10 keeps it below e^80.
MIDPOINT_MAX_DECAY = 10.0
MIDPOINT_MAX_SPAN = SUB // 2 * MIDPOINT_MAX_DECAY
"""Largest ``max |G_r - G_mid|`` of a block's cumsum for which any gate takes the midpoint form (e^+-80)."""
LOG2_E, LN_2 = 1.4426950408889634, 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class _Options:
    """Static options shared by the kernels."""

    group: int  # value heads per q/k head (HV // H)
    scale: float
    normalize_qk: bool
    has_gate: bool
    lower_bound: float | None
    dot_dtype: jnp.dtype
    fast_math: bool  # PTX ex2 / lg2 / rcp approximations (GPU) in place of libdevice's exact expf / log1pf / divide
    adaptive_diagonal: bool = False  # unbounded gates: the midpoint form per block where its span allows

    def exp(self, x):
        """``exp`` of an fp32 tile: ``ex2.approx.ftz(x log2 e)`` with ``fast_math``, else ``jnp.exp``."""
        return _ptx_unary("ex2.approx.ftz.f32", x * LOG2_E) if self.fast_math else jnp.exp(x)

    def log_decay(self, z, a):
        """:func:`gate_from_logits` of fp32 logits ``z`` and ``a = exp(A_log)``; with ``fast_math`` from the
        approximations (absolute error ~1e-7 on the log-decay where ``1 + exp(z)`` rounds to 1)."""
        if not self.fast_math:
            return gate_from_logits(z, a, self.lower_bound)
        if self.lower_bound is not None:
            return self.lower_bound * _ptx_unary("rcp.approx.ftz.f32", 1.0 + self.exp(-a * z))
        capped = jnp.minimum(z, SOFTPLUS_THRESHOLD)
        softplus = LN_2 * _ptx_unary("lg2.approx.ftz.f32", 1.0 + self.exp(capped))
        return -a * jnp.where(z > SOFTPLUS_THRESHOLD, z, softplus)

    @property
    def midpoint_diagonal(self) -> bool:
        return self.has_gate and self.lower_bound is not None and -self.lower_bound <= MIDPOINT_MAX_DECAY


def _ptx_unary(instruction: str, x):
    """One PTX ``instruction d, a`` per fp32 element of ``x`` (GPU only)."""
    return pltriton.elementwise_inline_asm(f"{instruction} $0, $1;", args=[x], constraints="=f,f", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def _dot(a, b, dtype, *, trans_a=False, trans_b=False):
    """``a @ b`` (optionally transposed operands) with fp32 accumulation; fp32 operands use exact fp32."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return lax.dot_general(a.astype(dtype), b.astype(dtype), dims, precision=precision,
                           preferred_element_type=jnp.float32)


def _row_mask(num_valid, rows):
    return lax.broadcasted_iota(jnp.int32, (rows,), 0) < num_valid


def _load_rows(ref, start, head, num_valid, rows):
    """fp32 ``[rows, width]`` tile of ``ref [T, heads, width]`` from token ``start``; rows >= num_valid are 0."""
    mask = _row_mask(num_valid, rows)
    return pltriton.load(ref.at[pl.ds(start, rows), head, :], mask=mask[:, None], other=0).astype(jnp.float32)


def _load_qk_rows(ref, start, head, num_valid, rows, opts):
    x = _load_rows(ref, start, head, num_valid, rows)
    if opts.normalize_qk:
        x = x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)
    return x


def _load_log_decay(g_ref, a_log_ref, dt_bias_ref, start, head, num_valid, rows, opts):
    """fp32 log-decay ``[rows, K]`` (gate applied when ``opts.has_gate``); rows >= num_valid are 0."""
    g = _load_rows(g_ref, start, head, num_valid, rows)
    if opts.has_gate:
        z = g + dt_bias_ref[head, :].astype(jnp.float32)[None, :]
        g = opts.log_decay(z, jnp.exp(a_log_ref[head].astype(jnp.float32)))
        g = jnp.where(_row_mask(num_valid, rows)[:, None], g, 0.0)
    return g


def _select_row(x, r):
    """Row ``r`` (traced) of a ``[rows, width]`` tile as a ``[width]`` vector."""
    rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == r, x, 0.0), axis=0)


def _diagonal_block_dyadic(q, k, log_decay, opts):
    """``(k k^T * D, q k^T * D)`` for one 16-token block, ``D_rc = exp(G_r - G_c)`` for ``c < r`` (the ``q k^T``
    block also takes the diagonal ``q_r . k_r``; above it both are 0), from the block's log-decays ``[SUB, K]``,
    for any gate. A pair ``c < r`` falls in exactly one dyadic level ``b`` of 8, 4, 2, 1: the one where ``r`` and
    ``c`` share a ``2b``-row group but not its ``b``-row half. Through the group's reference row (the last of its
    first half) ``D_rc = exp(G_r - G_ref) exp(G_ref - G_c)``, and both factors are <= 1. Their exponents are
    segmented sums over the ``b``-row halves: a row's log-decays through it in its half (rows) and those after
    it in its half (columns), an in-register cumsum of the ``[16 / b, b, K]`` reshape. Per level: one
    exponential per element and two ``[SUB, K] x [K, SUB]`` dots in the dot dtype; no row loop, row selects or
    exponent dots (H32 T8K, softplus gate: 373.1 us against 449.3 with the exponents as fp32 ``S_b @ log_decay``
    dots, and 568.5 for a masked row loop; BENCHMARKS.md, KDA prefill)."""
    rows = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    cols = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    row_index = lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    a_kk = jnp.zeros((SUB, SUB), jnp.float32)
    a_qk = jnp.where(rows == cols, jnp.sum(q * k, axis=1)[:, None], 0.0)
    second_half = lambda i, b: (i // b) % 2 == 1  # noqa: E731
    for b in (8, 4, 2, 1):
        same_group = rows // (2 * b) == cols // (2 * b)
        in_rows = second_half(row_index, b)  # rows of a pair sit in a second half, columns in a first
        segments = log_decay.reshape(SUB // b, b, log_decay.shape[-1])  # b-row halves
        through = jnp.cumsum(segments, axis=1)  # row r of a half: the log-decays of its half up to r
        after = jnp.sum(segments, axis=1, keepdims=True) - through  # those after r in its half
        factor = opts.exp(jnp.where(in_rows, through.reshape(log_decay.shape), after.reshape(log_decay.shape)))
        row_factor = jnp.where(in_rows, factor, 0.0)
        k_col, k_row, q_row = jnp.where(in_rows, 0.0, factor) * k, row_factor * k, row_factor * q
        a_kk = a_kk + jnp.where(same_group, _dot(k_row, k_col, opts.dot_dtype, trans_b=True), 0.0)
        a_qk = a_qk + jnp.where(same_group, _dot(q_row, k_col, opts.dot_dtype, trans_b=True), 0.0)
    return a_kk, a_qk


def _diagonal_block_midpoint(q, k, G, mid, opts):
    """:func:`_diagonal_block_dyadic`'s blocks from the cumsum ``G`` through its midpoint row ``mid = G[SUB // 2]``
    (``[1, K]``): exponents bounded by ``max |G - mid|`` (8 |g| under the lower-bound gate), one exponential per
    element and two dots (160.4 us at H32 T8K against 435.5 for the dyadic form with this gate)."""
    k_out, from_mid, dtype = k * opts.exp(mid - G), opts.exp(G - mid), opts.dot_dtype
    return _dot(k * from_mid, k_out, dtype, trans_b=True), _dot(q * from_mid, k_out, dtype, trans_b=True)


def _diagonal_block_any_gate(q, k, log_decay, G, opts):
    """The diagonal blocks for a gate that bounds nothing: the midpoint form where this block's cumsum ``G`` stays
    within :data:`MIDPOINT_MAX_SPAN` of its midpoint row (the exponents then stay as bounded as the lower-bound
    gate keeps them: no overflow, no fp32 underflow), else the dyadic form. One branch per program."""
    mid = _select_row(G, SUB // 2)[None, :]
    return lax.cond(jnp.max(jnp.abs(G - mid)) <= MIDPOINT_MAX_SPAN,
                    lambda: _diagonal_block_midpoint(q, k, G, mid, opts),
                    lambda: _diagonal_block_dyadic(q, k, log_decay, opts))


def _tril(strict):
    """``[SUB, SUB]`` mask of the lower triangle, with (``strict=False``) or without the diagonal."""
    rows = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    cols = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    return cols < rows if strict else cols <= rows


def _unit_lower_inverse(a):
    """``(I + a)^-1`` for strictly lower ``a [SUB, SUB]`` (fp32). ``a`` is nilpotent (``a^16 = 0``), so the
    inverse is the finite series ``sum_k (-a)^k = (I - a)(I + a^2)(I + a^4)(I + a^8)``: six 16 x 16 products with
    no data-dependent order, where forward substitution needs 16 dependent row steps, each a reduction across
    the program's threads."""
    eye = (lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0) == lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1))
    eye = eye.astype(jnp.float32)
    inverse, power = eye - a, a
    for _ in range(3):
        power = _dot(power, power, jnp.float32)
        inverse = _dot(inverse, eye + power, jnp.float32)
    return inverse


def _diagonal_kernel(chunk_bos_ref, chunk_len_ref, q_ref, k_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, t_ref,
                     qk_ref, glocal_ref, *, opts: _Options):
    """Program (chunk, sub-chunk, value head): the sub-chunk's diagonal blocks (the midpoint form where the
    lower-bound gate or, with ``adaptive_diagonal``, the block's own span allows it, else the dyadic form), ready
    for the intra kernel: ``t = (I + tril_strict(beta k k^T * D))^-1`` and ``tril(q k^T * D)`` (``[SUB, SUB]`` in
    the dot dtype), from a cumsum local to the sub-chunk (only differences of ``G`` enter ``D``). Inverting here
    takes six chained 16 x 16 products per sub-chunk out of the 255-register intra kernel. Rows past the sequence
    load as zeros; a sub-chunk with none left (the last chunk's tail, the padding chunks) skips the block and stores
    zeros, since the intra kernel reads every sub-chunk of a chunk it computes and its blocks must stay finite. The
    sub-chunk cumsum of the log-decays goes to ``glocal_ref [T, HV, K]`` (valid rows only) for the intra kernel,
    which then applies neither the gate nor the cumsum (H32 T8K: intra 366.5 us against 477.4, this launch +30
    us). The q / k L2 norm is still computed in both launches: writing it out once would cost about as
    much as it saves, by instruction count (not timed)."""
    chunk, sub, hv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head = hv // opts.group
    start, valid = chunk_bos_ref[chunk] + sub * SUB, chunk_len_ref[chunk] - sub * SUB

    @pl.when(valid > 0)
    def _():
        q = _load_qk_rows(q_ref, start, head, valid, SUB, opts) * opts.scale
        k = _load_qk_rows(k_ref, start, head, valid, SUB, opts)
        log_decay = _load_log_decay(g_ref, a_log_ref, dt_bias_ref, start, hv, valid, SUB, opts)
        g_local = jnp.cumsum(log_decay, axis=0)
        pltriton.store(glocal_ref.at[pl.ds(start, SUB), hv, :], g_local, mask=_row_mask(valid, SUB)[:, None])
        if opts.midpoint_diagonal:
            a_kk, a_qk = _diagonal_block_midpoint(q, k, g_local, _select_row(g_local, SUB // 2)[None, :], opts)
        elif opts.adaptive_diagonal:
            a_kk, a_qk = _diagonal_block_any_gate(q, k, log_decay, g_local, opts)
        else:
            a_kk, a_qk = _diagonal_block_dyadic(q, k, log_decay, opts)
        beta = pltriton.load(beta_ref.at[pl.ds(start, SUB), hv], mask=_row_mask(valid, SUB),
                             other=0).astype(jnp.float32)[:, None]
        t_ref[...] = _unit_lower_inverse(jnp.where(_tril(strict=True), a_kk * beta, 0.0)).astype(t_ref.dtype)
        qk_ref[...] = jnp.where(_tril(strict=False), a_qk, 0.0).astype(qk_ref.dtype)

    @pl.when(valid <= 0)
    def _():
        t_ref[...] = jnp.zeros((SUB, SUB), t_ref.dtype)
        qk_ref[...] = jnp.zeros((SUB, SUB), qk_ref.dtype)


def _intra_kernel(chunk_bos_ref, chunk_len_ref, q_ref, k_ref, v_ref, glocal_ref, beta_ref, *refs, opts: _Options):
    """``refs``: the diagonal blocks ``[NUM_SUB, SUB, SUB]`` of :func:`_diagonal_kernel` (t, qk), then the outputs
    ``w, u, qg, kg, aqk, decay``. Each earlier sub-chunk ``j`` stays live as ``k_j exp(G_end_j - G_j)`` and the
    vector ``G_end_j`` (its last row of ``G``), not as its ``k`` and ``G`` tiles: fewer live registers and one
    tile exponential per use instead of two (H32 T8K: 472.9 us against 512.7). ``glocal_ref``: the
    diagonal launch's sub-chunk cumsums of the log-decays; ``G`` adds the previous sub-chunk's end to them."""
    t_diag_ref, qk_diag_ref, w_ref, u_ref, qg_ref, kg_ref, aqk_ref, decay_ref = refs
    chunk, hv = pl.program_id(0), pl.program_id(1)
    head = hv // opts.group
    bos, num_valid = chunk_bos_ref[chunk], chunk_len_ref[chunk]
    dtype = opts.dot_dtype

    @pl.when(num_valid > 0)
    def _():
        offset = jnp.zeros((k_ref.shape[-1],), jnp.float32)  # G at the end of the previous sub-chunk
        keys, ends, solved = [], [], []  # k_j exp(G_end_j - G_j), G_end_j [K], (u_j, w_j)
        for i in range(NUM_SUB):
            start, valid = bos + i * SUB, num_valid - i * SUB
            q = _load_qk_rows(q_ref, start, head, valid, SUB, opts) * opts.scale
            k = _load_qk_rows(k_ref, start, head, valid, SUB, opts)
            v = _load_rows(v_ref, start, hv, valid, SUB)
            beta = pltriton.load(beta_ref.at[pl.ds(start, SUB), hv], mask=_row_mask(valid, SUB),
                                 other=0).astype(jnp.float32)[:, None]
            g_local = _load_rows(glocal_ref, start, hv, valid, SUB)  # rows past the sequence: 0
            G = offset[None, :] + g_local
            aqk_ref[pl.ds(i * SUB, SUB), pl.ds(i * SUB, SUB)] = qk_diag_ref[i].astype(aqk_ref.dtype)
            t_ii = t_diag_ref[i]
            gamma = opts.exp(G)
            rhs_u, rhs_w = beta * v, beta * gamma * k
            from_offset = opts.exp(g_local)  # exp(G - offset)
            q_in, k_in = q * from_offset, k * from_offset
            for j in range(NUM_SUB):
                if j < i:  # rows in sub-chunk i, columns in sub-chunk j < i, through G at the end of sub-chunk i-1
                    k_out = keys[j] * opts.exp(offset - ends[j])[None, :]
                    a_ij = beta * _dot(k_in, k_out, dtype, trans_b=True)
                    aqk_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = _dot(q_in, k_out, dtype, trans_b=True).astype(
                        aqk_ref.dtype)
                    rhs_u = rhs_u - _dot(a_ij, solved[j][0], dtype)
                    rhs_w = rhs_w - _dot(a_ij, solved[j][1], dtype)
                elif j > i:
                    aqk_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)
            u, w = _dot(t_ii, rhs_u, dtype), _dot(t_ii, rhs_w, dtype)
            u_ref[pl.ds(i * SUB, SUB), :] = u.astype(u_ref.dtype)
            w_ref[pl.ds(i * SUB, SUB), :] = w.astype(w_ref.dtype)
            qg_ref[pl.ds(i * SUB, SUB), :] = (q * gamma).astype(qg_ref.dtype)
            end = offset + _select_row(g_local, jnp.clip(valid, 1, SUB) - 1)  # G at the last valid row
            keys.append(k * opts.exp(end[None, :] - G))
            ends.append(end)
            solved.append((u, w))
            offset = end
        for i in range(NUM_SUB):
            kg_ref[pl.ds(i * SUB, SUB), :] = (keys[i] * opts.exp(offset - ends[i])[None, :]).astype(kg_ref.dtype)
        decay_ref[...] = opts.exp(offset)


def _scan_kernel(seq_order_ref, seq_chunk0_ref, seq_num_chunks_ref, seq_bos_ref, seq_len_ref, positions_ref, w_ref,
                 u_ref, qg_ref, kg_ref, aqk_ref, decay_ref, s0_ref, k_ref, g_ref, a_log_ref, dt_bias_ref, end_ref,
                 o_ref, final_ref, *checkpoint_refs, opts: _Options, block_v: int, num_positions: int,
                 has_initial_state: bool):
    hv, iv = pl.program_id(0), pl.program_id(1)
    seq = seq_order_ref[pl.program_id(2)]  # longest first: the last axis is the slowest in launch order
    head = hv // opts.group
    vs = pl.ds(iv * block_v, block_v)
    chunk0, num_chunks = seq_chunk0_ref[seq], seq_num_chunks_ref[seq]
    bos, length = seq_bos_ref[seq], seq_len_ref[seq]
    dtype = opts.dot_dtype
    head_dim = w_ref.shape[-1]
    state = (s0_ref[seq, hv, :, vs].astype(jnp.float32) if has_initial_state
             else jnp.zeros((head_dim, block_v), jnp.float32))
    for p in range(num_positions):
        position = positions_ref[seq, p]

        @pl.when((position == 0) | (position < 0) | (position > length))
        def _():
            checkpoint_refs[0][seq, p, hv, :, vs] = jnp.where(position == 0, state, 0.0)

    rows = lax.broadcasted_iota(jnp.int32, (CHUNK, 1), 0)

    def body(local, state):
        chunk = chunk0 + local
        start, valid = bos + local * CHUNK, length - local * CHUNK
        state_in = state.astype(dtype)
        u_tilde = u_ref[hv, chunk, :, vs].astype(jnp.float32) - _dot(w_ref[hv, chunk], state_in, dtype)
        o = _dot(qg_ref[hv, chunk], state_in, dtype) + _dot(aqk_ref[hv, chunk], u_tilde, dtype)
        pltriton.store(o_ref.at[pl.ds(start, CHUNK), hv, vs], o.astype(o_ref.dtype),
                       mask=_row_mask(valid, CHUNK)[:, None])
        for p in range(num_positions):
            position = positions_ref[seq, p]

            @pl.when((position > 0) & (position <= length) & ((position - 1) // CHUNK == local))
            def _():
                taken = position - local * CHUNK  # 1..CHUNK tokens of this chunk
                k = _load_qk_rows(k_ref, start, head, valid, CHUNK, opts)
                G = jnp.cumsum(_load_log_decay(g_ref, a_log_ref, dt_bias_ref, start, hv, valid, CHUNK, opts),
                               axis=0)
                G_r = _select_row(G, taken - 1)[None, :]
                k_to_r = k * opts.exp(jnp.where(rows < taken, G_r - G, -jnp.inf))
                checkpoint_refs[0][seq, p, hv, :, vs] = (
                    opts.exp(G_r).reshape(head_dim, 1) * state + _dot(k_to_r, u_tilde, dtype, trans_a=True))

        decay = decay_ref[hv, chunk].reshape(head_dim, 1)
        return decay * state + _dot(kg_ref[hv, chunk], u_tilde, dtype, trans_a=True)

    state = lax.fori_loop(0, num_chunks, body, state)
    final_ref[seq, hv, :, vs] = state

    # every other row of o is some sequence's: the last-launched program (the shortest sequence's) zeroes the rest
    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        end, num_rows = end_ref[0], o_ref.shape[0]

        def zero(i, carry):
            start = end + i * CHUNK
            pltriton.store(o_ref.at[pl.ds(start, CHUNK), hv, vs], jnp.zeros((CHUNK, block_v), o_ref.dtype),
                           mask=_row_mask(num_rows - start, CHUNK)[:, None])
            return carry

        lax.fori_loop(0, (num_rows - end + CHUNK - 1) // CHUNK, zero, 0)


def scan_smem_bytes(cfg: ChunkKDAConfig, head_dim: int, value_dim: int, dot_dtype, checkpoints: bool) -> int:
    """Shared memory of the scan (:mod:`pallas_kernels.tuning`'s estimate): per loop step it loads one chunk's
    ``w, qg, kg [C, K]``, ``u [C, block_v]``, ``A_qk [C, C]`` (dot dtype) and ``exp(G_C) [K]`` (fp32),
    ``scan_stages`` deep; the state ``[K, block_v]``, ``U [C, block_v]`` and, with checkpoints, ``k exp(G_r - G)
    [C, K]`` are built in registers and staged into its dots."""
    block_v = min(cfg.block_v, value_dim)
    step = (tuning.nbytes(dot_dtype, CHUNK, 3 * head_dim + block_v + CHUNK) + tuning.nbytes(jnp.float32, head_dim))
    staged = tuning.nbytes(dot_dtype, head_dim + CHUNK, block_v) + checkpoints * tuning.nbytes(dot_dtype, CHUNK,
                                                                                              head_dim)
    return cfg.scan_stages * step + staged


def intra_smem_bytes(head_dim: int, value_dim: int, dot_dtype) -> int:
    """Shared memory of the intra kernel (no loop, so nothing is pipelined): per sub-chunk the dot operands it
    builds (``q, k`` scaled through the sub-chunk start, the kept keys ``[SUB, K]``, both right-hand sides, the
    ``[SUB, SUB]`` blocks), the solved ``u, w`` of every sub-chunk, live until the chunk's last, and the diagonal
    launch's ``[NUM_SUB, SUB, SUB]`` blocks."""
    per_sub = tuning.nbytes(dot_dtype, SUB, 4 * head_dim + value_dim + 2 * SUB)
    return per_sub + tuning.nbytes(dot_dtype, NUM_SUB * SUB, head_dim + value_dim + 2 * SUB)


def fit_config(config: ChunkKDAConfig | None, head_dim: int, value_dim: int, dot_dtype,
               checkpoints: bool) -> ChunkKDAConfig:
    """The resolved config with a scan that fits the device's shared memory (fewer ``scan_stages``, then a
    narrower ``block_v``, down to 16); ValueError when K / V are too wide for any (or for the intra kernel)."""
    cfg = tuning.resolve(ChunkKDAConfig, config)
    cfg = dataclasses.replace(cfg, block_v=min(cfg.block_v, value_dim))
    what = f"K={head_dim}, V={value_dim} with {jnp.dtype(dot_dtype).name} inputs"
    tuning.fit("kda_chunk_intra", cfg, lambda c: intra_smem_bytes(head_dim, value_dim, dot_dtype), what=what)
    return tuning.fit("kda_chunk_scan", cfg, lambda c: scan_smem_bytes(c, head_dim, value_dim, dot_dtype, checkpoints),
                      tuning.smaller(cfg, "scan_stages", [("block_v", 16)]), what=what)


def _chunk_plan(cu_seqlens, num_seqs, num_tokens):
    """Chunk metadata (int32): per chunk ``bos``/``len`` over a static ``NC = T//C + N + 1``; per sequence the
    first chunk, chunk count, ``bos`` and length."""
    max_chunks = num_tokens // CHUNK + num_seqs + 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    num_chunks = (lengths + CHUNK - 1) // CHUNK
    chunk_end = jnp.cumsum(num_chunks)
    chunk0 = chunk_end - num_chunks
    index = jnp.arange(max_chunks, dtype=jnp.int32)
    seq = jnp.searchsorted(chunk_end, index, side="right", method="scan_unrolled")
    safe = jnp.minimum(seq, num_seqs - 1)
    local = index - chunk0[safe]
    chunk_bos = cu_seqlens[safe] + local * CHUNK
    chunk_len = jnp.where(seq < num_seqs, jnp.clip(lengths[safe] - local * CHUNK, 0, CHUNK), 0)
    i32 = lambda x: x.astype(jnp.int32)
    return max_chunks, tuple(map(i32, (chunk_bos, chunk_len))), tuple(map(i32, (chunk0, num_chunks,
                                                                               cu_seqlens[:-1], lengths)))


def _full(shape):
    """BlockSpec handing the kernel the whole array (in-kernel data-dependent indexing)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def chunk_kda_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                     checkpoint_positions=None, use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None,
                     config: ChunkKDAConfig | None = None):
    """Pallas chunked KDA; same contract as :func:`pallas_kernels.kda.chunk_kda` (K, V powers of 2, >= 16).

    Three launches: the diagonal blocks, grid (chunk, sub-chunk, value head), each inverting its 16 x 16 block
    (H32 T8K, softplus gate: 1394.0 us against 1461.7 with the inverses in the intra kernel), then the intra
    kernel, then the scan. ``config``: launch knobs (None fields: tuned, see
    :class:`~pallas_kernels.kda.config.ChunkKDAConfig`), shrunk to what the device's shared memory holds
    (:func:`fit_config`).

    Returns ``(o [B, T, HV, V] in q.dtype, final_state [N, HV, K, V] fp32, checkpoints [N, P, HV, K, V] fp32
    | None)``.
    """
    batch, seq_len, num_heads, head_dim = q.shape
    num_value_heads, value_dim = v.shape[-2:]
    num_tokens = batch * seq_len
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(batch + 1, dtype=jnp.int32) * seq_len
    elif batch != 1:
        raise ValueError(f"cu_seqlens requires B == 1, got B={batch}")
    num_seqs = cu_seqlens.shape[0] - 1
    dot_dtype = jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16
    num_positions = 0 if checkpoint_positions is None else checkpoint_positions.shape[1]
    cfg = fit_config(config, head_dim, value_dim, dot_dtype, num_positions > 0)
    block_v = cfg.block_v
    interpret = interpret_mode()
    fast_math = not interpret if cfg.fast_math is None else cfg.fast_math
    opts = _Options(group=num_value_heads // num_heads, scale=head_dim**-0.5 if scale is None else float(scale),
                    normalize_qk=use_qk_l2norm, has_gate=A_log is not None, lower_bound=lower_bound,
                    dot_dtype=dot_dtype, fast_math=fast_math, adaptive_diagonal=cfg.adaptive_diagonal)
    flat = lambda x: x.reshape((num_tokens,) + x.shape[2:])
    q, k, v, g, beta = map(flat, (q, k, v, g, beta))
    if A_log is None:
        A_log, dt_bias = jnp.zeros((num_value_heads,), jnp.float32), jnp.zeros((num_value_heads, head_dim))
    a_log = A_log.astype(jnp.float32)
    dt_bias = dt_bias.astype(jnp.float32).reshape(num_value_heads, head_dim)
    max_chunks, chunk_meta, seq_meta = _chunk_plan(cu_seqlens.astype(jnp.int32), num_seqs, num_tokens)
    diagonal_warps = cfg.diagonal_warps_midpoint if opts.midpoint_diagonal else cfg.diagonal_warps_dyadic
    diagonal_inputs = (*chunk_meta, q, k, g, beta, a_log, dt_bias)  # the diagonal blocks, many small programs per SM
    diag = jax.ShapeDtypeStruct((num_value_heads, max_chunks, NUM_SUB, SUB, SUB), dot_dtype)
    glocal = jax.ShapeDtypeStruct((num_tokens, num_value_heads, head_dim), jnp.float32)
    diag_block = pl.BlockSpec((None, None, None, SUB, SUB), lambda c, i, h: (h, c, i, 0, 0))
    diagonal = pl.pallas_call(
        functools.partial(_diagonal_kernel, opts=opts), out_shape=(diag, diag, glocal),
        grid=(max_chunks, NUM_SUB, num_value_heads), in_specs=[_full(x.shape) for x in diagonal_inputs],
        out_specs=(diag_block, diag_block, _full(glocal.shape)),
        compiler_params=pltriton.CompilerParams(num_warps=diagonal_warps, num_stages=1),
        interpret=interpret, name="kda_chunk_diagonal",
    )(*diagonal_inputs)

    inter = lambda width, dt: jax.ShapeDtypeStruct((num_value_heads, max_chunks, CHUNK, width), dt)
    block = lambda width: pl.BlockSpec((None, None, CHUNK, width), lambda c, h: (h, c, 0, 0))
    t_blocks, qk_blocks, g_local = diagonal
    whole_inputs = (*chunk_meta, q, k, v, g_local, beta)
    diagonal_spec = pl.BlockSpec((None, None, NUM_SUB, SUB, SUB), lambda c, h: (h, c, 0, 0, 0))  # this chunk's
    w, u, qg, kg, aqk, decay = pl.pallas_call(
        functools.partial(_intra_kernel, opts=opts),
        out_shape=(inter(head_dim, dot_dtype), inter(value_dim, dot_dtype), inter(head_dim, dot_dtype),
                   inter(head_dim, dot_dtype), inter(CHUNK, dot_dtype),
                   jax.ShapeDtypeStruct((num_value_heads, max_chunks, head_dim), jnp.float32)),
        grid=(max_chunks, num_value_heads),
        in_specs=[_full(x.shape) for x in whole_inputs] + [diagonal_spec] * 2,
        out_specs=(block(head_dim), block(value_dim), block(head_dim), block(head_dim), block(CHUNK),
                   pl.BlockSpec((None, None, head_dim), lambda c, h: (h, c, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.intra_warps, num_stages=cfg.intra_stages),
        interpret=interpret, name="kda_chunk_intra",
    )(*whole_inputs, t_blocks, qk_blocks)

    has_initial_state = initial_state is not None
    s0 = initial_state.astype(jnp.float32) if has_initial_state else jnp.zeros((1,), jnp.float32)
    positions = (jnp.zeros((1, 1), jnp.int32) if checkpoint_positions is None
                 else checkpoint_positions.astype(jnp.int32))
    order = jnp.argsort(-seq_meta[3], stable=True).astype(jnp.int32)  # sequences by decreasing length
    end = cu_seqlens[-1:].astype(jnp.int32)  # rows from here on belong to no sequence
    scan_inputs = (order, *seq_meta, positions, w, u, qg, kg, aqk, decay, s0, k, g, a_log, dt_bias, end)
    state_shape = (num_seqs, num_value_heads, head_dim, value_dim)
    out_shape = [jax.ShapeDtypeStruct((num_tokens, num_value_heads, value_dim), q.dtype),
                 jax.ShapeDtypeStruct(state_shape, jnp.float32)]
    if num_positions:
        out_shape.append(jax.ShapeDtypeStruct((num_seqs, num_positions) + state_shape[1:], jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_scan_kernel, opts=opts, block_v=block_v, num_positions=num_positions,
                          has_initial_state=has_initial_state),
        out_shape=tuple(out_shape),
        grid=(num_value_heads, value_dim // block_v, num_seqs),
        in_specs=[_full(x.shape) for x in scan_inputs],
        out_specs=tuple(_full(s.shape) for s in out_shape),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.scan_warps, num_stages=cfg.scan_stages),
        interpret=interpret, name="kda_chunk_scan",
    )(*scan_inputs)
    o = outs[0].reshape(batch, seq_len, num_value_heads, value_dim)
    return o, outs[1], outs[2] if num_positions else None
