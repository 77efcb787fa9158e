"""The DSpark block drafter in the engine (small fp32 model, random drafter): every step caches the drafter's
context and drafts the next block on the device; greedy outputs equal the non-speculative reference whatever the
drafts, with sampled and greedy drafting, block verification, prefix hits and the confidence cut. The drafter's
checkpoint layout round-trips exactly, and a wrong tensor is named."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from kimi_jax.drafter import DSparkConfig, DSparkDrafter, block_hidden, block_step
from kimi_jax.weights.drafter_io import load_drafter, save_drafter
from serve.engine import EngineConfig, SamplingParams
from serve.engine.engine import LLMEngine
from serve.engine.runner import ModelRunner
from tests.serve.test_engine_runner import BLOCK, PROMPTS, RUNNER_CONFIG, SMALL, assert_pools_free, greedy, run, shared_lm

NEW = 12
SPEC = {"method": "dspark", "num_speculative_tokens": 3, "disable_by_batch_size": 0,
        "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}


@functools.cache
def drafter() -> DSparkDrafter:
    d = DSparkDrafter(DSparkConfig(target_layer_ids=(1, 3), num_layers=1, block_size=4, markov_rank=4), SMALL,
                      dtype=jnp.float32, rngs=nnx.Rngs(3))
    d.markov_b.set_value(jax.random.normal(jax.random.PRNGKey(1), d.markov_b.get_value().shape) * 0.1)
    d.confidence.set_value(jax.random.normal(jax.random.PRNGKey(2), d.confidence.get_value().shape))
    return d


GREEDY_DRAFTS = {**SPEC, "draft_sample_method": "greedy", "rejection_sample_method": "probabilistic",
                 "min_draft_confidence": 0.3}


@functools.cache
def dspark_runner(greedy_drafts: bool = False) -> ModelRunner:
    spec = GREEDY_DRAFTS if greedy_drafts else SPEC
    return ModelRunner(shared_lm(), dataclasses.replace(RUNNER_CONFIG, token_buckets=(64,), speculative_config=spec),
                       drafter=drafter())


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    names = sorted(PROMPTS)
    outs = shared_lm().generate([PROMPTS[n] for n in names], max_new_tokens=NEW, stop_token_ids=[])
    dspark_runner()
    return {n: out[len(PROMPTS[n]):] for n, out in zip(names, outs)}


def engine(greedy_drafts: bool = False) -> LLMEngine:
    return LLMEngine(dspark_runner(greedy_drafts), config=EngineConfig(
        block_size=BLOCK, speculative_config=GREEDY_DRAFTS if greedy_drafts else SPEC))


def test_drafter_checkpoint_round_trip(tmp_path):
    save_drafter(drafter(), str(tmp_path))
    back = load_drafter(str(tmp_path), shared_lm().model)
    want, got = nnx.state(drafter(), nnx.Param), nnx.state(back, nnx.Param)
    for (path, a), (_, b) in zip(nnx.to_flat_state(want), nnx.to_flat_state(got)):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))
    assert back.config == drafter().config
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        load_drafter(str(tmp_path), shared_lm().model)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DSparkDrafter(DSparkConfig(target_layer_ids=(9,)), SMALL, rngs=nnx.Rngs(0))


def test_the_default_drafter_is_the_one_beside_the_target(tmp_path, monkeypatch):
    """No ``model`` in the config: ``<folder>-dspark`` beside a checkpoint folder (a trailing slash or not), the
    shipped ``<preset>-dspark`` for a preset; none there is a ValueError naming the field."""
    import kimi_jax.api
    from serve.engine.engine import _load_drafter
    from serve.engine.spec_config import SpeculativeConfig

    save_drafter(drafter(), str(tmp_path / "small-dspark"))
    spec = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 2})
    lm = shared_lm()
    for target in (str(tmp_path / "small"), str(tmp_path / "small") + "/"):
        assert _load_drafter(spec, target, lm).config == drafter().config
    shipped = {"small-dspark": str(tmp_path / "small-dspark")}
    monkeypatch.setattr(kimi_jax.api, "shipped_checkpoint", shipped.get)
    assert _load_drafter(spec, "small", lm).config == drafter().config
    with pytest.raises(ValueError, match="speculative_config.model"):
        _load_drafter(spec, "other", lm)


def test_a_shorter_block_gives_the_first_rows_of_the_whole_block():
    """Fewer drafts verified than the drafter's block (k < block_size - 1) run a block of 1 + k rows: the draft
    layers are causal within the block, so its rows equal the first 1 + k rows of the whole block (fp32, over a
    random cached context of 16 and 21 tokens)."""
    d = drafter()
    width = SMALL.mla_cache_width
    pages = jax.random.normal(jax.random.PRNGKey(4), (d.config.num_layers, 15, BLOCK, width), jnp.float32)
    first, positions = jnp.array([7, 11], jnp.int32), jnp.array([16, 21], jnp.int32)
    tables = 1 + jnp.arange(14, dtype=jnp.int32).reshape(2, 7)  # 28 positions each: context + the block
    embed = shared_lm().model.embed[...]
    rows = {}
    for b in (2, d.config.block_size):
        hidden, _, _ = block_hidden(d, embed, pages, None, block_step(first, positions, tables, b), 0,
                                    impl="reference")
        rows[b] = np.asarray(hidden).reshape(2, b, -1)
    np.testing.assert_allclose(rows[2], rows[d.config.block_size][:, :2], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="block"):
        block_hidden(d, embed, pages, None, block_step(first, positions, tables, d.config.block_size + 1), 0)


@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_greedy_outputs_equal_the_reference(reference, greedy_drafts):
    """Sampled drafts with block verification; greedy drafts with token-level verification and the confidence
    cut (the random confidence head keeps fewer than k drafts in some rows)."""
    e = engine(greedy_drafts)
    names = ["a", "b", "d", "h", "k", "i"]  # "b" and "i" hit the prefix cache of "a"
    for name in names:
        e.add_request(name, PROMPTS[name], greedy(NEW))
    done = run(e)
    assert {n: done[n].outputs[0].token_ids for n in names} == {n: reference[n] for n in names}
    stats = e.stats().spec_decode
    assert stats.num_drafts > 0 and e.stats().prefix_cache_hits > 0
    if greedy_drafts:
        assert stats.num_draft_tokens < 3 * stats.num_drafts
    assert_pools_free(e)


def test_sampled_requests_run_and_reproduce(reference):
    params = SamplingParams(temperature=0.9, max_tokens=NEW, ignore_eos=True, seed=5)
    e = engine()
    e.add_request("x", PROMPTS["k"], params)
    first = run(e)["x"].outputs[0].token_ids
    e.add_request("y", PROMPTS["k"], params)
    assert run(e)["y"].outputs[0].token_ids == first and len(first) == NEW
    assert_pools_free(e)


@pytest.mark.slow  # compiles the shipped tiny's steps, verification steps and vision encoder (~1 minute)
def test_the_shipped_drafter_drafts_for_the_shipped_model():
    """``{"method": "dspark"}`` with no ``model`` serves ``tiny`` with the drafter shipped beside it, verifying 3 of
    its block's 7 drafts: greedy code continuations equal the target's own, and drafts are accepted (its
    held-out acceptance is 1.79 tokens per step, TRAINING.md; a random drafter of the same shape accepts almost
    none)."""
    import kimi_jax

    lm = kimi_jax.load("tiny", "float32")
    code = ["import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def __init__(self):\n"]
    llm = kimi_jax.LLM("tiny", dtype="float32", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64,
                       speculative_config={"method": "dspark", "num_speculative_tokens": 3,
                                           "disable_by_batch_size": 0})
    ids = [llm.get_tokenizer().encode(c) for c in code]
    want = [out[len(p):] for p, out in zip(ids, lm.generate(ids, max_new_tokens=40, stop_token_ids=[]))]
    got = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [list(r.outputs[0].token_ids) for r in got] == want
    spec = llm.engine.stats().spec_decode
    assert spec.num_drafts > 0 and spec.num_accepted_tokens >= spec.num_drafts // 4, spec


@functools.cache
def context_drafter() -> DSparkDrafter:
    """A random drafter whose attention over the cached context outweighs its block embeddings (o_proj x 20), so
    its drafts change with the context (``drafter()``'s mostly repeat one token)."""
    d = DSparkDrafter(DSparkConfig(target_layer_ids=(1, 3), num_layers=1, block_size=4, markov_rank=4), SMALL,
                      dtype=jnp.float32, rngs=nnx.Rngs(3))
    d.mla.o_proj.set_value(d.mla.o_proj.get_value() * 20.0)
    return d


def test_buckets_past_the_batch_bound_cache_context_but_do_not_draft(reference):
    """``disable_by_batch_size`` 3 becomes a sequence bucket: N=3 drafts and verifies, N=4 and N=8 (four or more
    running requests, never speculating) compile without drafting or verification but still cache the drafter's
    context. Four requests, two of which finish early: greedy outputs equal the reference, and once two are left
    the drafts at each position equal those of a runner that drafted in every step, which needs the context that
    the four-request steps cached (without that context 13 of 18 differ here). A request that drafted alone holds no
    drafts after a four-request step (such steps return no speculation outputs)."""
    spec = {**GREEDY_DRAFTS, "min_draft_confidence": 0.0, "disable_by_batch_size": 3}
    bounded = ModelRunner(shared_lm(), dataclasses.replace(
        RUNNER_CONFIG, token_buckets=(64,), seq_buckets=(4, 8), speculative_config=spec), drafter=context_drafter())
    assert bounded.config.seq_buckets == (3, 4, 8)
    assert {key[0] for key in bounded._verify_steps} == {3}
    everywhere = ModelRunner(shared_lm(), dataclasses.replace(
        RUNNER_CONFIG, token_buckets=(64,), speculative_config={**spec, "disable_by_batch_size": 0}),
        drafter=context_drafter())

    def drafts(runner: ModelRunner) -> tuple[dict, dict]:
        e = LLMEngine(runner, config=EngineConfig(block_size=BLOCK, speculative_config=spec))
        for name in ("a", "d", "h", "k"):
            e.add_request(name, PROMPTS[name], greedy(3 if name in "ad" else NEW))
        seen, done = {}, {}
        while e.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0].token_ids) for o in e.step() if o.finished)
            if len(e.scheduler.running) < 3:
                seen.update(((r.request_id, r.num_tokens), tuple(r.draft_token_ids))
                            for r in e.scheduler.running if r.draft_token_ids)
        assert e.stats().spec_decode.num_drafts > 0
        assert_pools_free(e)
        return seen, done

    (got, outputs), (want, _) = drafts(bounded), drafts(everywhere)
    assert outputs == {n: reference[n][:len(outputs[n])] for n in outputs} and len(outputs["h"]) == NEW
    common = sorted(set(got) & set(want))
    assert common and all(got[key] == want[key] for key in common)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        LLMEngine(bounded, config=EngineConfig(block_size=BLOCK, speculative_config={**spec,
                                                                                     "disable_by_batch_size": 5}))

    # A request that drafted alone keeps no drafts once a step past the bound (which returns none) has run it.
    e = LLMEngine(bounded, config=EngineConfig(block_size=BLOCK, speculative_config=spec))
    e.add_request("f", PROMPTS["f"], greedy(30))
    first = e.scheduler.requests["f"]
    while not first.draft_token_ids:
        e.step()
    for name in ("j", "g", "b"):
        e.add_request(name, PROMPTS[name], greedy(NEW))
    while not (len(e.scheduler.running) == 4 and all(r.num_output_tokens for r in e.scheduler.running)):
        e.step()
    e.step()
    assert not first.is_finished and all(not r.draft_token_ids for r in e.scheduler.running)
    while e.has_unfinished_requests():
        e.step()
    assert_pools_free(e)
