"""KDA decode (one token per sequence) with the state update as a Mosaic-GPU (Hopper warpgroup) kernel.

Why: the Triton kernel (:mod:`pallas_kernels.kda.recurrent`) holds a whole ``[K, V]`` fp32 state in registers (255
per thread at 4 warps), so one program runs per SM and its warps stall on the state loads (Nsight Compute, H32 B64:
DRAM 60% busy). Here the state travels by TMA: each CTA (one warpgroup, one (sequence, value head)) bulk-copies
the ``[K, V]`` state of its slot into shared memory, updates it there in two ``[K/2, V]`` halves (64 registers of
state per thread), and bulk-copies it to its output slot. A TMA copy needs no registers, and a CTA takes ``K * V *
itemsize`` + 3 KB of shared memory (67 KB for fp32), so three CTAs share an SM and one's copies overlap the others'
arithmetic.

The update is the reference's (:func:`pallas_kernels.kda.reference.fused_recurrent_kda_reference`)::

    S1 = g * S                     (g = exp(gate) per key row)
    e  = v - k^T S1                (column sums over K)
    S' = S1 + beta k e^T
    o  = q^T S'

in an order that needs two column sums of the state as it was read, and none of the new one: ``k^T S1 = (k g)^T S``
and ``o = (q g)^T S + beta (q . k) e``. An fp32 pool forms each as one cross-warp reduction of the two halves'
products. A bf16 pool takes both from one ``wgmma``: a 64-row A tile whose rows 0-3 are the bf16 high and low parts
of ``k g`` and ``q g`` (zeros below) against the bf16 state as B, exact but for the fp32 accumulation (``wgmma`` would
read an fp32 state as tf32). The state is then read once more for the rank-one update.

Around it (:func:`fused_recurrent_kda_mgpu`), two forms. In one launch (H = HV), the same CTA reads its conv taps,
conv rows, inputs and gate operands from global memory into registers while the state's TMA copy is in flight,
writes the next conv rows, and ends with the gated RMSNorm (:func:`_one_launch_kernel`); staging those operands in
shared memory would leave room for two CTAs per SM, not three. In three launches (any GVA), a Triton kernel does the
conv-state shift (in place), causal conv + SiLU, L2 norms, gate and beta
(:func:`pallas_kernels.kda.recurrent.kda_update_inputs_pallas`), and XLA the gated RMSNorm. Contract: one token per
sequence, ``K = V = 128``; ``out_slots[n] < 0`` skips the write. ``jax.export`` for CUDA runs Mosaic-GPU's lowering
on the CPU, so the GPU lowering is tested without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tuning
from pallas_kernels.impl import layer_stacks, on_gpu
from pallas_kernels.kda.recurrent import L2_EPS, kda_update_inputs_pallas
from pallas_kernels.kda.reference import SOFTPLUS_THRESHOLD, gated_rms_norm
from pallas_kernels.mgpu import fresh_int32_buffer, wgmma_operand_transforms

DIM = 128  # K = V: the kernel's head size
HALF = DIM // 2
ROWS = 64  # wgmma's M: the A tile of the bf16 column sums


def _column_sum(s_smem, vec_smem, vec: int, wait_half=None):
    """``(x g)^T S`` for x = q (``vec`` 0) or k (1), fp32 ``[V]``: the two ``[K/2, V]`` halves' products added
    before one cross-warp reduction (64 registers of state per thread at a time); ``wait_half(h)`` before half h
    is read, if given."""
    total = None
    for h in range(2):
        if wait_half:
            wait_half(h)
        rows = pl.ds(h * HALF, HALF)
        s = s_smem[rows, :].astype(jnp.float32)
        term = s * jax.lax.broadcast_in_dim(vec_smem[vec, rows] * vec_smem[2, rows], s.shape, [0])
        total = term if total is None else total + term
    return total.sum(axis=0)


def _rank_one_update(s_smem, vec_smem, beta, error, store_half=None) -> None:
    """``S' = g S + beta k e^T`` in place, half of the key rows at a time; ``store_half(h)`` once half h is
    written and visible to TMA, if given."""
    for h in range(2):
        rows = pl.ds(h * HALF, HALF)
        s = s_smem[rows, :].astype(jnp.float32)
        s_new = (s * jax.lax.broadcast_in_dim(vec_smem[2, rows], s.shape, [0])
                 + jax.lax.broadcast_in_dim(vec_smem[1, rows] * beta, s.shape, [0])
                 * jax.lax.broadcast_in_dim(error, s.shape, [1]))
        s_smem[rows, :] = s_new.astype(s_smem.dtype)
        if store_half:
            plgpu.commit_smem()
            store_half(h)
    if not store_half:
        plgpu.commit_smem()


def _update_in_smem(s_smem, vec_smem, beta, beta_qk, wait_half=None, store_half=None) -> None:
    """The delta-rule step of one (sequence, value head) in shared memory: ``s_smem [K, V]`` (state dtype) holds S
    and receives S'; ``vec_smem [5, K]`` fp32 holds q, k, g, v and receives o in row 4; ``beta_qk = beta (q . k)``.
    Two cross-warp column sums, ``(k g)^T S`` and ``(q g)^T S`` (module docstring), then the rank-one update.
    ``wait_half`` / ``store_half``: per half of the key rows, its arrival waited for before the first sum reads
    it, and its store started once updated (see :func:`_one_launch_kernel`)."""
    error = vec_smem[3, :] - _column_sum(s_smem, vec_smem, 1, wait_half)
    vec_smem[4, :] = _column_sum(s_smem, vec_smem, 0) + beta_qk * error
    _rank_one_update(s_smem, vec_smem, beta, error, store_half)


def _hi_lo(x):
    """The bf16 high part of fp32 ``x`` and the bf16 rounding of what it leaves (together ~16 bits of mantissa)."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _update_bf16_in_smem(s_smem, vec_smem, a_smem, sums_smem, beta, beta_qk, wait_half=None,
                         store_half=None) -> None:
    """:func:`_update_in_smem` for a bf16 ``s_smem``, its two column sums by one ``wgmma`` (module docstring):
    ``a_smem [64, K]`` bf16 takes the A tile, ``sums_smem [64, V]`` fp32 the product; ``beta_qk = beta (q . k)``.
    The ``wgmma`` reads all of K, so both halves are waited for before it."""
    q, k, g = (vec_smem[i, :] for i in range(3))
    row = jax.lax.broadcasted_iota(jnp.int32, (ROWS, DIM), 0)  # A: row r = part r, the other 60 rows zero
    a = jnp.zeros((ROWS, DIM), jnp.bfloat16)
    for r, part in enumerate(_hi_lo(k * g) + _hi_lo(q * g)):
        a = jnp.where(row == r, jax.lax.broadcast_in_dim(part, (ROWS, DIM), [1]), a)
    a_smem[...] = a
    plgpu.commit_smem()
    for h in range(2 if wait_half else 0):
        wait_half(h)

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, s_smem)
        return acc_ref[...]

    sums = pl.run_scoped(product, plgpu.ACC((ROWS, DIM), jnp.float32))
    plgpu.commit_smem()  # every warp's wgmma has read the A tile that the product overwrites
    sums_smem[...] = sums
    plgpu.commit_smem()
    error = vec_smem[3, :] - (sums_smem[0, :] + sums_smem[1, :])
    vec_smem[4, :] = sums_smem[2, :] + sums_smem[3, :] + beta_qk * error
    _rank_one_update(s_smem, vec_smem, beta, error, store_half)


def _update(s_smem, vec_smem, wgmma_smem, beta, beta_qk, wait_half=None, store_half=None) -> None:
    """The step of one pair in shared memory: by ``wgmma`` column sums when ``wgmma_smem`` (a bf16 pool's A tile
    and product, one buffer: the product is written once the ``wgmma`` has read the tile) is given, else by
    reductions; ``beta_qk = beta (q . k)``; ``wait_half`` / ``store_half`` as in :func:`_update_in_smem`."""
    if wgmma_smem:
        a_smem, sums_smem = wgmma_smem[0]
        _update_bf16_in_smem(s_smem, vec_smem, a_smem, sums_smem, beta, beta_qk, wait_half, store_half)
    else:
        _update_in_smem(s_smem, vec_smem, beta, beta_qk, wait_half, store_half)


def _load_pair(refs, pair, s_smem, vec_smem, state_barrier, vec_barrier, num_value_heads):
    """Start the TMA copies of ``pair``'s state (from its slot) and vectors; -> (seq, head)."""
    slots_ref, out_slots_ref, scalars_ref, vecs_ref, state_ref = refs
    seq, head = pair // num_value_heads, pair % num_value_heads
    plgpu.copy_gmem_to_smem(state_ref.at[slots_ref[seq], head], s_smem, state_barrier)
    plgpu.copy_gmem_to_smem(vecs_ref.at[seq, head], vec_smem.at[pl.ds(0, 4)], vec_barrier)
    return seq, head


def _store_pair(refs, o_ref, seq, head, s_smem, vec_smem) -> None:
    """Start the TMA copies of the new state to its output slot (none when negative) and of o."""
    _, out_slots_ref, _, _, state_ref = refs
    out_slot = out_slots_ref[seq]

    @pl.when(out_slot >= 0)
    def _():
        plgpu.copy_smem_to_gmem(s_smem, state_ref.at[out_slot, head])

    plgpu.copy_smem_to_gmem(vec_smem.at[4], o_ref.at[seq, head])


def _one_pair_kernel(slots_ref, out_slots_ref, scalars_ref, vecs_ref, state_ref, o_ref, s_smem, vec_smem, bar,
                     *wgmma_smem, num_value_heads):
    """One CTA per (sequence, value head): load, update, store (three CTAs share an SM at fp32)."""
    refs = (slots_ref, out_slots_ref, scalars_ref, vecs_ref, state_ref)
    pair = jax.lax.axis_index("pair")
    seq, head = _load_pair(refs, pair, s_smem, vec_smem, bar.at[0], bar.at[1], num_value_heads)
    plgpu.barrier_wait(bar.at[1])
    plgpu.barrier_wait(bar.at[0])
    _update(s_smem, vec_smem, wgmma_smem, scalars_ref[seq, head, 0], scalars_ref[seq, head, 1])
    _store_pair(refs, o_ref, seq, head, s_smem, vec_smem)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _pipelined_kernel(slots_ref, out_slots_ref, scalars_ref, vecs_ref, state_ref, o_ref, s_smem, vec_smem, bar,
                      *wgmma_smem, num_value_heads, per_cta):
    """A run of ``per_cta`` consecutive (sequence, value head) pairs per CTA over two shared-memory stages: pair
    i + 1 loads while pair i updates and pair i - 1 stores."""
    refs = (slots_ref, out_slots_ref, scalars_ref, vecs_ref, state_ref)
    first = jax.lax.axis_index("cta") * per_cta
    count = jnp.clip(slots_ref.shape[0] * num_value_heads - first, 0, per_cta)

    def load(i, stage):
        _load_pair(refs, first + i, s_smem.at[stage], vec_smem.at[stage], bar.at[stage], bar.at[2 + stage],
                   num_value_heads)

    @pl.when(count > 0)
    def _():
        load(0, 0)

    @pl.loop(0, count)
    def _(i):
        stage = jax.lax.rem(i, 2)

        @pl.when(i + 1 < count)
        def _():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # pair i - 1's store has read the other stage
            load(i + 1, 1 - stage)

        pair = first + i
        seq, head = pair // num_value_heads, pair % num_value_heads
        plgpu.barrier_wait(bar.at[2 + stage])
        plgpu.barrier_wait(bar.at[stage])
        _update(s_smem.at[stage], vec_smem.at[stage], wgmma_smem, scalars_ref[seq, head, 0],
                scalars_ref[seq, head, 1])
        _store_pair(refs, o_ref, seq, head, s_smem.at[stage], vec_smem.at[stage])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _decay(z, a, lower_bound):
    """``exp(gate)`` from the gate logits ``z`` (``g_raw + dt_bias``) and ``a = exp(A_log)``
    (:func:`pallas_kernels.kda.reference.gate_from_logits`; softplus as ``log(1 + exp)``: no ``log1p`` here)."""
    if lower_bound is None:
        softplus = jnp.where(z > SOFTPLUS_THRESHOLD, z, jnp.log(1.0 + jnp.exp(jnp.minimum(z, SOFTPLUS_THRESHOLD))))
        return jnp.exp(-a * softplus)
    return jnp.exp(lower_bound * _sigmoid(a * z))


def _inputs(x_ref, w_ref, conv_ref, g_raw_ref, dt_bias_ref, seq, head, slot, out_slot, a, beta_logit, vec_smem, *,
            scale, lower_bound, layer):
    """Conv + SiLU, L2 norms, gate and beta of one (sequence, head), read from global memory into registers (while
    the state's TMA copy is in flight), and the next conv state written to ``out_slot`` (none when negative):
    writes q (scaled), k, exp(gate), v to ``vec_smem`` rows 0-3 -> (beta, beta (q . k))."""
    width = w_ref.shape[-1]
    rows, shifted = [], []
    for j in range(3):  # q, k, v
        window = [conv_ref[slot, t, j, head, :].astype(jnp.float32) for t in range(width - 1)]
        window.append(x_ref[seq, j, head, :].astype(jnp.float32))
        taps = [w_ref[layer, j, head, :, t].astype(jnp.float32) * window[t] for t in range(width)]
        conv = functools.reduce(jnp.add, taps)
        rows.append(conv * _sigmoid(conv))
        shifted.append(window[1:])  # the next conv state: the W - 2 newest cached inputs, then the new one

    @pl.when(out_slot >= 0)
    def _():
        for j, window in enumerate(shifted):
            for t, x in enumerate(window):
                conv_ref[out_slot, t, j, head, :] = x.astype(conv_ref.dtype)

    q, k, v = rows
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) * scale
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    z = g_raw_ref[seq, head, :].astype(jnp.float32) + dt_bias_ref[layer, head, :].astype(jnp.float32)
    for i, row in enumerate((q, k, _decay(z, a, lower_bound), v)):
        vec_smem[i, :] = row
    beta = _sigmoid(beta_logit)
    return beta, beta * jnp.sum(q * k)


def _one_launch_kernel(slots_ref, out_slots_ref, a_log_ref, beta_ref, x_ref, w_ref, g_raw_ref, dt_bias_ref,
                       gate_ref, norm_ref, conv_ref, state_ref, y_ref, s_smem, vec_smem, bar, *wgmma_smem, scale,
                       lower_bound, eps, layer):
    """The whole decode step of one (sequence, head) (H = HV) in one CTA: the state's TMA copies (two halves of the
    key rows) are in flight while the conv, norms and gate, and the output gate's scale, read their operands from
    global memory; the first column sum starts on half 0, each half's store as soon as it is updated; the gated
    RMSNorm of o follows. Only the state and the five vectors live in shared memory, so three CTAs share an SM at
    fp32 as in :func:`_one_pair_kernel`. Operands as :func:`_one_launch_step` lays them out."""
    pair = jax.lax.axis_index("pair")
    heads = x_ref.shape[2]
    seq, head = pair // heads, pair % heads
    slot, out_slot = slots_ref[seq], out_slots_ref[seq]
    for h in range(2):  # each half of the key rows on its own barrier: the first sum starts on half 0
        rows = pl.ds(h * HALF, HALF)
        plgpu.copy_gmem_to_smem(state_ref.at[slot, head, rows], s_smem.at[rows], bar.at[h])
    a = jnp.exp(a_log_ref[layer, head].astype(jnp.float32))
    beta, beta_qk = _inputs(x_ref, w_ref, conv_ref, g_raw_ref, dt_bias_ref, seq, head, slot, out_slot, a,
                            beta_ref[seq, head].astype(jnp.float32), vec_smem, scale=scale, lower_bound=lower_bound,
                            layer=layer)
    out_scale = norm_ref[layer, :].astype(jnp.float32) * _sigmoid(gate_ref[seq, head, :].astype(jnp.float32))
    plgpu.commit_smem()

    def store_half(h):  # half h's TMA store runs while the other half updates
        rows = pl.ds(h * HALF, HALF)

        @pl.when(out_slot >= 0)
        def _():
            plgpu.copy_smem_to_gmem(s_smem.at[rows], state_ref.at[out_slot, head, rows])

    _update(s_smem, vec_smem, wgmma_smem, beta, beta_qk, lambda h: plgpu.barrier_wait(bar.at[h]), store_half)
    o = vec_smem[4, :]
    y_ref[seq, head, :] = (o * jax.lax.rsqrt(jnp.sum(o * o) * (1.0 / DIM) + eps) * out_scale).astype(y_ref.dtype)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def smem_bytes(state_dtype, stages: int = 1, by_wgmma: bool = True) -> int:
    """Shared memory of one CTA: per stage the ``[K, V]`` state, five fp32 vectors (q, k, g, v, o) and two
    barriers; with a bf16 state whose column sums take a ``wgmma`` also its A tile (bf16) and product (fp32),
    ``[64, 128]`` each, in one buffer."""
    wgmma = ROWS * DIM * 4 if by_wgmma and jnp.dtype(state_dtype) == jnp.bfloat16 else 0
    return stages * (DIM * DIM * jnp.dtype(state_dtype).itemsize + 5 * DIM * 4 + 2 * 8) + wgmma


def kda_state_update_mgpu(state: jax.Array, slots: jax.Array, out_slots: jax.Array, q: jax.Array, k: jax.Array,
                          g: jax.Array, v: jax.Array, beta: jax.Array, *, ctas: int | None = None,
                          bf16_sums: str = "wgmma", interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """One delta-rule step per (sequence, value head) over a slot pool, in place.

    state ``[S, HV, K, V]`` (fp32 or bf16), slots / out_slots int32 ``[N]`` (the write is skipped where
    ``out_slots < 0``), q (already scaled), k, g (the decay factor ``exp(gate)``) ``[N, HV, K]``, v ``[N, HV, V]``,
    beta ``[N, HV]`` -> (o ``[N, HV, V]`` fp32, state). ``ctas``: None, one CTA per (sequence, value head); else
    that many CTAs, each pipelining a run of pairs over two stages. ``bf16_sums``: how a bf16 pool forms its column
    sums, ``"wgmma"`` (one product; 68 KB of shared memory per CTA, three CTAs per SM) or ``"reduce"`` (the fp32
    pool's cross-warp reductions; 35 KB: room for six CTAs per SM, if registers allow). ``interpret``: the
    Mosaic-GPU interpreter (default: when no GPU is present)."""
    q, k, beta = (x.astype(jnp.float32) for x in (q, k, beta))
    vecs = jnp.stack([q, k, g, v], axis=2).astype(jnp.float32)
    scalars = jnp.stack([beta, beta * jnp.sum(q * k, axis=-1)], axis=-1)
    return _state_update(state, slots, out_slots, vecs, scalars, ctas=ctas, bf16_sums=bf16_sums, interpret=interpret)


def _kernel(body, out_type, grid, grid_name: str, state_dtype, bf16_sums: str, stages: int, interpret):
    """``plgpu.kernel`` of one of the update's forms: its shared memory per stage (the ``[K, V]`` state, five fp32
    vectors, two barriers) and with a bf16 pool's ``wgmma`` column sums the A tile and product in one buffer,
    checked against the device; ``interpret`` None: the Mosaic-GPU interpreter when no GPU is present."""
    if state_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"state dtype must be float32 or bfloat16, got {state_dtype}")
    if bf16_sums not in ("wgmma", "reduce"):
        raise ValueError(f"bf16_sums must be 'wgmma' or 'reduce', got {bf16_sums!r}")
    by_wgmma = state_dtype == jnp.bfloat16 and bf16_sums == "wgmma"
    tuning.check_smem("kda_decode_mgpu", smem_bytes(state_dtype, stages, by_wgmma), f"{stages} stage(s)")
    lead = (stages,) if stages > 1 else ()
    a_tile = plgpu.SMEM((ROWS, DIM), jnp.bfloat16, transforms=wgmma_operand_transforms(DIM))
    interpret = not on_gpu() if interpret is None else interpret
    return plgpu.kernel(
        body, out_type=out_type, grid=grid, grid_names=(grid_name,),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=[plgpu.SMEM((*lead, DIM, DIM), state_dtype,
                                  transforms=wgmma_operand_transforms(DIM, 8 * jnp.dtype(state_dtype).itemsize)),
                       plgpu.SMEM((*lead, 5, DIM), jnp.float32), plgpu.Barrier(num_barriers=2 * stages),
                       *([plgpu.RefUnion(a_tile, plgpu.SMEM((ROWS, DIM), jnp.float32))] if by_wgmma else [])],
        interpret=plgpu.InterpretGPUParams() if interpret else None)


@functools.partial(jax.jit, static_argnames=("ctas", "bf16_sums", "interpret"))
def _state_update(state, slots, out_slots, vecs, scalars, *, ctas, bf16_sums, interpret):
    """:func:`kda_state_update_mgpu` from ``vecs [N, HV, 4, K]`` (q, k, g, v: one TMA copy per CTA) and
    ``scalars [N, HV, 2]`` (beta, beta (q . k))."""
    num_slots, num_value_heads, head_dim, value_dim = state.shape
    num_seqs = slots.shape[0]
    if head_dim != DIM or value_dim != DIM:
        raise ValueError(f"kda_state_update_mgpu needs K = V = {DIM}, got K={head_dim}, V={value_dim}")
    pairs = num_seqs * num_value_heads
    if ctas is None:
        body = functools.partial(_one_pair_kernel, num_value_heads=num_value_heads)
        grid, name, stages = (pairs,), "pair", 1
    else:
        per_cta = -(-pairs // ctas)
        body = functools.partial(_pipelined_kernel, num_value_heads=num_value_heads, per_cta=per_cta)
        grid, name, stages = (-(-pairs // per_cta),), "cta", 2
    pool = jax.new_ref(state)  # written in place: the kernel's state output aliases the pool
    o = _kernel(body, jax.ShapeDtypeStruct((num_seqs, num_value_heads, DIM), jnp.float32), grid, name, state.dtype,
                bf16_sums, stages, interpret,
                )(fresh_int32_buffer(slots), fresh_int32_buffer(out_slots, -1), scalars, vecs, pool)  # -1: no write
    return o, jax.freeze(pool)


@functools.partial(jax.jit, static_argnames=("scale", "lower_bound", "eps", "layer", "bf16_sums", "interpret"))
def _one_launch_step(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state, slots, dest,
                     gate_logits, o_norm_weight, *, scale, lower_bound, eps, layer, bf16_sums, interpret):
    """:func:`fused_recurrent_kda_mgpu` in one Mosaic-GPU launch (H = HV; ``dest [N]``; per-layer operands as
    :func:`pallas_kernels.impl.layer_stacks` gives them). The channels are viewed as ``[3, H, K]`` (q / k / v,
    head, lane), free reshapes; a CTA reads each conv tap of its head as a strided row of the ``[C, W]`` taps."""
    num_seqs, _, channels = mixed_qkv.shape
    num_slots, heads = state.shape[:2]
    width = conv_weight.shape[-1]
    x = mixed_qkv.reshape(num_seqs, 3, heads, DIM)
    taps = conv_weight.reshape(conv_weight.shape[0], 3, heads, DIM, width)
    per_head = lambda a, lead: a.reshape(lead, heads, DIM)
    operands = (fresh_int32_buffer(slots), fresh_int32_buffer(dest, -1), A_log, beta_logits.reshape(num_seqs, heads),
                x, taps, per_head(g_raw, num_seqs), per_head(dt_bias, dt_bias.shape[0]),
                per_head(gate_logits, num_seqs), o_norm_weight)
    conv_pool = jax.new_ref(conv_state.reshape(num_slots, width - 1, 3, heads, DIM))
    pool = jax.new_ref(state)
    body = functools.partial(_one_launch_kernel, scale=scale, lower_bound=lower_bound, eps=eps, layer=layer)
    y = _kernel(body, jax.ShapeDtypeStruct((num_seqs, heads, DIM), mixed_qkv.dtype), (num_seqs * heads,), "pair",
                state.dtype, bf16_sums, 1, interpret)(*operands, conv_pool, pool)
    return y.reshape(num_seqs, 1, channels // 3), jax.freeze(conv_pool).reshape(conv_state.shape), jax.freeze(pool)


def fused_recurrent_kda_mgpu(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state, slots,
                             out_slots, gate_logits, o_norm_weight, *, lower_bound=None, scale=None,
                             eps: float = 1e-5, layer: int | None = None, ctas: int | None = None,
                             bf16_sums: str = "wgmma", one_launch: bool = True, interpret: bool | None = None):
    """:func:`~pallas_kernels.kda.reference.fused_recurrent_kda_reference` for one token per sequence (same
    arguments and returns; ``out_slots [N, 1]``). With ``one_launch`` and ``ctas`` None, where each value head has
    its own q / k head (H = HV), one Mosaic-GPU kernel does it all (:func:`_one_launch_kernel`). Otherwise three
    launches: the conv-state shift, conv, norms and gate (:func:`pallas_kernels.kda.recurrent.kda_update_inputs_pallas`,
    a Triton kernel writing the conv rows in place; with GVA one program forms a q / k head's inputs for all its value
    heads), the state update here (``ctas`` as in :func:`kda_state_update_mgpu`), and the gated RMSNorm (XLA).
    ``bf16_sums`` as in :func:`kda_state_update_mgpu`; ``layer`` as in
    :func:`pallas_kernels.kda.recurrent.fused_recurrent_kda_pallas`."""
    if mixed_qkv.shape[1] != 1:
        raise ValueError(f"fused_recurrent_kda_mgpu takes one token per sequence, got {mixed_qkv.shape[1]}")
    num_seqs = mixed_qkv.shape[0]
    if state.shape[-2:] != (DIM, DIM):
        raise ValueError(f"fused_recurrent_kda_mgpu needs K = V = {DIM}, got {state.shape[-2:]}")
    dest = out_slots[:, 0]
    if one_launch and ctas is None and mixed_qkv.shape[2] == 3 * state.shape[1] * DIM:
        (A_log, dt_bias, o_norm_weight, conv_weight), row = layer_stacks(layer, A_log, dt_bias, o_norm_weight,
                                                                         conv_weight)
        return _one_launch_step(mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, state, slots,
                                dest, gate_logits, o_norm_weight, scale=DIM**-0.5 if scale is None else float(scale),
                                lower_bound=lower_bound, eps=float(eps), layer=row, bf16_sums=bf16_sums,
                                interpret=interpret)
    vecs, scalars, conv_state = kda_update_inputs_pallas(
        mixed_qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, slots, dest,
        lower_bound=lower_bound, scale=scale, layer=layer)
    o, state = _state_update(state, slots, dest, vecs, scalars, ctas=ctas, bf16_sums=bf16_sums, interpret=interpret)
    norm_weight = o_norm_weight if layer is None else o_norm_weight[layer]
    y = gated_rms_norm(o, gate_logits.reshape(o.shape), norm_weight, eps).reshape(num_seqs, 1, -1)
    return y.astype(mixed_qkv.dtype), conv_state, state
