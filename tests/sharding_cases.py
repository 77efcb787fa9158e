"""Tiny models and a subprocess runner shared by the multi-device tests.

Fake CPU devices must be configured before JAX starts, and the pytest process has already started JAX with one
device, so every multi-device test runs a script in a fresh interpreter (``run_script``) that prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kimi_jax.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]

# Kimi K3 at toy size: KDA (lower-bound gate, full-rank output gate), gated MLA with q-LoRA, Block AttnRes,
# LatentMoE with SiTU and MXFP4 experts, a dense layer 0. Four heads (TP4 / DCP4 split them one per rank), eight
# experts (EP4: two per rank), F = 128 so the MXFP4 scale columns (F / 32 = 4) split over four ranks.
K3_TINY = ModelConfig(
    vocab_size=4096, hidden_size=64, num_layers=2, layer_types=("kda", "mla"), mlp_types=("dense", "moe"),
    kda_num_heads=4, kda_num_v_heads=4, kda_head_dim=16, kda_v_head_dim=16, kda_gate_lower_bound=-5.0,
    kda_full_rank_gate=True, mla_num_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=16, mla_output_gate=True, hidden_act="situ", intermediate_size=128,
    num_experts=8, num_experts_per_token=2, moe_intermediate_size=128, num_shared_experts=1, latent_dim=64,
    latent_norm=True, experts_mxfp4=True, attn_res_block_size=1, bos_token_id=3840, eos_token_id=3842,
    pad_token_id=4095, max_position_embeddings=4096)

# Kimi-Linear at toy size: low-rank KDA output gate, MLA without q-LoRA or gate, SiLU, bf16-layout experts (fp32
# here) without a latent projection, plain pre-norm residuals.
KL_TINY = ModelConfig(
    vocab_size=4096, hidden_size=64, num_layers=2, layer_types=("kda", "mla"), mlp_types=("dense", "moe"),
    kda_num_heads=4, kda_num_v_heads=4, kda_head_dim=16, kda_v_head_dim=16, mla_num_heads=4, q_lora_rank=None,
    kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, hidden_act="silu",
    intermediate_size=128, num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1,
    routed_scaling_factor=2.0, bos_token_id=3840, eos_token_id=3842, pad_token_id=4095,
    max_position_embeddings=4096)

MODELS = {"k3": K3_TINY, "kimi_linear": KL_TINY}


def write_checkpoint(cfg: ModelConfig, folder: Path, *, seed: int = 0, with_tokenizer: bool = True) -> Path:
    """A random fp32 hub-layout checkpoint of ``cfg`` (plus the shipped tiny tokenizer, whose 4096 ids it fits)."""
    import jax.numpy as jnp
    from flax import nnx

    from kimi_jax.model import KimiModel
    from kimi_jax.weights.writer import save_checkpoint

    save_checkpoint(KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed)), str(folder))
    if with_tokenizer:
        for name in ("tiktoken.model", "tokenizer_config.json"):
            shutil.copy(ROOT / "kimi_jax" / "assets" / "tiny" / name, folder / name)
    return folder


def subprocess_env(devices: int) -> dict[str, str]:
    cache = os.environ.get("KIMI_JAX_TEST_JIT_CACHE", os.path.expanduser("~/.cache/kimi_jax/jit"))
    return {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5", "KIMI_JAX_COMPILE_CACHE": cache}


def run_script(script: str, *, devices: int = 8, timeout: int = 1200, args: tuple[str, ...] = ()) -> dict:
    """Run ``script`` with ``devices`` fake CPU devices; its last stdout line is JSON."""
    run = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=subprocess_env(devices),
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
