"""The engine on a real (small, random, fp32) hybrid model: the runner's jitted steps against a cache-free
reference, under every way the scheduler can slice the work.

One runner (KDA, MLA, KDA, MLA layers with MoE and Block AttnRes; 4-token pages; mixed buckets T in
(16, 64) with N = 8, and the N = 8 decode-only bucket) is compiled once per process in test mode (freed pages and slots are filled with NaN) and shared
by every engine here and in test_engine_llm.py / test_engine_async.py. Greedy outputs must equal
``KimiLM.generate`` (one prefill + decode over a contiguous cache, no prefix caching, no chunking) token for
token: fp32 differences between batch shapes are ~1e-6 relative, far below the top-2 logit gaps of these
prompts (the reference itself is computed in a different batch shape than every engine run). Every engine run
also asserts that nothing compiled after warm-up.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_jax.api import KimiLM
from kimi_jax.config import ModelConfig
from kimi_jax.model import KimiModel
from serve.bench.hit_rates import multi_turn_chat, shared_system_prompt
from serve.engine import EngineConfig, SamplingParams
from serve.engine.engine import LLMEngine
from serve.engine.outputs import SampledTokens
from serve.engine.runner import ModelRunner, backend_compile_count, describe_executable
from serve.engine.scheduler import ScheduledSequence
from serve.engine.step_batch import PackedLayout, pack, unpack

SMALL = ModelConfig(
    vocab_size=4096, hidden_size=32, num_layers=4, layer_types=("kda", "mla", "kda", "mla"),
    mlp_types=("dense", "moe", "moe", "moe"), kda_num_heads=2, kda_num_v_heads=2, kda_head_dim=16,
    kda_v_head_dim=16, kda_gate_lower_bound=-5.0, kda_full_rank_gate=True, mla_num_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mla_output_gate=True,
    hidden_act="situ", intermediate_size=64, num_experts=8, num_experts_per_token=2, moe_intermediate_size=16,
    num_shared_experts=1, latent_dim=16, latent_norm=True, attn_res_block_size=2, bos_token_id=3840,
    eos_token_id=3842, max_position_embeddings=64)
BLOCK = 4
MAX_NEW = 8
RUNNER_CONFIG = EngineConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, block_size=BLOCK,
                             token_buckets=(16, 64), seq_buckets=(8,), num_checkpoint_slots=16,
                             memory_budget_bytes=1 << 20, test_mode=True, compile_threads=2)


@functools.cache
def shared_lm() -> KimiLM:
    return KimiLM(KimiModel(SMALL, dtype=jnp.float32, rngs=nnx.Rngs(0)), impl="reference")


@functools.cache
def shared_runner() -> ModelRunner:
    """The compiled runner every engine test shares (warm-up: 2 mixed + 1 decode bucket, copy, poison)."""
    return ModelRunner(shared_lm(), RUNNER_CONFIG)


def make_engine(*, tokenizer=None, **scheduling) -> LLMEngine:
    return LLMEngine(shared_runner(), tokenizer=tokenizer, config=EngineConfig(block_size=BLOCK, **scheduling))


def run(engine: LLMEngine) -> dict[str, list[int]]:
    """Step to completion asserting no compilation; finished outputs' token ids by request id."""
    before = backend_compile_count()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert backend_compile_count() == before, "the engine compiled after warm-up"
    return done


def assert_pools_free(engine: LLMEngine) -> None:
    cache = engine.scheduler.cache
    assert engine.is_idle()
    cache.clear_prefix_cache()
    pages, slots = cache.pages.pool, cache.slots.pool
    assert pages.num_free == pages.num_usable and slots.num_free == slots.num_usable


def greedy(max_tokens=MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


_rng = np.random.default_rng(1234)
SYSTEM = _rng.integers(2, 3800, 14).tolist()  # 3 full pages + 2 tokens
_LONG = _rng.integers(2, 3800, 23).tolist()
PROMPTS = {
    "a": SYSTEM + _rng.integers(2, 3800, 3).tolist(),
    "b": SYSTEM + _rng.integers(2, 3800, 5).tolist(),
    "c": SYSTEM + _rng.integers(2, 3800, 4).tolist(),
    "d": _LONG,
    "e": _LONG[:17] + _rng.integers(2, 3800, 4).tolist(),
    "f": _rng.integers(2, 3800, 3).tolist(),
    "g": _rng.integers(2, 3800, 9).tolist(),
    "h": _rng.integers(2, 3800, 30).tolist(),
    "j": _rng.integers(2, 3800, 1).tolist(),
    "k": _rng.integers(2, 3800, 40).tolist(),
    "l": SYSTEM + _rng.integers(2, 3800, 9).tolist(),
}
PROMPTS["i"] = list(PROMPTS["a"])


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy continuations from KimiLM.generate (one batch, contiguous cache), computed before warm-up."""
    names = sorted(PROMPTS)
    outs = shared_lm().generate([PROMPTS[n] for n in names], max_new_tokens=MAX_NEW, stop_token_ids=[])
    shared_runner()
    return {n: out[len(PROMPTS[n]):] for n, out in zip(names, outs)}


def add_all(engine: LLMEngine, names, params=None) -> None:
    for name in names:
        engine.add_request(name, PROMPTS[name], params or greedy())


def test_engine_config_defaults_and_validation():
    cpu = EngineConfig().resolve(SMALL, gpu=False)
    assert (cpu.max_model_len, cpu.max_num_seqs, cpu.max_num_batched_tokens) == (64, 16, 256)
    assert cpu.buckets.tokens == (64, 256) and cpu.buckets.seqs == (16,) and cpu.buckets.pages == (4,)
    assert cpu.block_size == 16
    gpu = EngineConfig(max_num_seqs=64, max_num_batched_tokens=1024).resolve(SMALL.replace(
        max_position_embeddings=4096), gpu=True)
    assert gpu.buckets.tokens == (16, 64, 256, 1024) and gpu.buckets.seqs == (1, 4, 16, 64)
    # 64-token pages on a GPU (the Mosaic-GPU MLA decode steps 64 keys of one page): 4096 tokens = 64 pages
    assert gpu.block_size == 64 and gpu.buckets.pages == (16, 64) and gpu.num_checkpoint_slots == 64
    assert EngineConfig(block_size=16).resolve(SMALL, gpu=True).block_size == 16
    for bad, field in [(dict(kv_cache_dtype="fp16"), "kv_cache_dtype"), (dict(max_model_len=65), "max_model_len"),
                       (dict(max_num_batched_tokens=100, token_buckets=(16, 64)), "bucket"),
                       (dict(max_num_seqs=32, max_num_batched_tokens=16), "max_num_batched_tokens")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**bad).resolve(SMALL, gpu=False)


def test_prefill_steps_take_the_unabsorbed_mla_form_and_match(reference, monkeypatch):
    """Buckets of >= 16 rows per sequence with a short table take the un-absorbed MLA form (``mla_form="auto"``);
    the engine's greedy outputs stay the reference's (the absorbed form, contiguous cache), prefix hits included."""
    from kimi_jax.layers import mla

    chosen = []
    real = mla.choose_form
    monkeypatch.setattr(mla, "choose_form", lambda step, keys: chosen.append(
        (step.token_ids.shape[0], step.block_tables.shape[0], real(step, keys))) or chosen[-1][2])
    runner = ModelRunner(shared_lm(), dataclasses.replace(RUNNER_CONFIG, seq_buckets=(2, 8)))
    forms = {(t, n): form for t, n, form in chosen}
    assert forms[(64, 2)] == "unabsorbed" and forms[(16, 2)] == forms[(64, 8)] == forms[(2, 2)] == "absorbed"
    engine = LLMEngine(runner, config=EngineConfig(block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=64))
    add_all(engine, sorted(PROMPTS), greedy())
    done = run(engine)
    assert {name: done[name].outputs[0].token_ids for name in PROMPTS} == reference
    assert engine.stats().prefix_cache_hits > 0
    assert_pools_free(engine)


def test_buckets_padding_and_warm_up(reference):
    runner = shared_runner()
    assert runner.num_executables == 4 + 2 and runner.buckets.shapes() == [
        (16, 8, 16, False), (64, 8, 16, False), (8, 8, 16, True)]
    assert runner.buckets.pick(17, 3, 5) == (64, 8, 16, False)
    if runner.compile_seconds:  # compiled here, not loaded: one timing per executable, the slowest named
        assert len(runner.compile_seconds) == runner.num_executables
        assert all(s > 0 for s in runner.compile_seconds.values())
        assert "6 executables compiled" in runner.compile_summary()
    assert describe_executable((64, 8, 16, True, True)) == "decode step T=64 N=8 P=16 greedy"
    assert describe_executable(("verify", 4, 16, False)) == "verification step N=4 P=16"
    assert describe_executable("copy") == "copy"
    assert runner.buckets.pick(3, 3, 1, decode_only=True) == (8, 8, 16, True)
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64)
    add_all(engine, ["f", "g"], greedy(logprobs=2))
    request = engine.scheduler.requests["g"]
    seq = ScheduledSequence(request, PROMPTS["g"][:7], 0, [5, 6], 3, [4, 7], [9, 10], False)
    dec = ScheduledSequence(engine.scheduler.requests["f"], [11], 3, [8], 2, [], [], True)
    batch, optional, with_logprobs = runner.build_batch([seq, dec])
    s = batch.step
    assert s.token_ids.shape == (16,) and s.num_seqs == 8 and s.block_tables.shape == (8, 16)
    np.testing.assert_array_equal(s.token_ids, PROMPTS["g"][:7] + [11] + [0] * 8)
    np.testing.assert_array_equal(s.cu_seqlens, [0, 7] + [8] * 7)
    np.testing.assert_array_equal(s.context_lens, [0, 3] + [0] * 6)
    np.testing.assert_array_equal(s.block_tables[:, :3], [[5, 6, 0], [8, 0, 0]] + [[0, 0, 0]] * 6)
    np.testing.assert_array_equal(s.state_slots, [3, 2] + [0] * 6)
    np.testing.assert_array_equal(s.logits_indices, [6, 7] + [0] * 6)
    np.testing.assert_array_equal(s.checkpoint_positions, [[4, 7, -1, -1]] + [[-1] * 4] * 7)
    np.testing.assert_array_equal(s.checkpoint_slots[0], [9, 10, 0, 0])
    # only row 1 is sampled, and it asked for top-2 logprobs: the flags turn on exactly that stage
    assert with_logprobs and bool(batch.want_top_logprobs)
    assert not bool(batch.use_penalties) and not bool(batch.use_bitmask) and not bool(batch.use_sampling)
    assert not s.decode_only
    # the one-buffer transfer format round-trips every leaf bit for bit, and the bucket's word buffer (which
    # build_batch wrote the batch into) holds exactly the packed batch
    layout = PackedLayout.of(batch)
    restored = jax.jit(functools.partial(unpack, layout=layout))(pack(batch))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(batch)):
        np.testing.assert_array_equal(np.asarray(got), want)
    words = runner._buffers[(16, 8, 16, False)].take()
    np.testing.assert_array_equal(words, pack(batch))
    decode, _, _ = runner.build_batch([dec])  # refills the decode bucket's buffer; the prefill one is untouched
    assert decode.step.decode_only and decode.step.token_ids.shape == (8,)
    np.testing.assert_array_equal(runner._buffers[(16, 8, 16, False)].take(), words)
    assert len(optional) == 4 and optional[0].shape == (8, 64)  # penalty lists, width min(max_model_len, V)
    for name in ("f", "g"):
        engine.abort_request(name)
    run(engine)
    assert_pools_free(engine)


@pytest.mark.parametrize("case", ["whole_batch", "chunked_prefix_cached", "preempted"])
def test_greedy_equals_reference_whatever_the_batching(reference, case):
    settings = {
        "whole_batch": dict(max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False),
        "chunked_prefix_cached": dict(max_num_seqs=4, max_num_batched_tokens=16),
        "preempted": dict(max_num_seqs=8, max_num_batched_tokens=64, num_blocks_override=24,
                          prefix_cache_retention_interval=6),
    }[case]
    engine = make_engine(**settings)
    add_all(engine, sorted(PROMPTS), greedy(logprobs=0))
    done = run(engine)
    for name in PROMPTS:
        completion = done[name].outputs[0]
        assert completion.token_ids == reference[name], (case, name)
        assert completion.finish_reason == "length"
        assert all(np.isfinite(list(entry.values())).all() for entry in completion.logprobs)
    stats = engine.stats()
    if case == "chunked_prefix_cached":
        assert stats.prefix_cache_hits > 0  # "i" repeats "a"; "b", "c", "l" share SYSTEM's pages
    if case == "preempted":
        assert stats.num_preemptions > 0
    assert_pools_free(engine)


def test_prefix_hits_at_marconi_junction_interval_checkpoint_and_previous_turn(reference):
    # interval 0: a computes SYSTEM's pages; b sees 3 shared pages without a state there (second sighting:
    # it exports the junction at 12); c resumes at the junction; i repeats a's prompt (prompt-end hit).
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=64)
    cached, n = {}, 3
    for name in ("a", "b", "c", "i"):
        engine.add_request(name, PROMPTS[name], greedy(n))
        out = run(engine)[name]
        assert out.outputs[0].token_ids == reference[name][:n], name
        cached[name] = out.metrics.num_cached_tokens
    assert cached == {"a": 0, "b": 0, "c": 12, "i": len(PROMPTS["a"]) - 1}
    # next turn of a's conversation: resumes from a's final state (its live slot kept as a checkpoint)
    turn2 = PROMPTS["a"] + reference["a"][:n] + [7, 8, 9]
    engine.add_request("turn2", turn2, greedy(n))
    hit = run(engine)["turn2"]
    assert hit.metrics.num_cached_tokens == len(PROMPTS["a"]) + n - 1
    assert_pools_free(engine)

    # interval 5: d exports checkpoints at 5, 10, 15, 20; e shares d's first 17 tokens and resumes at 15
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=64, prefix_cache_retention_interval=5)
    for name in ("d", "e"):
        engine.add_request(name, PROMPTS[name], greedy(n))
        out = run(engine)[name]
        assert out.outputs[0].token_ids == reference[name][:n], name
        cached[name] = out.metrics.num_cached_tokens
    assert cached["e"] == 15
    assert_pools_free(engine)

    miss = make_engine(enable_prefix_caching=False)
    miss.add_request("turn2", turn2, greedy(n))
    assert run(miss)["turn2"].outputs[0].token_ids == hit.outputs[0].token_ids


class EvenTokens:
    """A TokenConstraint allowing only even token ids, for ``length`` tokens."""

    def __init__(self, length: int = 3):
        self.left = length

    def allowed_token_bitmask(self) -> np.ndarray:
        return np.full(SMALL.vocab_size // 32, 0x55555555, np.uint32).view(np.int32)

    def advance(self, token_id: int) -> None:
        assert token_id % 2 == 0
        self.left -= 1

    def is_terminated(self) -> bool:
        return self.left == 0


def test_randomized_workload_reproducible_and_leak_free(reference):
    """Random arrivals, aborts (also mid-step), preemption, greedy / seeded sampling / penalties / grammar."""
    rng = random.Random(99)
    engine = make_engine(max_num_seqs=6, max_num_batched_tokens=64, num_blocks_override=20,
                         prefix_cache_retention_interval=3)
    kinds = ["greedy", "greedy", "sampled", "sampled", "penalty", "grammar"]
    pending = []
    for i in range(36):
        name, kind, max_tokens = rng.choice(sorted(PROMPTS)), rng.choice(kinds), rng.randint(1, MAX_NEW)
        params = {
            "greedy": greedy(max_tokens),
            "sampled": SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=max_tokens,
                                      seed=rng.choice([1, 2]), ignore_eos=True),
            "penalty": greedy(max_tokens, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
            "grammar": SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                      constraint_factory=EvenTokens),
        }[kind]
        pending.append((f"{i}:{name}:{kind}", name, kind, params))
    params_of = {rid: params for rid, _, _, params in pending}
    aborted, done = set(), {}
    before = backend_compile_count()
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                rid, name, _, params = pending.pop(0)
                engine.add_request(rid, PROMPTS[name], params)
        if rng.random() < 0.06 and engine.scheduler.requests:
            victim = rng.choice(sorted(engine.scheduler.requests))
            aborted.add(victim)
            engine.abort_request(victim)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert backend_compile_count() == before
    assert len(done) == 36
    groups: dict[tuple, list[int]] = {}
    for rid, out in done.items():
        _, name, kind = rid.split(":")
        completion = out.outputs[0]
        tokens = completion.token_ids
        if rid in aborted:
            assert completion.finish_reason == "abort"
        elif kind == "greedy":
            assert tokens == reference[name][:len(tokens)] and completion.finish_reason == "length"
        elif kind == "grammar":
            assert len(tokens) == 3 and all(t % 2 == 0 for t in tokens) and completion.finish_reason == "stop"
        else:  # same prompt, parameters and seed: the same tokens whatever the batch, hit or preemption
            key = (name, kind, params_of[rid].seed)
            short, long_ = sorted([tokens, groups.get(key, tokens)], key=len)
            assert long_[:len(short)] == short, rid
            groups[key] = long_
    assert {k[1] for k in groups} == {"sampled", "penalty"}
    assert engine.stats().num_preemptions > 0 and engine.stats().prefix_cache_hits > 0
    assert_pools_free(engine)


def test_freed_pages_and_slots_are_poisoned_in_test_mode(reference):
    engine = make_engine(enable_prefix_caching=False)
    add_all(engine, ["f", "g", "h"])
    done = run(engine)
    assert all(done[n].outputs[0].token_ids == reference[n] for n in ("f", "g", "h"))
    out = engine.scheduler.schedule()  # drains the pages and slots freed by the last step, poisons them
    assert out.freed_blocks and out.freed_slots and not out.sequences
    engine.runner.execute(out)
    engine.scheduler.update_from_output(out, SampledTokens(*(np.zeros((0,) * k) for k in (1, 1, 2, 2))))
    cache = engine.runner.cache
    for pool, ids in ((cache.mla, out.freed_blocks), (cache.kda_state, out.freed_slots),
                      (cache.kda_conv, out.freed_slots)):
        values = np.asarray(pool)
        assert np.isnan(values[:, ids]).all()
        assert np.isfinite(values[:, 0]).all()  # the scratch block / slot is never poisoned
    assert_pools_free(engine)


def test_hit_rates_shared_system_prompt_and_multi_turn_chat(reference):
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=64)
    system = shared_system_prompt(engine, num_requests=12, system_len=26, suffix_len=(3, 8), max_tokens=2, wave=4)
    chat = multi_turn_chat(engine, num_conversations=3, num_turns=3, first_len=10, user_len=5, max_tokens=3)
    print(f"\nhit rates (block {BLOCK}): shared system prompt {system.rate:.1%} ({system.hits}/{system.queries}), "
          f"multi-turn chat {chat.rate:.1%} ({chat.hits}/{chat.queries})")
    assert system.rate > 0.4 and chat.rate > 0.4
    assert_pools_free(engine)


def test_async_scheduling_equals_synchronous_with_stops_seeds_and_final_checkpoints(reference):
    """Steps scheduled ahead (tokens fed from the device) give the synchronous engine's outputs: greedy
    requests stopping on a token mid-run (they drain: the queued step's work on them is discarded, and their
    final state, which then covers every token, becomes the checkpoint a follow-up turn resumes from), seeded
    sampling (the ahead step's sampler uses the next output index), and all pools free at the end."""
    names = ["a", "d", "f", "g", "h"]
    stops = {n: reference[n][3] for n in ("a", "g")}  # these two stop at their 4th token (or earlier)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, seed=7, ignore_eos=True)

    def params(name):
        return greedy(stop_token_ids=[stops[name]]) if name in stops else sampled if name == "h" else greedy()

    results = {}
    for async_scheduling in (True, False):
        engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=async_scheduling)
        engine.runner.launch_counts.clear()
        for name in names:
            engine.add_request(name, PROMPTS[name], params(name))
        ahead, done = 0, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            ahead += engine.last_timing.ahead
        assert (ahead > 0) == async_scheduling
        variants = {key[4] for key in engine.runner.launch_counts if key[3]}
        assert variants == {True, False}  # greedy-only decode steps skip the sampler's conditionals
        # a follow-up turn of a stopped request resumes from its final state
        turn = PROMPTS["a"] + done["a"] + PROMPTS["f"]
        engine.add_request("turn", turn, greedy(3))
        done["turn"] = run(engine)["turn"].outputs[0].token_ids
        assert engine.stats().prefix_cache_hits >= len(PROMPTS["a"]) + len(done["a"]) - 1
        results[async_scheduling] = done
        assert_pools_free(engine)
    assert results[True] == results[False]
    for name in names[:4]:
        want = reference[name]
        if name in stops:
            want = want[:want.index(stops[name]) + 1]
        assert results[True][name] == want, name
    fresh = make_engine(enable_prefix_caching=False)
    fresh.add_request("turn", PROMPTS["a"] + results[True]["a"] + PROMPTS["f"], greedy(3))
    assert run(fresh)["turn"].outputs[0].token_ids == results[True]["turn"]




def test_a_step_that_cannot_run_fails_at_start_up_naming_its_bucket(monkeypatch, reference):
    """Warm-up runs every step once on its all-padding batch; a step the device cannot run (here a stand-in
    raising XLA's out-of-memory error) stops the start-up with its bucket and what to change, and the engine still
    serves afterwards (the padding run wrote only the reserved entry 0 of each pool)."""
    runner = shared_runner()
    key = next(k for k in runner._steps if k[3] and k[4])  # the greedy decode step

    def out_of_memory(*args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 29.25GiB")

    monkeypatch.setitem(runner._steps, key, out_of_memory)
    with pytest.raises(RuntimeError, match=r"decode \(greedy\) step of bucket T=8, N=8, pages=16 cannot run.*"
                                           r"RESOURCE_EXHAUSTED.*max_num_batched_tokens"):
        runner._run_each_step_once()
    monkeypatch.undo()
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64)
    add_all(engine, ["a", "f"])
    done = run(engine)
    assert {n: done[n].outputs[0].token_ids for n in ("a", "f")} == {n: reference[n] for n in ("a", "f")}


def test_mxfp4_experts_are_served_in_the_configured_byte_order():
    """EngineConfig.mxfp4_byte_order: "pairs" / "words" re-lay the MXFP4 experts in place, so the runner's
    parameters are the pair-halves / word-order bytes of the checkpoint's; "auto" keeps the checkpoint order off
    the GPU; a bad value is a ValueError naming the field."""
    from pallas_kernels.mxfp4.quant import to_pair_halves, to_word_order

    cfg = SMALL.replace(experts_mxfp4=True, moe_intermediate_size=128, latent_dim=128)
    for order, convert in (("auto", None), ("pairs", to_pair_halves), ("words", to_word_order)):
        model = KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        want = np.asarray(model.moe.w1_packed[...] if convert is None else convert(model.moe.w1_packed[...]))
        runner = ModelRunner(model, dataclasses.replace(RUNNER_CONFIG, mxfp4_byte_order=order), impl="reference",
                             warm_up=False)
        name = f"moe.w1_{'packed' if convert is None else order}"
        np.testing.assert_array_equal(np.asarray(runner.params[runner.param_names.index(name)]), want)
    with pytest.raises(ValueError, match="mxfp4_byte_order"):
        dataclasses.replace(RUNNER_CONFIG, mxfp4_byte_order="nibbles").resolve(cfg, gpu=False)


def test_gpu_compiler_options_are_valid_xla_options():
    """The options the runner passes to XLA on GPU name real debug options with valid values (XLA rejects a
    misspelt enum value at compile time, on any backend), so a typo fails here rather than at GPU start-up."""
    from serve.engine.runner import GPU_COMPILER_OPTIONS

    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    np.testing.assert_array_equal(lowered.compile(GPU_COMPILER_OPTIONS)(jnp.ones(3)), 2.0)
    with pytest.raises(Exception, match="not a valid enum value"):
        lowered.compile({**GPU_COMPILER_OPTIONS, "xla_gpu_command_buffer_scheduling_mode": "NO_SUCH_MODE"})


def test_added_compiler_options_are_typed_and_malformed_ones_refused(monkeypatch):
    """``--xla-option name=value`` reaches XLA typed (bool, int, else string) and keeps the defaults; a missing
    ``=`` is a ValueError naming the option."""
    from serve.engine import runner as runner_module

    monkeypatch.setattr(runner_module, "GPU_COMPILER_OPTIONS", dict(runner_module.GPU_COMPILER_OPTIONS))
    runner_module.add_gpu_compiler_options(["xla_gpu_autotune_level=0", "xla_gpu_enable_triton_gemm=False",
                                            "xla_dump_to=/tmp/x"])
    added = runner_module.GPU_COMPILER_OPTIONS
    assert added["xla_gpu_autotune_level"] == 0 and added["xla_gpu_enable_triton_gemm"] is False
    assert added["xla_dump_to"] == "/tmp/x"
    assert added["xla_gpu_command_buffer_scheduling_mode"] == "CONCURRENT"
    with pytest.raises(ValueError, match="xla_gpu_autotune_level"):
        runner_module.add_gpu_compiler_options(["xla_gpu_autotune_level"])
    with pytest.raises(ValueError, match="gpu_autotune_level=0"):  # not an XLA option name
        runner_module.add_gpu_compiler_options(["gpu_autotune_level=0"])


def test_a_compilation_while_serving_is_counted_and_logged(reference, caplog):
    """``EngineStats.compiles_after_warm_up`` (the server's ``kimi_jax:compiles_after_warm_up``) counts XLA
    compilations since warm-up; a new one is logged as a warning at the next step. Serving itself adds none."""
    e = make_engine()
    start = e.stats().compiles_after_warm_up
    e.add_request("a", PROMPTS["a"], greedy(4))
    run(e)
    assert e.stats().compiles_after_warm_up == start
    jax.jit(lambda x: x * 3.0 + 0.25)(np.arange(11.0))  # a shape and function nothing else compiles
    assert e.stats().compiles_after_warm_up >= start + 1
    e.add_request("b", PROMPTS["b"], greedy(2))
    with caplog.at_level("WARNING", logger="serve.engine.engine"):
        while e.has_unfinished_requests():
            e.step()
    assert any("compilation(s) after warm-up" in r.getMessage() for r in caplog.records)
