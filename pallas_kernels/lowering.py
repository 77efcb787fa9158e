"""Our Pallas Triton kernels lowered for an H200 on any machine, GPU or not: the named kernel cases at the shapes the
engine uses, and the lowering that turns one into the Triton IR the GPU machine would compile.

``jax.export`` with ``platforms=["cuda"]`` runs the real Pallas -> Triton IR lowering; :func:`cuda_lowering` gives
it the GPU description XLA would give for an H200 and turns off interpret mode in the kernel modules. It uses JAX
internals (``jax._src.pallas.triton``), so it pins to the jax version in pyproject.toml. Used by
``tests/kernels/test_cuda_lowering.py`` (every case lowers) and :mod:`pallas_kernels.sass` (every case's SASS)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax import export

from pallas_kernels.attnres import kernel as attnres_kernel
from pallas_kernels.greedy import kernel as greedy_kernel
from pallas_kernels.kda import ChunkKDAConfig
from pallas_kernels.kda import chunk as kda_chunk
from pallas_kernels.kda import recurrent as kda_recurrent
from pallas_kernels.mla import absorb as mla_absorb
from pallas_kernels.mla import attention as mla_attention
from pallas_kernels.mla import prefill as mla_prefill
from pallas_kernels.mxfp4 import GroupedGemmConfig
from pallas_kernels.mxfp4 import kernel as gemm_kernel
from pallas_kernels.rmsnorm import PartialSum
from pallas_kernels.rmsnorm import kernel as rmsnorm_kernel
from pallas_kernels.router import kernel as router_kernel

S = jax.ShapeDtypeStruct
TRITON_CALL = "__gpu$xla.gpu.triton"
KERNEL_MODULES = (attnres_kernel, greedy_kernel, kda_chunk, kda_recurrent, gemm_kernel, mla_absorb, mla_attention,
                  mla_prefill, rmsnorm_kernel, router_kernel)
"""The modules whose ``interpret_mode`` :func:`cuda_lowering` turns off."""


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Triton launch of a lowered function: its name, Triton IR (MLIR text) and launch parameters."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int


@contextlib.contextmanager
def cuda_lowering():
    """Lower Pallas Triton kernels as for an H200 inside the block (on a CPU-only machine too); clears JAX's trace
    caches on entry and exit, so no trace made in interpret mode is reused, nor one made here afterwards."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    patches = [(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)]
    patches += [(module, "interpret_mode", lambda: False) for module in KERNEL_MODULES]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    jax.clear_caches()
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        jax.clear_caches()


def export_for_cuda(fn, args) -> export.Exported:
    """``jax.export`` of ``fn`` at ``args`` (shape-dtype structs) for CUDA; call inside :func:`cuda_lowering`."""
    return export.export(jax.jit(fn), platforms=["cuda"],
                         disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)


def triton_kernels(fn, args) -> list[TritonKernel]:
    """The Triton launches ``fn`` lowers to at ``args``, in launch order, each with its Triton IR as text."""
    from jax._src.pallas.triton import pallas_call_registration

    lowering = pallas_call_registration.lowering
    original = lowering.lower_jaxpr_to_triton_module
    modules = []

    def capture(*a, **k):
        result = original(*a, **k)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        with cuda_lowering():
            text = export_for_cuda(fn, args).mlir_module()
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    launches = re.findall(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
    if len(launches) != len(modules):
        raise RuntimeError(f"found {len(launches)} Triton launch configs for {len(modules)} lowered kernels")
    return [TritonKernel(name, ttir, int(warps), int(stages))
            for (name, stages, warps), ttir in zip(launches, modules)]


def kda_decode(mixed, conv_w, conv, g_raw, beta, a_log, dt_bias, state, slots, gate, o_norm):
    return kda_recurrent.fused_recurrent_kda_split_v_pallas(mixed, conv_w, conv, g_raw, beta, a_log, dt_bias, state,
                                                            slots, gate, o_norm, lower_bound=None, layer=1)


def kda_decode_fused(mixed, conv_w, conv, g_raw, beta, a_log, dt_bias, state, slots, gate, o_norm):
    return kda_recurrent.fused_recurrent_kda_pallas(mixed[:, None], conv_w, conv, g_raw[:, None], beta[:, None], a_log,
                                                    dt_bias, state, slots, slots[:, None], gate[:, None], o_norm,
                                                    lower_bound=-5.0, layer=2)


def kda_decode_update_inputs(mixed, conv_w, conv, g_raw, beta, a_log, dt_bias, state, slots, gate, o_norm):
    """The Triton half of the Mosaic-GPU decode: conv, norms and gate ahead of its state update."""
    return kda_recurrent.kda_update_inputs_pallas(mixed[:, None], conv_w, conv, g_raw[:, None], beta[:, None], a_log,
                                                  dt_bias, slots, slots, lower_bound=-5.0, layer=2)


DECODE_TILES = GroupedGemmConfig(block_m=16, block_n=64, block_k=128, weights_lhs=True, num_stages=4)
"""The decode tiling of tile_config for the bf16 and checkpoint / pair-halves orders (x as the register operand)."""


def grouped_gemm(x, w1, w3, row_experts):
    return gemm_kernel.grouped_gemm_concat_pallas(x, ((w1,), (w3,)), row_experts, 256, weight_format="bf16",
                                                  per_row=True, config=DECODE_TILES)


def grouped_gemm_shared(x, w1, w3, shared_gate, shared_up, row_experts):
    """Kimi-Linear's decode gate / up projections with the shared expert as the ninth row (layer 3)."""
    return gemm_kernel.grouped_gemm_concat_pallas(x, ((w1,), (w3,)), row_experts, 256, weight_format="bf16",
                                                  per_row=True, config=DECODE_TILES,
                                                  shared=((shared_gate,), (shared_up,)), shared_offset=3)


def add_rms_norm_partials(x, split_parts, expert_rows, router_weights, norm_weight):
    """A residual add + norm with split-K parts and router-weighted rows as its addend."""
    partials = PartialSum.of((split_parts, None), (expert_rows, router_weights))
    return rmsnorm_kernel.add_rms_norm_pallas(x, partials, norm_weight, eps=1e-6, layer=3)


def mxfp4_pairs_gemm(x, packed, scales, row_experts):
    """K3's expert gate projection at decode in the pair-halves byte order (16 (token, expert) rows)."""
    return gemm_kernel.grouped_gemm_concat_pallas(x, ((packed, scales),), row_experts, weight_format="mxfp4_pairs",
                                                  per_row=True, config=DECODE_TILES)


def mxfp4_pairs_prefill_gemm(x, packed, scales, group_sizes):
    """K3's expert gate projection at prefill (8192 rows over 56 experts) in the pair-halves byte order: the
    128 x 256 row tile that scales the decoded weights."""
    return gemm_kernel.grouped_gemm_pallas(x, (packed, scales), group_sizes, weight_format="mxfp4_pairs",
                                           config=GroupedGemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8,
                                                                    num_stages=3))


def mxfp4_words_gemm(num_warps, x, packed, scales, row_experts):
    """K3's expert gate + up at decode in the word order with narrow scales (16 (token, expert) rows): the tiling
    tile_config picks, with the folded decode; 2 warps from 2 rows per expert (64-256 tokens over 56 experts)."""
    return gemm_kernel.grouped_gemm_concat_pallas(x, ((packed, scales),), row_experts, weight_format="mxfp4_words",
                                                  per_row=True, narrow_scales=True,
                                                  config=GroupedGemmConfig(block_m=16, block_n=64, block_k=512,
                                                                           num_warps=num_warps, num_stages=2))


def mla_decode_fp8(q, pages, block_tables, context_lens, cu_q_lens, page_scales):
    """The Triton absorbed decode over e4m3 pages with per-token scales."""
    return mla_attention.mla_paged_attention_pallas(q, pages, block_tables, context_lens, cu_q_lens, scale=0.07,
                                                    kv_lora_rank=512, page_scales=page_scales)


def mxfp4_fp32_gemm(weight_format, x, packed, scales, group_sizes):
    """fp32 activations (an fp32 model, as in tests/test_model_incremental.py) against MXFP4 weights: the decoded
    bf16 tile must take x's dtype, since the Triton dot rejects mixed operand types."""
    return gemm_kernel.grouped_gemm_pallas(x, (packed, scales), group_sizes, weight_format=weight_format,
                                           config=GroupedGemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4,
                                                                    num_stages=2))


def kda_prefill(lower_bound, q, k, v, g, beta, a_log, dt_bias, cu_seqlens):
    """Kimi-Linear's varlen prefill (H=32, K=V=128): in-kernel gate and L2 norm; the softplus gate takes the
    dyadic diagonal blocks, the lower bound the midpoint ones; the GPU's PTX approximations of exp, the gate's
    log and its reciprocal (inline asm, which interpret mode cannot run)."""
    return kda_chunk.chunk_kda_pallas(q, k, v, g, beta, cu_seqlens=cu_seqlens, use_qk_l2norm=True, A_log=a_log,
                                      dt_bias=dt_bias, lower_bound=lower_bound,
                                      config=ChunkKDAConfig(fast_math=True))


KDA_PREFILL_ARGS = [*[S((1, 1024, 32, 128), jnp.bfloat16)] * 3, S((1, 1024, 32, 128), jnp.float32),
                    S((1, 1024, 32), jnp.bfloat16), S((32,), jnp.float32), S((32 * 128,), jnp.float32),
                    S((3,), jnp.int32)]
KDA_DECODE_ARGS = [S((2, 12288), jnp.bfloat16), S((3, 12288, 4), jnp.float32), S((9, 3, 12288), jnp.float32),
                   S((2, 4096), jnp.bfloat16), S((2, 32), jnp.bfloat16), S((3, 32), jnp.float32),
                   S((3, 4096), jnp.float32), S((9, 32, 128, 128), jnp.float32), S((2,), jnp.int32),
                   S((2, 4096), jnp.bfloat16), S((3, 128), jnp.float32)]  # Kimi-Linear: H=32, K=V=128, 3 layers
CASES = {
    "add_rms_norm": (add_rms_norm_partials,
                     [S((1, 2304), jnp.bfloat16), S((1, 4, 2304), jnp.float32), S((1, 8, 2304), jnp.bfloat16),
                      S((1, 8), jnp.float32), S((4, 2304), jnp.float32)]),
    "greedy": (greedy_kernel.greedy_pallas, [S((16, 163840), jnp.float32)]),
    "router_kimi_linear": (functools.partial(router_kernel.route_pallas, layer=2, k=8, renormalize=True,
                                             scaling=2.446),
                           [S((1, 2304), jnp.bfloat16), S((3, 2304, 256), jnp.float32), S((3, 256), jnp.float32)]),
    "router_k3": (functools.partial(router_kernel.route_pallas, layer=0, k=16, renormalize=True, scaling=1.0),
                  [S((64, 7168), jnp.bfloat16), S((1, 7168, 896), jnp.float32), S((1, 896), jnp.float32)]),
    "kda_decode": (kda_decode, KDA_DECODE_ARGS),
    "kda_prefill_softplus": (functools.partial(kda_prefill, None), KDA_PREFILL_ARGS),
    "kda_prefill_lower_bound": (functools.partial(kda_prefill, -5.0), KDA_PREFILL_ARGS),
    "kda_prefill_fp32": (functools.partial(kda_prefill, -5.0), [S(a.shape, jnp.float32) if a.dtype == jnp.bfloat16
                                                                else a for a in KDA_PREFILL_ARGS]),
    "kda_decode_fused": (kda_decode_fused, KDA_DECODE_ARGS),
    "kda_decode_update_inputs": (kda_decode_update_inputs, KDA_DECODE_ARGS),
    "grouped_gemm_per_row": (grouped_gemm, [S((1, 2304), jnp.bfloat16), S((768, 2304, 1024), jnp.bfloat16),
                                            S((768, 2304, 1024), jnp.bfloat16), S((8,), jnp.int32)]),
    "grouped_gemm_per_row_shared": (grouped_gemm_shared, [
        S((1, 2304), jnp.bfloat16), S((768, 2304, 1024), jnp.bfloat16), S((768, 2304, 1024), jnp.bfloat16),
        S((26, 2304, 1024), jnp.bfloat16), S((26, 2304, 1024), jnp.bfloat16), S((9,), jnp.int32)]),
    "grouped_gemm_mxfp4_pairs": (mxfp4_pairs_gemm, [S((2, 3584), jnp.bfloat16), S((56, 3072, 1792), jnp.uint8),
                                                    S((56, 3072, 112), jnp.uint8), S((16,), jnp.int32)]),
    "grouped_gemm_mxfp4_pairs_prefill": (mxfp4_pairs_prefill_gemm, [
        S((8192, 3584), jnp.bfloat16), S((56, 3072, 1792), jnp.uint8), S((56, 3072, 112), jnp.uint8),
        S((56,), jnp.int32)]),
    **{name: (functools.partial(mxfp4_words_gemm, warps), [
        S((2, 3584), jnp.bfloat16), S((56, 6144, 1792), jnp.uint8), S((56, 6144, 112), jnp.uint8),
        S((16,), jnp.int32)]) for name, warps in (("grouped_gemm_mxfp4_words", 4),
                                                   ("grouped_gemm_mxfp4_words_two_warps", 2))},
    **{f"grouped_gemm_{fmt}_fp32_activations": (functools.partial(mxfp4_fp32_gemm, fmt), [
        S((64, 256), jnp.float32), S((4, 128, 128), jnp.uint8), S((4, 128, 8), jnp.uint8), S((4,), jnp.int32)])
       for fmt in ("mxfp4", "mxfp4_pairs")},
    "attnres_mix": (attnres_kernel.attnres_mix_pallas, [S((7168,), jnp.float32), S((9, 16, 7168), jnp.float32),
                                                        S((7168,), jnp.float32)]),
    "mla_decode_triton": (functools.partial(mla_attention.mla_paged_attention_pallas, scale=0.07, kv_lora_rank=512),
                          [S((16, 32, 576), jnp.bfloat16), S((9000, 64, 576), jnp.bfloat16), S((16, 512), jnp.int32),
                           S((16,), jnp.int32), S((17,), jnp.int32)]),
    "mla_decode_triton_fp8": (mla_decode_fp8, [
        S((16, 12, 576), jnp.bfloat16), S((9000, 64, 576), jnp.float8_e4m3fn), S((16, 512), jnp.int32),
        S((16,), jnp.int32), S((17,), jnp.int32), S((9000, 64), jnp.float32)]),
    "mla_decode_triton_h12": (functools.partial(mla_attention.mla_paged_attention_pallas, scale=0.07,
                                                kv_lora_rank=512),
                              [S((16, 12, 576), jnp.bfloat16), S((9000, 64, 576), jnp.bfloat16),
                               S((16, 512), jnp.int32), S((16,), jnp.int32), S((17,), jnp.int32)]),
    "mla_prefill_unabsorbed": (functools.partial(mla_prefill.mla_prefill_attention_pallas, scale=0.07),
                               [S((8192, 96, 192), jnp.bfloat16), S((8192, 96, 128), jnp.bfloat16),
                                S((8192, 64), jnp.bfloat16), S((8192, 96, 128), jnp.bfloat16), S((2,), jnp.int32),
                                S((2,), jnp.int32)]),
    "mla_absorb_queries": (functools.partial(mla_absorb.absorb_queries_pallas, layer=3, k_nope=128),
                           [S((16, 32, 192), jnp.bfloat16), S((7, 512, 32 * 256), jnp.bfloat16)]),
    "mla_absorb_outputs": (functools.partial(mla_absorb.absorb_outputs_pallas, layer=6, v_dim=128),
                           [S((1, 32, 512), jnp.bfloat16), S((7, 512, 32 * 256), jnp.bfloat16)]),
}

LAUNCHES = {"kda_prefill_softplus": 3, "kda_prefill_lower_bound": 3, "kda_prefill_fp32": 3, "kda_decode": 2,
            "router_k3": 2, "router_kimi_linear": 2}
"""Triton launches per case where there is more than one: each prefill's diagonal blocks (dyadic or midpoint),
intra kernel and scan; split-V decode and its epilogue; the router's logits and its top-k."""
