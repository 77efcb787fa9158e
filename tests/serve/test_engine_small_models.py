"""Small fp32 models served end to end give greedy outputs equal to ``KimiLM.generate`` (reference ops, one
contiguous batch), with pools free afterwards:
* models with one cache kind (no MLA layer: no page bytes; no KDA layer: no slot bytes), which plan their
  pools without the missing one (a KDA-only model used to stop the memory planner with a ZeroDivisionError);
* a hybrid model with the engine on the Pallas kernels (interpret mode on CPU): KDA chunk and decode kernels,
  MLA attention, grouped GEMMs, the fused residual add + RMSNorm and the greedy-sampling kernel in the
  compiled steps. fp32 differences between the paths (~1e-6) are far below these prompts' top-2 logit gaps."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.api import KimiLM
from kimi_jax.config import ModelConfig
from kimi_jax.model import KimiModel
from serve.engine import EngineConfig, SamplingParams
from serve.engine.engine import LLMEngine
from serve.engine.runner import ModelRunner

BASE = dict(vocab_size=512, hidden_size=32, num_layers=2, mlp_types=("dense", "dense"), kda_num_heads=2,
            kda_num_v_heads=2, kda_head_dim=16, kda_v_head_dim=16, kda_gate_lower_bound=-5.0, mla_num_heads=2,
            q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            intermediate_size=64, bos_token_id=500, eos_token_id=501, max_position_embeddings=64)


@pytest.mark.parametrize("layer_types,impl", [(("kda", "kda"), "reference"), (("mla", "mla"), "reference"),
                                               (("kda", "mla"), "pallas")])
def test_small_model_serves_like_the_reference(layer_types, impl):
    lm = KimiLM(KimiModel(ModelConfig(**BASE, layer_types=layer_types), dtype=jnp.float32, rngs=nnx.Rngs(0)),
                impl="reference")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 500, n).tolist() for n in (5, 11)]
    want = [out[len(p):] for p, out in zip(prompts, lm.generate(prompts, max_new_tokens=6, stop_token_ids=[]))]
    runner = ModelRunner(lm, EngineConfig(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, block_size=4,
                                          token_buckets=(16,), seq_buckets=(2,), memory_budget_bytes=1 << 20,
                                          compile_threads=2), impl=impl)
    engine = LLMEngine(runner, config=EngineConfig(block_size=4))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    got = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    assert [got[str(i)] for i in range(len(prompts))] == want
    cache = engine.scheduler.cache
    cache.clear_prefix_cache()
    pages, slots = cache.pages.pool, cache.slots.pool
    assert pages.num_free == pages.num_usable and slots.num_free == slots.num_usable
