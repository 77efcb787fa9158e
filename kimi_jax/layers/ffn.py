"""Feed-forward sublayers: the dense GLU MLP (layer 0) and the (Latent) MoE with shared experts (spec section 4).

Router: fp32 logits -> sigmoid scores; ``scores + e_score_correction_bias`` only *selects* (group-limited
top-k); the weights are the unbiased scores of the chosen experts, renormalised and scaled. LatentMoE (K3)
runs the routed experts in a latent width: ``down -> experts -> weighted sum -> RMSNorm -> up``; shared experts
read the full-width input. Routed experts are bf16 ``[E, in, out]`` or MXFP4 packed ``[E, out, in/2]`` +
E8M0 scales ``[E, out, in/32]`` (checkpoint layout, dequantised per use; :func:`use_byte_order` re-orders the
packed bytes for the kernel's pair-halves or word format, as ``{w}_pairs`` / ``{w}_words`` parameters, and
:func:`use_mgpu_layout` for the Mosaic-GPU decode kernel, as ``{w}_mgpu`` / ``{w}_mgpu_scale``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.config import ModelConfig
from kimi_jax.layers.common import (
    F32,
    constant,
    draw_in_chunks,
    fan_in_normal,
    glu,
    rms_norm,
    split_columns,
    stacked_linear,
    stacked_linear_unsummed,
    stacked_linears,
)
from pallas_kernels import mxfp4 as gemm_ops
from pallas_kernels import router as router_ops
from pallas_kernels.impl import resolve_impl
from pallas_kernels.mxfp4 import kernel as gemm_kernel
from pallas_kernels.mxfp4 import quant as mxfp4
from pallas_kernels.mxfp4.decode_mgpu import prepare_weights as prepare_mxfp4_mgpu
from pallas_kernels.mxfp4.decode_mgpu import restore_weights as restore_mxfp4_mgpu
from pallas_kernels.rmsnorm import PartialSum, total

E2M1_RMS = 2.93  # RMS of a uniformly random E2M1 code's value, for random MXFP4 init
ROW_EXPERT_MAX_PAIRS = 32
"""(token, expert) pairs up to which the Pallas MoE gives each pair its own GEMM row tile instead of sorting
pairs by expert. Sorting costs about a dozen small kernels per layer (~20 us on the H200 at batch 1); unsorted,
an expert chosen by several pairs is streamed once per pair, which at 256 experts costs more than that beyond
~32 pairs (expected repeats grow with pairs / experts)."""
FUSE_SHARED_EXPERT = False
"""On the per-row (decode) path with bf16 experts and no latent projection (Kimi-Linear), run the shared expert
as one more row of each token in the routed expert launches (two launches and about two XLA fusions fewer per
MoE layer). Off until measured on the H200 (``bench_decode --fuse-shared-expert``)."""


class DenseMLPStack(nnx.Module):
    """GLU MLPs of the dense layers: gate, up [L, D, F]; down [L, F, D]."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        n, d, f = len(cfg.dense_layers), cfg.hidden_size, cfg.intermediate_size
        self.gate = fan_in_normal(rngs, (n, d, f), dtype)
        self.up = fan_in_normal(rngs, (n, d, f), dtype)
        self.down = fan_in_normal(rngs, (n, f, d), dtype)


def _glu_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, j: int, cfg: ModelConfig,
             impl: str | None) -> jax.Array | PartialSum:
    """Layer ``j`` of stacked GLU weights (gate, up ``[L, D, F]``, down ``[L, F, D]``): x [T, D] -> [T, D]
    (a :class:`PartialSum` of the down projection's split-K parts at decode under Pallas)."""
    g, u = stacked_linears(x, (gate, up), j, impl=impl)
    return stacked_linear_unsummed(glu(g, u, cfg), down, j, impl=impl)


def dense_mlp(p: DenseMLPStack, j: int, x: jax.Array, cfg: ModelConfig, *,
              impl: str | None = None) -> jax.Array | PartialSum:
    """Dense GLU MLP layer ``j``: x [T, D] -> [T, D] (or a :class:`PartialSum`, see :func:`_glu_mlp`)."""
    return _glu_mlp(x, p.gate, p.up, p.down, j, cfg, impl)


def _random_mxfp4(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> tuple[nnx.Param, nnx.Param]:
    """Random codes (all 16 values occur) with one E8M0 scale giving roughly N(0, std^2)-sized weights.

    shape is the unpacked ``[..., out, in]``; returns packed ``[..., out, in/2]`` and scales ``[..., out, in/32]``."""
    packed = draw_in_chunks(rngs.params(), (*shape[:-1], shape[-1] // 2),
                            lambda key, s: jax.random.bits(key, s, jnp.uint8))
    exponent = 127 + int(np.round(np.log2(std / E2M1_RMS)))
    scales = jnp.full((*shape[:-1], shape[-1] // 32), exponent, jnp.uint8)
    return nnx.Param(packed), nnx.Param(scales)


class MoEStack(nnx.Module):
    """Parameters of all MoE layers (leading axis = MoE layer index ``j``).

    router [L, D, E] f32; router_bias [L, E] f32; optional latent down [L, D, Rl], latent_norm [L, Rl],
    latent up [L, Rl, D]; routed experts w1 (gate), w3 (up): bf16 [L, E, Din, F] or MXFP4 packed
    [L, E, F, Din/2] + scales [L, E, F, Din/32]; w2 (down): [L, E, F, Din] or packed [L, E, Din, F/2] + scales;
    shared experts shared_gate, shared_up [L, D, Fs], shared_down [L, Fs, D] with Fs = num_shared * F.
    After ``use_byte_order("words")`` the static ``narrow_scales`` records whether every scale code is <= 128.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        n, d, e, f = len(cfg.moe_layers), cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        din = cfg.expert_input_dim
        self.router = nnx.Param(jax.random.normal(rngs.params(), (n, d, e), F32) * d ** -0.5)
        self.router_bias = nnx.Param(jax.random.normal(rngs.params(), (n, e), F32) * 0.01)
        if cfg.latent_dim is not None:
            self.latent_down = fan_in_normal(rngs, (n, d, din), dtype)
            self.latent_up = fan_in_normal(rngs, (n, din, d), dtype)
            if cfg.latent_norm:
                self.latent_norm = constant((n, din), 1.0)
        if cfg.experts_mxfp4:
            self.w1_packed, self.w1_scale = _random_mxfp4(rngs, (n, e, f, din), din ** -0.5)
            self.w3_packed, self.w3_scale = _random_mxfp4(rngs, (n, e, f, din), din ** -0.5)
            self.w2_packed, self.w2_scale = _random_mxfp4(rngs, (n, e, din, f), f ** -0.5)
        else:
            self.w1 = fan_in_normal(rngs, (n, e, din, f), dtype)
            self.w3 = fan_in_normal(rngs, (n, e, din, f), dtype)
            self.w2 = fan_in_normal(rngs, (n, e, f, din), dtype)
        if cfg.num_shared_experts:
            fs = cfg.num_shared_experts * f
            self.shared_gate = fan_in_normal(rngs, (n, d, fs), dtype)
            self.shared_up = fan_in_normal(rngs, (n, d, fs), dtype)
            self.shared_down = fan_in_normal(rngs, (n, fs, d), dtype)


def _relayout_experts(p: MoEStack, caller: str, convert) -> None:
    """Replace each checkpoint-order MXFP4 expert weight ``{w}_packed`` / ``{w}_scale`` by the parameters
    ``{w}_{suffix}`` of ``convert(packed, scale) -> {suffix: array}``."""
    for name in ("w1", "w3", "w2"):
        packed = getattr(p, f"{name}_packed", None)
        if packed is None:
            raise ValueError(f"{caller} needs MXFP4 experts in the checkpoint order; no {name}_packed")
        new = convert(packed[...], getattr(p, f"{name}_scale")[...])
        delattr(p, f"{name}_packed")
        delattr(p, f"{name}_scale")
        for suffix, value in new.items():
            setattr(p, f"{name}_{suffix}", nnx.Param(value))


REORDERS = {"pairs": (mxfp4.to_pair_halves, 2 * mxfp4.BLOCK), "words": (mxfp4.to_word_order, 4 * mxfp4.BLOCK)}
"""In-place byte orders of MXFP4 experts -> (converter from the checkpoint order, the input width it must
divide): the pair-halves order and the word order (:mod:`pallas_kernels.mxfp4.quant`)."""


def serving_byte_order(p: MoEStack | None, order: str, fast_kernels: bool, width_shards: int = 1) -> str:
    """The byte order to serve ``p``'s MXFP4 experts in for ``EngineConfig.mxfp4_byte_order`` ``order``: itself,
    or for "auto" the word order when ``fast_kernels`` (Pallas on a GPU) and every expert input width is a multiple
    of 128, else pair halves where they are of 64, else the checkpoint order.

    ``width_shards``: the tensor-parallel ranks each expert's FFN width F is split over (w2's input width): a
    re-ordered byte block must not straddle two ranks' shards, so each shard's width must fit the order. An
    explicit order that does not fit raises ValueError."""
    if order != "auto":
        packed = getattr(p, "w2_packed", None)  # None: bf16 experts, or already re-laid
        if order != "checkpoint" and width_shards > 1 and packed is not None and not byte_order_fits(p, order,
                                                                                                   width_shards):
            raise ValueError(f"mxfp4_byte_order {order!r} needs each tensor-parallel shard of the expert width to "
                             f"be a multiple of {REORDERS[order][1]}; F={2 * packed.shape[-1]} over "
                             f"{width_shards} ranks is not")
        return order
    return next((o for o in ("words", "pairs") if fast_kernels and byte_order_fits(p, o, width_shards)),
                "checkpoint")


def byte_order_fits(p: MoEStack | None, order: str, width_shards: int = 1) -> bool:
    """Whether ``p`` has MXFP4 routed experts in the checkpoint byte order (``{w}_packed`` parameters) whose
    input widths are multiples of what ``order`` (a key of ``REORDERS``) needs: 64 (pairs) or 128 (words); w2's
    input width (F) counted per shard of ``width_shards``."""
    if p is None:
        return False
    block = REORDERS[order][1]
    for name in ("w1", "w3", "w2"):
        w = getattr(p, f"{name}_packed", None)
        width = 2 * w.shape[-1] if w is not None else 0  # in/2 bytes
        shards = width_shards if name == "w2" else 1
        if w is None or width % shards or (width // shards) % block:
            return False
    return True


@functools.partial(jax.jit, static_argnames="order", donate_argnums=0)
def _reorder_layer(stack: jax.Array, layer: jax.Array, order: str) -> jax.Array:
    """``stack [L, ...]`` uint8 with layer ``layer`` (int32) re-ordered into byte order ``order``; in place when
    ``stack`` is donated, so the only temporary is one layer's codes."""
    one = jax.lax.dynamic_index_in_dim(stack, layer, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(stack, REORDERS[order][0](one), layer, 0)


def use_byte_order(p: MoEStack, order: str) -> None:
    """Re-order an MXFP4 stack's packed expert bytes into ``order`` ("pairs" or "words"), in place:
    ``w1_packed`` becomes ``w1_pairs`` / ``w1_words`` (same shape), and so on. One MoE layer at a time into the
    same (donated) buffer, so the device needs one layer's worth of memory to spare, not a stack's; an outside
    reference to the old array is invalidated. The checkpoint names are gone afterwards, so a converted model
    cannot be written out as if it held checkpoint bytes. "words" also records (one host sync) whether every
    scale code is at most 128 (``p.narrow_scales``, static), which lets the kernel fold its decode bias."""
    if order not in REORDERS:
        raise ValueError(f"order must be one of {sorted(REORDERS)}, got {order!r}")
    if not byte_order_fits(p, order):
        raise ValueError(f"use_byte_order({order!r}) needs MXFP4 experts in the checkpoint order (w1/w3/w2_packed) "
                         f"with input widths that are multiples of {REORDERS[order][1]}")
    if order == "words":
        scales = (getattr(p, f"{name}_scale")[...] for name in ("w1", "w3", "w2"))
        p.narrow_scales = gemm_kernel.scales_are_narrow(*scales)
    for name in ("w1", "w3", "w2"):
        stack = getattr(p, f"{name}_packed")[...]
        delattr(p, f"{name}_packed")
        for layer in range(stack.shape[0]):
            stack = _reorder_layer(stack, jnp.int32(layer), order)
        setattr(p, f"{name}_{order}", nnx.Param(stack))


def use_mgpu_layout(p: MoEStack) -> None:
    """Re-lay an MXFP4 stack's experts for the Mosaic-GPU decode kernel, in place: ``w1_packed`` / ``w1_scale``
    become ``w1_mgpu [L, E, K/64, N, 32]`` / ``w1_mgpu_scale [L, E, K/32, N]``
    (:func:`pallas_kernels.mxfp4.decode_mgpu.prepare_weights`), and so on."""
    _relayout_experts(p, "use_mgpu_layout", lambda packed, scale: dict(zip(("mgpu", "mgpu_scale"),
                                                                          prepare_mxfp4_mgpu(packed, scale))))


_BYTE_ORDERS = (("packed", "checkpoint", "scale"), ("pairs", "pairs", "scale"), ("words", "words", "scale"),
                ("mgpu", "mgpu", "mgpu_scale"))
"""Parameter suffix of packed expert bytes, their byte order, and the suffix of their scales."""


def _packed_experts(p: MoEStack, name: str) -> tuple[jax.Array, str, jax.Array] | None:
    """(packed bytes, byte order, scales) of routed expert weight ``name``, or None for bf16 experts."""
    for suffix, order, scale_suffix in _BYTE_ORDERS:
        packed = getattr(p, f"{name}_{suffix}", None)
        if packed is not None:
            return packed, order, getattr(p, f"{name}_{scale_suffix}")
    return None


def _expert_matmul(p: MoEStack, names: tuple[str, ...], j: int, xs: jax.Array, impl: str | None, *,
                   sizes: jax.Array | None = None, row_experts: jax.Array | None = None,
                   shared: tuple[str, ...] = ()) -> list[jax.Array]:
    """Grouped GEMMs of rows ``xs [M, in]`` with routed expert weights ``names`` (same input width) -> one
    ``[M, out]`` f32 product each. Rows are sorted by expert with ``sizes [E]`` rows per expert, or (Pallas
    only) unsorted with ``row_experts [M]`` naming each row's expert.

    Pallas: one launch of the W4A16 grouped kernel over the packed MXFP4 bytes of every name (or of the bf16
    grouped kernel); reference: dequantise every expert, then ``lax.ragged_dot`` per name (exact, but XLA
    lowers it densely on GPU). ``shared`` (bf16 experts, per-row Pallas path): the shared expert's weight
    names, one per name, for the rows naming ``SHARED_EXPERT``."""
    packed = [_packed_experts(p, n) for n in names]
    mxfp4_packed = packed[0] is not None
    if resolve_impl(impl) == "pallas":
        rows = dict(group_sizes=sizes, row_experts=row_experts, layer=j, impl="pallas")
        if mxfp4_packed:
            both = gemm_ops.mxfp4_grouped_matmul_concat(xs, [(w[...], scale[...]) for w, _, scale in packed],
                                                        byte_order=packed[0][1],
                                                        narrow_scales=getattr(p, "narrow_scales", False), **rows)
            widths = [scale.shape[-1 if order == "mgpu" else -2] for _, order, scale in packed]
        else:
            both = gemm_ops.grouped_matmul_concat(xs, [getattr(p, n) for n in names], **rows,
                                                  shared=[getattr(p, n)[...] for n in shared])
            widths = [getattr(p, n).shape[-1] for n in names]
        return split_columns(both.astype(F32), widths)
    out = []
    for n, stored in zip(names, packed):
        if mxfp4_packed:
            w, order, scale = stored
            w, scale = w[j], scale[j]
            if order == "mgpu":
                w, scale = restore_mxfp4_mgpu(w, scale)
            elif order in mxfp4.FROM_BYTE_ORDER:
                w = mxfp4.FROM_BYTE_ORDER[order](w)
            w = jnp.swapaxes(mxfp4.dequantize(w, scale, dtype=xs.dtype), -1, -2)
        else:
            w = getattr(p, n)[j]
        out.append(jax.lax.ragged_dot(xs, w, sizes, preferred_element_type=F32))
    return out


def row_path(t_rows: int, k: int, impl: str | None) -> bool:
    """Whether the decode path gives every (token, expert) pair its own row tile (see ROW_EXPERT_MAX_PAIRS)."""
    return t_rows * k <= ROW_EXPERT_MAX_PAIRS and resolve_impl(impl) == "pallas"


def _fuses_shared_expert(p: MoEStack, x: jax.Array, cfg: ModelConfig, impl: str | None) -> bool:
    """FUSE_SHARED_EXPERT applies: per-row path, bf16 experts, shared expert as wide as a routed one, and both
    reading the same input (no latent projection)."""
    return (FUSE_SHARED_EXPERT and cfg.num_shared_experts > 0 and cfg.latent_dim is None
            and _packed_experts(p, "w1") is None and p.shared_gate.shape[-1] == p.w1.shape[-1]
            and row_path(x.shape[0], cfg.num_experts_per_token, impl))


def routed_experts(p: MoEStack, j: int, z: jax.Array, weights: jax.Array, idx: jax.Array,
                   cfg: ModelConfig, *, impl: str | None = None, with_shared: bool = False) -> jax.Array:
    """Sort (token, choice) pairs by expert, run the grouped GLU experts, combine: z [T, Din] -> [T, Din].

    Pallas with at most ``ROW_EXPERT_MAX_PAIRS`` pairs (decode): the pairs stay in (token, choice) order and
    each row names its expert, so no sort, gather, group count or scatter runs around the expert GEMMs.
    ``with_shared`` (that path only, see :func:`_fuses_shared_expert`): each token gets one more row, the shared
    expert's, with weight 1, so the result includes the shared expert's output."""
    if with_shared:
        t_rows = idx.shape[0]
        idx = jnp.concatenate([idx, jnp.full((t_rows, 1), gemm_ops.SHARED_EXPERT, idx.dtype)], axis=1)
        weights = jnp.concatenate([weights, jnp.ones((t_rows, 1), weights.dtype)], axis=1)
    t_rows, k = idx.shape
    flat = idx.reshape(-1)
    dtype = z.dtype
    if with_shared or row_path(t_rows, k, impl):
        order, xs, rows = None, z, dict(row_experts=flat)  # the kernel reads token t's row for its k pairs
    else:
        order = jnp.argsort(flat, stable=True)
        xs, rows = z[order // k], dict(sizes=jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32))
    ys = expert_glu(p, j, xs, cfg, impl=impl, **rows, with_shared=with_shared)
    y = ys if order is None else jnp.zeros_like(ys).at[order].set(ys)  # back to (token, choice) order
    return jnp.einsum("tkd,tk->td", y.reshape(t_rows, k, -1), weights).astype(dtype)


def expert_glu(p: MoEStack, j: int, xs: jax.Array, cfg: ModelConfig, *, impl: str | None = None,
               sizes: jax.Array | None = None, row_experts: jax.Array | None = None,
               with_shared: bool = False) -> jax.Array:
    """The routed experts' GLU of rows ``xs [M, Din]``: ``w2(glu(w1 x, w3 x))`` per row's expert -> f32 [M, Din].

    Rows are sorted by expert with ``sizes [E]`` rows per expert (E = the experts ``p`` holds: all of them, or an
    expert-parallel rank's share), or (Pallas only) unsorted with ``row_experts [M]``; ``with_shared`` as in
    :func:`routed_experts`. A zero row gives a zero result (the GLU of 0 is 0), which is what padding rows of an
    expert-parallel dispatch buffer rely on."""
    rows = dict(sizes=sizes) if row_experts is None else dict(row_experts=row_experts)
    gate, up = _expert_matmul(p, ("w1", "w3"), j, xs, impl, **rows,
                              shared=("shared_gate", "shared_up") if with_shared else ())
    (ys,) = _expert_matmul(p, ("w2",), j, glu(gate.astype(xs.dtype), up.astype(xs.dtype), cfg), impl, **rows,
                           shared=("shared_down",) if with_shared else ())
    return ys


def glu_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, j: int, cfg: ModelConfig,
            impl: str | None = None) -> jax.Array | PartialSum:
    """Layer ``j`` of stacked GLU weights (see :func:`_glu_mlp`), for the shared experts of a sharded MoE."""
    return _glu_mlp(x, gate, up, down, j, cfg, impl)


def router_counts(idx: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """Per-expert routed (token, choice) pairs of the rows where ``valid [T]`` holds, per MoE layer: the layers'
    choices idx [L, T, k] -> int32 [L, E]. One scatter for all layers: a scatter per layer was a kernel of its own in
    every decode step (26 on Kimi-Linear-48B, 12 us each under the profiler at batch 1; BENCHMARKS.md, engine)."""
    layers = idx.shape[0]
    first = (num_experts * jnp.arange(layers, dtype=jnp.int32))[:, None, None]
    weights = jnp.broadcast_to(valid[None, :, None], idx.shape).astype(jnp.int32).reshape(-1)
    flat = (idx.astype(jnp.int32) + first).reshape(-1)
    return jnp.zeros(layers * num_experts, jnp.int32).at[flat].add(weights).reshape(layers, num_experts)


def moe(p: MoEStack, j: int, x: jax.Array, cfg: ModelConfig, *, impl: str | None = None,
        stats: list | None = None) -> jax.Array:
    """MoE layer ``j``: x [T, D] (normalised FFN input) -> [T, D].

    ``stats``: a list that gets this layer's expert choices appended (idx int32 [T, k]; the caller counts every
    layer's at once with :func:`router_counts`).

    The routed and shared outputs are summed here, by XLA in one kernel, even at decode: handing their 8 + 4
    rows to the add + RMSNorm kernel as a :class:`PartialSum` made that single-program kernel slower than XLA's
    sum plus the plain kernel (H200, one row: 4.9 against 1.5 + 2.5 us; BENCHMARKS.md, small kernels)."""
    weights, idx = router_ops.route(
        x, p.router[...], p.router_bias[...], k=cfg.num_experts_per_token, renormalize=cfg.moe_renormalize,
        scaling=cfg.routed_scaling_factor, num_expert_group=cfg.num_expert_group, topk_group=cfg.topk_group,
        layer=j, impl=impl)
    if stats is not None:
        stats.append(idx)
    z = stacked_linear(x, p.latent_down, j, impl=impl) if cfg.latent_dim is not None else x
    fused = _fuses_shared_expert(p, x, cfg, impl)
    y = routed_experts(p, j, z, weights, idx, cfg, impl=impl, with_shared=fused)
    if cfg.latent_dim is not None:
        if cfg.latent_norm:
            y = rms_norm(y, p.latent_norm[j], cfg.rms_norm_eps)
        y = stacked_linear(y, p.latent_up, j, impl=impl)
    if cfg.num_shared_experts and not fused:
        y = y + total(_glu_mlp(x, p.shared_gate, p.shared_up, p.shared_down, j, cfg, impl), y.dtype)
    return y
