"""The MoE layer through the Pallas grouped GEMMs (interpret mode on CPU) equals its reference path.

Both paths decode the same MXFP4 bytes exactly; the kernel feeds bf16 operands to its dot with fp32
accumulation, so with bf16 activations the tolerance is bf16 rounding of the expert outputs (2e-2 relative)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.config import ModelConfig
from kimi_jax.layers.ffn import MoEStack, moe

BASE = dict(vocab_size=64, hidden_size=64, num_layers=2, layer_types=("kda", "kda"), mlp_types=("dense", "moe"),
            num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1,
            hidden_act="situ")


@pytest.mark.parametrize("variant", ["mxfp4_latent", "bf16"])
def test_moe_pallas_equals_reference(variant, rng):
    extra = dict(latent_dim=32, latent_norm=True, experts_mxfp4=True) if variant == "mxfp4_latent" else {}
    cfg = ModelConfig(**BASE, **extra)
    stack = MoEStack(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = jnp.asarray(rng.standard_normal((13, cfg.hidden_size)), jnp.bfloat16)  # 13 tokens: not a tile multiple
    want = np.asarray(moe(stack, 0, x, cfg, impl="reference"), np.float32)
    got = np.asarray(moe(stack, 0, x, cfg, impl="pallas"), np.float32)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
