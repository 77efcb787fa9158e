"""Tuned configs as data (pallas_kernels/tuned/*.json) and tilings chosen to fit the device's shared memory.

The fallback tests patch the shared-memory limit so that the tuned tiling does not fit, then check that the kernel
takes the smaller one and still matches its reference in interpret mode (tolerances as in each kernel's own tests:
fp32 1e-4, bf16 2e-2 of the largest magnitude)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda, tuning
from pallas_kernels.kda import ChunkKDAConfig, KDADecodeConfig
from pallas_kernels.kda import chunk as kda_chunk
from tests.kernels.helpers import assert_close

from .test_kda_pallas import prefill_inputs, recurrent_inputs, varlen_pallas_and_reference

H200_SMEM = 232448


def config_classes():
    with open(tuning.tuned_file(tuning.GENERIC)) as f:
        names = json.load(f)["configs"]
    from pallas_kernels import attnres, greedy, mla, mxfp4, rmsnorm, router

    modules = (kda, mla, mxfp4, router, rmsnorm, greedy, attnres)
    classes = {name: getattr(m, name) for m in modules for name in names if hasattr(m, name)}
    assert sorted(classes) == sorted(names), "every tuned entry names a config class exported by its op"
    return classes.values()


@pytest.mark.parametrize("kind", ["generic", "NVIDIA H200"])
def test_every_config_class_is_tuned_with_every_field(kind):
    """Both data files give every field of every config class, and the H200's values are the generic ones."""
    for cls in config_classes():
        got = tuning.tuned(cls, "cpu" if kind == "generic" else kind)
        assert dataclasses.asdict(got) == dataclasses.asdict(tuning.tuned(cls, "NVIDIA H200")), cls.__name__


def test_h100_departs_from_generic_in_the_kda_decode_routing_only():
    """The H100's file names only the Mosaic-GPU KDA decode thresholds timed there; the rest is generic."""
    h100 = "NVIDIA H100 80GB HBM3"
    for cls in config_classes():
        got, generic = tuning.tuned(cls, h100), tuning.tuned(cls, "cpu")
        if cls is KDADecodeConfig:
            assert (got.mgpu_min_rows, got.mgpu_min_rows_bf16) == (6144, 24576)
            got = dataclasses.replace(got, mgpu_min_rows=generic.mgpu_min_rows,
                                      mgpu_min_rows_bf16=generic.mgpu_min_rows_bf16)
        assert got == generic, cls.__name__


def test_resolve_keeps_set_fields_and_fills_the_rest():
    cfg = tuning.resolve(ChunkKDAConfig, ChunkKDAConfig(scan_stages=1))
    assert cfg.scan_stages == 1 and cfg.block_v == 32 and cfg.intra_warps == 4 and cfg.fast_math is None
    assert tuning.resolve(ChunkKDAConfig, None) == tuning.tuned(ChunkKDAConfig)
    with pytest.raises(ValueError, match="ChunkKDAConfig"):
        tuning.resolve(ChunkKDAConfig, KDADecodeConfig())


def test_overriding_swaps_the_default_inside_the_block_only():
    with tuning.overriding(KDADecodeConfig(split_v=0)):
        assert kda.decode_split_v(10_000, 32) is None
        assert tuning.tuned(KDADecodeConfig).fused_max_rows == 8192
    assert kda.decode_split_v(10_000, 32) == 64


def test_smem_limit_off_gpu_and_by_device_kind():
    assert tuning.smem_limit() == H200_SMEM  # no GPU here: the H200's
    assert tuning.smem_by_kind("NVIDIA H200") == H200_SMEM
    assert tuning.smem_by_kind("NVIDIA H100 80GB HBM3") == H200_SMEM
    assert tuning.smem_by_kind("NVIDIA L40S") == 101376
    assert tuning.smem_by_kind("Some Future GPU") == 49152


def test_smaller_takes_fewer_stages_then_smaller_blocks():
    cfg = ChunkKDAConfig(block_v=64, scan_stages=3)
    got = [(c.block_v, c.scan_stages) for c in tuning.smaller(cfg, "scan_stages", [("block_v", 16)])]
    assert got == [(64, 2), (64, 1), (32, 3), (32, 2), (32, 1), (16, 3), (16, 2), (16, 1)]


def test_chunk_scan_estimate_at_kimi_head_size():
    """K = V = 128: the tuned scan (3 stages, 32 columns) fits with bf16 inputs, with or without checkpoints; with
    fp32 inputs it is over the H200's 232448 B (the bench's fp32 check asked 278528 B) and one stage is taken."""
    tuned = tuning.tuned(ChunkKDAConfig)
    for checkpoints in (False, True):
        assert kda_chunk.fit_config(None, 128, 128, jnp.bfloat16, checkpoints) == tuned
        assert kda_chunk.scan_smem_bytes(tuned, 128, 128, jnp.float32, checkpoints) > 278528
        fp32 = kda_chunk.fit_config(None, 128, 128, jnp.float32, checkpoints)
        assert (fp32.scan_stages, fp32.block_v) == (1, 32)
        assert kda_chunk.scan_smem_bytes(fp32, 128, 128, jnp.float32, checkpoints) <= H200_SMEM
    with pytest.raises(ValueError, match="K=512, V=512 with float32"):
        kda_chunk.fit_config(None, 512, 512, jnp.float32, False)


@pytest.fixture
def smem(monkeypatch):
    """Set the device's shared-memory limit for the test (jit caches cleared around it)."""
    jax.clear_caches()

    def set_limit(limit):
        monkeypatch.setattr(tuning, "smem_limit", lambda: limit)
        jax.clear_caches()  # configs are fitted when traced

    yield set_limit
    jax.clear_caches()


@pytest.mark.slow  # ~15 s CPU per case: interpret-mode compile of the full kernels
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_chunk_falls_back_to_one_stage_and_still_matches(smem, dtype, tol):
    """A limit below the tuned 3-stage scan's estimate (K = V = 16, checkpoints): the scan takes one stage, and
    the varlen GVA batch with initial states and checkpoints still matches the reference."""
    tuned = tuning.tuned(ChunkKDAConfig)
    one_stage = dataclasses.replace(tuned, block_v=16, scan_stages=1)
    limit = kda_chunk.scan_smem_bytes(one_stage, 16, 16, dtype, True)
    smem(limit)
    assert kda_chunk.fit_config(None, 16, 16, dtype, True) == one_stage
    x = prefill_inputs(3, dtype)
    ours, ref = varlen_pallas_and_reference(x, -5.0)
    for name, a, b in zip(("o", "final_state", "checkpoints"), ours, ref):
        assert_close(a, b, tol, name)
    smem(limit - 1)
    with pytest.raises(ValueError, match="kda_chunk_scan"):
        varlen_pallas_and_reference(x, -5.0)


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_sliced_decode_falls_back_to_one_stage_and_still_matches(smem, state_dtype):
    """The fused decode walking 4-column state slices over 2 pipeline stages: with room for one only, one stage,
    same results as the reference (fp32 math; a bf16 pool may round one element one ulp apart: 2e-2)."""
    from pallas_kernels.kda import recurrent

    x = recurrent_inputs(9, 1, state_dtype)
    head_dim, width = x["state"].shape[2], x["conv_weight"].shape[1]
    need = recurrent.recurrent_smem_bytes(1, 4, 16, head_dim, width, 1, state_dtype)
    smem(need)
    x = {n: (a[:, 0] if n in ("mixed_qkv", "g_raw", "beta_logits", "gate_logits") else a) for n, a in x.items()}
    config = KDADecodeConfig(block_v=4)
    assert recurrent.recurrent_smem_bytes(2, 4, 16, head_dim, width, 1, state_dtype) > need
    ours = jax.jit(lambda x: kda.fused_recurrent_kda(**x, impl="pallas", config=config))(x)
    ref = kda.fused_recurrent_kda(**x, impl="reference")
    for name, a, b, tol in zip(("y", "conv_state", "state"), ours, ref, (1e-4, 1e-4, 2e-2)):
        assert_close(a, b, tol, name)



def test_mla_decode_tiling_at_kimi_shapes():
    """R = 512 + 64: the tuned tilings fit with bf16 caches (unchanged); 16-row short-decode tiles over 64 keys and
    3 stages do not with an fp8 cache (cast tiles) or fp32 queries and pages, and take 2 stages."""
    from pallas_kernels.mla import attention

    short = dict(num_tokens=16, num_seqs=16, num_heads=32, max_context=560, width=576)
    long = dict(num_tokens=16, num_seqs=16, num_heads=32, max_context=32768, width=576)
    for shape, stages in ((short, 3), (long, 2)):
        assert attention.fit_config(None, **shape, compute_dtype=jnp.bfloat16, pages_dtype=jnp.bfloat16,
                                    fp8_scales=False).num_stages == stages
    fp8 = attention.fit_config(None, **short, compute_dtype=jnp.bfloat16, pages_dtype=jnp.float8_e4m3fn,
                               fp8_scales=True)
    fp32 = attention.fit_config(None, **short, compute_dtype=jnp.float32, pages_dtype=jnp.float32, fp8_scales=False)
    assert (fp8.num_stages, fp8.block_k) == (2, 64) and (fp32.num_stages, fp32.block_k) == (2, 64)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, dict(rtol=2e-4, atol=2e-5)), (jnp.bfloat16, None)])
def test_mla_decode_falls_back_to_fewer_keys_and_still_matches(smem, dtype, tol):
    """A limit under the one-stage tiling of 32 keys per step: 16 keys are taken, and a varlen decode / verify /
    prefill mix (fp32: to the fp32 tolerance of the MLA tests; bf16 queries and pages: 2e-2) matches the
    reference."""
    from pallas_kernels.mla import MLADecodeConfig, mla_paged_attention_reference
    from pallas_kernels.mla import attention
    from pallas_kernels.mla.testing import make_paged_batch

    tol = tol or dict(rtol=2e-2, atol=2e-2)
    config = MLADecodeConfig(block_q=4, block_h=4, block_k=32, num_splits=2, num_stages=2)
    narrow = dataclasses.replace(tuning.resolve(MLADecodeConfig, config), block_k=16)
    smem(attention.smem_bytes(narrow, 48, dtype, dtype, False))
    assert attention.fit_config(config, 18, 3, 4, 192, 48, dtype, dtype, False) == narrow
    batch = make_paged_batch(np.random.default_rng(4), [70, 9, 130], [8, 3, 5], num_heads=4, width=48,
                             block_size=64, num_tokens=18)
    args = [jnp.asarray(a, dtype if a.dtype == np.float32 else None) for a in
            (batch.q, batch.pages, batch.block_tables, batch.context_lens, batch.cu_q_lens)]
    with jax.default_matmul_precision("highest"):
        o, lse = attention.mla_paged_attention_pallas(*args, scale=48**-0.5, kv_lora_rank=32, config=config)
        want_o, want_lse = mla_paged_attention_reference(*args, scale=48**-0.5, kv_lora_rank=32)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want_o, np.float32), **tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **tol)


def test_grouped_gemm_tiling_at_k3_shapes():
    """The tuned prefill tiles fit with bf16 activations (unchanged); with fp32 activations the 128 x 256 x 64
    bf16 tile (3 stages, its weights cast to fp32) does not, and takes 2 stages."""
    from pallas_kernels.mxfp4 import GroupedGemmConfig
    from pallas_kernels.mxfp4 import kernel as gemm_kernel
    from pallas_kernels.mxfp4.ops import tile_config

    for fmt in ("bf16", "mxfp4", "mxfp4_pairs", "mxfp4_words"):
        for rows in (1, 262, 1024, 8212):
            cfg = GroupedGemmConfig(**tile_config(rows, 56, 6144, 3584, fmt))
            w_dtype = jnp.bfloat16 if fmt == "bf16" else jnp.uint8
            assert gemm_kernel.fit_config(cfg, fmt, jnp.bfloat16, w_dtype) == tuning.resolve(GroupedGemmConfig, cfg)
    prefill = GroupedGemmConfig(**tile_config(8212, 56, 6144, 3584, "bf16"))
    assert gemm_kernel.fit_config(prefill, "bf16", jnp.float32, jnp.bfloat16).num_stages == 2


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_gemm_falls_back_to_a_narrower_k_step_and_still_matches(smem, x_dtype):
    """A limit under the one-stage 64-column K step: 32 columns are taken, and the MXFP4 grouped GEMM (all 16
    codes; empty group, ragged tiles) matches the fp32 reference within the bf16 output rounding (1e-2)."""
    from pallas_kernels.mxfp4 import GroupedGemmConfig, mxfp4_grouped_matmul_reference
    from pallas_kernels.mxfp4 import kernel as gemm_kernel

    from .test_mxfp4_kernels import assert_rows_close, random_problem

    config = GroupedGemmConfig(block_m=16, block_n=16, block_k=64, num_warps=4, num_stages=1)
    narrow = dataclasses.replace(tuning.resolve(GroupedGemmConfig, config), block_k=32)
    smem(gemm_kernel.smem_bytes(narrow, "mxfp4", x_dtype, jnp.uint8))
    assert gemm_kernel.fit_config(config, "mxfp4", x_dtype, jnp.uint8) == narrow
    x, packed, scales, gs = random_problem(21, [5, 0, 30], 37)
    x = x.astype(x_dtype)
    got = gemm_kernel.grouped_gemm_pallas(x, (packed, scales), gs, weight_format="mxfp4", config=config)
    assert got.dtype == x_dtype
    assert_rows_close(got, mxfp4_grouped_matmul_reference(x, packed, scales, gs))
