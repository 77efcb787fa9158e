"""Speculative decoding with a draft model of the same family (small fp32 hybrid target): greedy outputs equal the
non-speculative reference token for token, over mixed arrivals, multi-turn prefix hits and preemption; the draft
model's pools follow the target's (a draft model with the target's weights has its drafts accepted, which fails
if its state after a step were anything but the accepted prefix's); pools end free, nothing compiles after
warm-up, and a draft model of another vocabulary or sampled drafting is refused at start-up."""

from __future__ import annotations

import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kimi_jax.model import KimiModel
from serve.engine import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.runner import ModelRunner
from serve.engine.spec_config import SpeculativeConfig
from tests.serve.test_engine_runner import (BLOCK, PROMPTS, RUNNER_CONFIG, SMALL, assert_pools_free, greedy, run,
                                            shared_lm)

K = 3
NEW = 12
SPEC = {"method": "draft_model", "model": "the target's twin", "num_speculative_tokens": K,
        "disable_by_batch_size": 0}


@functools.cache
def twin() -> KimiModel:
    """A separate model holding the target's weights: its greedy drafts are the target's own."""
    graphdef, state = nnx.split(shared_lm().model)
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


@functools.cache
def draft_runner() -> ModelRunner:
    # 2 MiB: the slots of two chained verification steps (2 x 8 x (1 + k), target and draft states) leave pages
    # enough for turn 1's prefix to stay cached through the multi-turn test
    return ModelRunner(shared_lm(), dataclasses.replace(RUNNER_CONFIG, token_buckets=(64,), speculative_config=SPEC,
                                                        memory_budget_bytes=2 << 20), drafter=twin())


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    names = sorted(PROMPTS)
    outs = shared_lm().generate([PROMPTS[n] for n in names], max_new_tokens=NEW, stop_token_ids=[])
    draft_runner()
    return {n: out[len(PROMPTS[n]):] for n, out in zip(names, outs)}


def engine(**scheduling) -> LLMEngine:
    return LLMEngine(draft_runner(), config=EngineConfig(block_size=BLOCK, speculative_config=SPEC, **scheduling))


def acceptance(e: LLMEngine) -> float:
    stats = e.stats().spec_decode
    return stats.num_accepted_tokens / max(stats.num_draft_tokens, 1)


def test_greedy_outputs_and_acceptance_over_mixed_arrivals_and_preemption(reference):
    """Requests arrive while others verify; a small page pool forces preemption; prompts sharing pages hit the
    prefix cache (interval checkpoints from verification steps included)."""
    e = engine(num_blocks_override=30, prefix_cache_retention_interval=4)
    names = sorted(PROMPTS)
    pending, done, arrivals = list(names), {}, random.Random(0)
    for _ in range(400):
        if pending and arrivals.random() < 0.5:
            n = pending.pop(0)
            e.add_request(n, PROMPTS[n], greedy(NEW - (n == "c") * 7))
        if not e.has_unfinished_requests() and not pending:
            break
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    want = dict(reference)
    want["c"] = reference["c"][:NEW - 7]
    assert done == {n: want[n] for n in names}
    assert e.stats().num_preemptions > 0 and e.stats().prefix_cache_hits > 0
    assert e.stats().spec_decode.num_drafts > 0 and acceptance(e) > 0.9
    assert_pools_free(e)


def test_multi_turn_resumes_the_draft_models_state_too(reference):
    """Turn 2 extends turn 1's prompt and output and resumes from turn 1's final checkpoint: the draft model's
    state comes back with the target's, so its drafts stay right."""
    e = engine()
    e.add_request("t1", PROMPTS["h"], greedy(NEW))
    e.add_request("k", PROMPTS["k"], greedy(NEW))
    first = run(e)
    assert first["k"].outputs[0].token_ids == reference["k"]
    turn2 = PROMPTS["h"] + first["t1"].outputs[0].token_ids + [7, 8, 9]
    want = shared_lm().generate([turn2], max_new_tokens=8, stop_token_ids=[])[0][len(turn2):]
    stats = e.stats().spec_decode
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    e.add_request("t2", turn2, greedy(8))
    done = run(e)
    assert done["t2"].outputs[0].token_ids == want and done["t2"].metrics.num_cached_tokens > len(PROMPTS["h"])
    drafted, accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
    assert drafted > 0 and accepted >= 0.9 * drafted  # turn 2's drafts come from the resumed draft state
    assert_pools_free(e)


def test_bad_draft_models_are_refused():
    with pytest.raises(ValueError, match="draft_sample_method"):
        SpeculativeConfig.from_json({**SPEC, "draft_sample_method": "probabilistic"})
    other = KimiModel(SMALL.replace(vocab_size=SMALL.vocab_size + 64), dtype=jnp.float32, rngs=nnx.Rngs(1))
    config = dataclasses.replace(RUNNER_CONFIG, speculative_config=SPEC)
    with pytest.raises(ValueError, match="vocabulary"):
        ModelRunner(shared_lm(), config, drafter=other, warm_up=False)
    with pytest.raises(ValueError, match="speculative_config.model"):
        ModelRunner(shared_lm(), config, warm_up=False)


SMALLER = SMALL.replace(num_layers=2, layer_types=("kda", "mla"), mlp_types=("dense", "dense"), kda_num_heads=1,
                        kda_num_v_heads=1)


def test_a_smaller_random_draft_model_gets_pools_of_its_own_shape(reference):
    draft = KimiModel(SMALLER, dtype=jnp.float32, rngs=nnx.Rngs(2))
    runner = ModelRunner(shared_lm(), dataclasses.replace(RUNNER_CONFIG, token_buckets=(64,), speculative_config=SPEC),
                         drafter=draft)
    pools = runner.cache.draft
    assert pools.kda_state.shape[0] == 1 and pools.mla.shape[0] == 1 and pools.draft is None
    assert pools.kda_state.shape[1:3] == (runner.num_slots, 1) and pools.mla.shape[1] == runner.num_blocks
    alone = ModelRunner(shared_lm(), RUNNER_CONFIG, warm_up=False)
    assert runner.plan.bytes_per_slot > alone.plan.bytes_per_slot
    assert runner.plan.bytes_per_block > alone.plan.bytes_per_block
    e = LLMEngine(runner, config=EngineConfig(block_size=BLOCK, speculative_config=SPEC))
    names = ("a", "b", "d", "h")  # "b" hits "a"'s pages
    for name in names:
        e.add_request(name, PROMPTS[name], greedy(NEW))
    done = run(e)
    assert {n: done[n].outputs[0].token_ids for n in names} == {n: reference[n] for n in names}
    assert e.stats().spec_decode.num_drafts > 0
    assert_pools_free(e)


def test_the_draft_model_is_loaded_in_the_targets_dtype():
    import kimi_jax
    from serve.engine.engine import _load_drafter

    target = kimi_jax.load("tiny", "float32")
    draft = _load_drafter(SpeculativeConfig.from_json({**SPEC, "model": "tiny"}), "tiny", target)
    assert isinstance(draft, KimiModel) and draft is not target.model
    assert draft.config == target.config and draft.dtype == target.model.dtype
