"""Tuned configs as data (pallas_kernels/tuned/*.json) and tilings chosen to fit the device's shared memory.

The fallback tests patch the shared-memory limit so that the tuned tiling does not fit, then check that the kernel
takes the smaller one and still matches its reference in interpret mode (tolerances as in each kernel's own tests:
fp32 1e-4, bf16 2e-2 of the largest magnitude)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
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

