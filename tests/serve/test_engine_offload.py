"""The KV connector (``kv_connector.KVConnector`` over ``kv_store.HostKVStore``) on a K3-architecture model
(AttnRes, LatentMoE) and a Kimi-Linear-style one, greedy outputs identical to a recomputation in both uses:
* CPU offload: prefix entries evicted from the device spill to host memory and a later request resumes from them;
* prefill -> decode: a prefill engine exports a prompt's pages + KDA checkpoint (through the wire format of
  ``kv_transfer``) and a second engine, with its own pools, continues from them.
No compilation while serving; pools free at the end (the prefill side's as soon as the export is staged)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.api import KimiLM
from kimi_jax.config import ModelConfig
from kimi_jax.model import KimiModel
from serve.engine import EngineConfig, SamplingParams
from serve.engine.engine import LLMEngine
from serve.engine.kv_connector import KVConnector, attach_connector
from serve.engine.kv_store import HostKVStore
from serve.engine.kv_transfer import TransferTable, decode, encode, items_for_prompt
from serve.engine.runner import ModelRunner, backend_compile_count

COMMON = dict(vocab_size=512, hidden_size=32, num_layers=4, layer_types=("kda", "mla", "kda", "mla"),
              kda_num_heads=2, kda_num_v_heads=2, kda_head_dim=16, kda_v_head_dim=16, kda_gate_lower_bound=-5.0,
              mla_num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=8, intermediate_size=64, num_experts=8, num_experts_per_token=2, moe_intermediate_size=16,
              num_shared_experts=1, bos_token_id=500, eos_token_id=501, max_position_embeddings=64)
FAMILIES = {
    "k3": ModelConfig(**COMMON, mlp_types=("dense", "moe", "moe", "moe"), kda_full_rank_gate=True,
                      mla_output_gate=True, hidden_act="situ", latent_dim=16, latent_norm=True,
                      attn_res_block_size=2),
    "kimi_linear": ModelConfig(**COMMON, mlp_types=("dense", "moe", "moe", "moe")),
}
BLOCK = 4
MAX_NEW = 6


@functools.cache
def offload_engine(family: str, role: str = "offload") -> LLMEngine:
    lm = KimiLM(KimiModel(FAMILIES[family], dtype=jnp.float32, rngs=nnx.Rngs(0)), impl="reference")
    runner = ModelRunner(lm, EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                                          block_size=BLOCK, token_buckets=(32,), seq_buckets=(4,),
                                          num_checkpoint_slots=8, memory_budget_bytes=1 << 20, test_mode=True,
                                          compile_threads=2))
    engine = LLMEngine(runner, config=EngineConfig(block_size=BLOCK))
    if role == "prefill":
        engine.table = TransferTable(30.0)
        attach_connector(engine, KVConnector(HostKVStore(0), spill=False, on_export=engine.table.stage))
    else:
        attach_connector(engine, KVConnector(HostKVStore(64 << 20), spill=True))
    return engine


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    before = backend_compile_count()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    got = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    assert backend_compile_count() == before, "the engine compiled after warm-up"
    return [got[f"r{i}"] for i in range(len(prompts))]


def assert_pools_free(engine: LLMEngine) -> None:
    cache = engine.scheduler.cache
    cache.clear_prefix_cache()
    cache.connector.store.clear()
    pages, slots = cache.pages.pool, cache.slots.pool
    assert pages.num_free == pages.num_usable and slots.num_free == slots.num_usable


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_offload_hit_after_device_eviction_matches_recompute(family):
    engine = offload_engine(family)
    connector = engine.scheduler.cache.connector
    rng = np.random.default_rng(11)
    prompts = [rng.integers(2, 500, n).tolist() for n in (13, 18)]
    first = generate(engine, prompts)  # a miss: computed from scratch
    engine.scheduler.cache.clear_prefix_cache()  # every device entry spills to the host tier
    assert engine.scheduler.cache.checkpoint_count() == 0
    assert connector.store.stats().num_checkpoints > 0 and connector.store.stats().num_pages > 0
    hits = connector.stats.hit_tokens["cpu"]
    again = generate(engine, prompts)  # resumed from host pages + checkpoints
    assert connector.stats.hit_tokens["cpu"] > hits, "no prefix hit came from the host tier"
    assert again == first
    # a longer prompt sharing the first one's prefix resumes from a host checkpoint too
    engine.scheduler.cache.clear_prefix_cache()
    longer = [prompts[0] + first[0] + rng.integers(2, 500, 5).tolist()]
    hits = connector.stats.hit_tokens["cpu"]
    want = generate(engine, longer)
    assert_pools_free(engine)
    assert generate(engine, longer) == want  # recomputed (host tier cleared): same as the resumed run
    assert connector.stats.hit_tokens["cpu"] > hits
    assert_pools_free(engine)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_to_decode_transfer_matches_a_single_engine(family):
    prefill, decoder = offload_engine(family, "prefill"), offload_engine(family)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 500, n).tolist() for n in (9, 14)]
    for engine in (prefill, decoder):
        assert_pools_free(engine)
    want = generate(decoder, prompts)  # one engine, computed from scratch
    assert_pools_free(decoder)
    sender, receiver = prefill.scheduler.cache.connector, decoder.scheduler.cache.connector
    layout = receiver.copier.layout
    for i in range(len(prompts)):
        sender.expect_export(f"r{i}", f"t{i}")
    firsts = [out[0] for out in _generate_n(prefill, prompts, 1)]
    assert firsts == [w[0] for w in want]
    cache = prefill.scheduler.cache
    pages, slots = cache.pages.pool, cache.slots.pool
    assert pages.num_referenced == 0 and slots.num_referenced == 0, "the prefill side holds exported blocks"
    hits = receiver.stats.hit_tokens["remote"]
    for i, p in enumerate(prompts):
        items = decode(encode(prefill.table.take(f"t{i}"), layout), layout)
        mine = items_for_prompt(items, p, BLOCK)
        assert len(mine) == 1 and mine[0].checkpoint.position == len(p) - 1
        assert not items_for_prompt(items, prompts[1 - i], BLOCK), "a transfer populated another prompt"
        for item in mine:
            item.pages = [_placed(receiver, page) for page in item.pages]
            ckpt = item.checkpoint
            ckpt.state = receiver.copier.to_host("slot", ckpt.state)
            ckpt.tail_page = receiver.copier.to_host("page", ckpt.tail_page) if ckpt.tail else None
        receiver.insert(mine, owner=f"r{i}")
    got = generate(decoder, prompts)
    assert receiver.stats.hit_tokens["remote"] - hits == sum(len(p) - 1 for p in prompts)
    assert got == want
    for i in range(len(prompts)):
        receiver.store.release(f"r{i}")
    for engine in (prefill, decoder):
        assert_pools_free(engine)


def _placed(connector, page):
    page.data = connector.copier.to_host("page", page.data)
    return page


def _generate_n(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    got = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    return [got[f"r{i}"] for i in range(len(prompts))]


def test_connector_refuses_an_engine_without_prefix_caching():
    runner = offload_engine("kimi_linear").runner
    engine = LLMEngine(runner, config=EngineConfig(block_size=BLOCK, enable_prefix_caching=False))
    with pytest.raises(ValueError, match="enable prefix caching"):
        attach_connector(engine, KVConnector(HostKVStore(1 << 20), spill=True))
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostKVStore(-1)
