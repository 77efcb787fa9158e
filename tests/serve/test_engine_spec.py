"""Speculative decoding in the engine on the small fp32 hybrid model: greedy outputs equal the non-speculative
reference token for token whatever the drafts are, and the KDA state after a verification step is exactly the
accepted prefix's.

An "oracle" drafter (the n-gram hook replaced) proposes the reference continuation with some tokens corrupted
and some steps left without drafts, so verification rows accept anything from none to all of their drafts,
zero-draft steps follow accepted ones, and a wrong state would change every later token. The runs cover mixed
batches with requests arriving while others speculate, preemption, prefix-cache hits on checkpoints written by
verification steps, and stop conditions inside an accepted block; pools end free and nothing compiles after
warm-up. fp32 logits differ between the verification and decode paths by ~1e-6 relative, far below these
prompts' top-2 logit gaps (as for every batching difference, test_engine_runner.py).
"""

from __future__ import annotations

import dataclasses
import functools
import random

import numpy as np
import pytest

from serve.engine import EngineConfig, SamplingParams
from serve.engine import ngram
from serve.engine.draft_gate import FIRST_PAUSE, WINDOW
from serve.engine.engine import LLMEngine
from serve.engine.request import Request
from serve.engine.runner import ModelRunner
from serve.engine.spec_config import SpeculativeConfig
from tests.serve.test_engine_runner import BLOCK, PROMPTS, RUNNER_CONFIG, assert_pools_free, greedy, run, shared_lm

K = 3
NEW = 16
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
        "disable_by_batch_size": 0, "min_acceptance_length": 0}  # every draft verified, whatever its acceptance


@functools.cache
def spec_runner() -> ModelRunner:
    """Buckets: T=64 mixed, N=8 decode (greedy + general), N=8 x Tq=4 verification (greedy + general)."""
    return ModelRunner(shared_lm(), dataclasses.replace(RUNNER_CONFIG, token_buckets=(64,), speculative_config=SPEC))


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    names = sorted(PROMPTS)
    outs = shared_lm().generate([PROMPTS[n] for n in names], max_new_tokens=NEW, stop_token_ids=[])
    spec_runner()
    return {n: out[len(PROMPTS[n]):] for n, out in zip(names, outs)}


def oracle(monkeypatch, reference, *, seed=0, wrong=0.25, empty=0.2):
    """Replace the prompt lookup: drafts are the reference continuation after the sequence so far, each token
    wrong with probability ``wrong``, no drafts with probability ``empty`` (a function of the sequence, like the
    real lookup, so a request's drafts do not depend on its batch)."""
    continuations = {tuple(PROMPTS[n]): reference[n] for n in PROMPTS}

    def propose(tokens, k, lo, hi, data=None):
        rng = random.Random(hash((seed, tuple(tokens))))
        for prompt, cont in continuations.items():
            n = len(prompt)
            if tuple(tokens[:n]) == prompt and list(tokens[n:]) == cont[:len(tokens) - n]:
                if rng.random() < empty:
                    return []
                rest = cont[len(tokens) - n:len(tokens) - n + k]
                return [t if rng.random() >= wrong else (t + 1) % 3800 for t in rest]
        return []

    monkeypatch.setattr(ngram, "propose", propose)


def engine(**scheduling) -> LLMEngine:
    return LLMEngine(spec_runner(), config=EngineConfig(block_size=BLOCK, speculative_config=SPEC, **scheduling))


def outputs(done) -> dict[str, list[int]]:
    return {name: out.outputs[0].token_ids for name, out in done.items()}


def test_speculative_config_is_validated():
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}').prompt_lookup_max == 5
    for bad, field in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                       ('{"method": "ngram", "num_speculative_tokens": 9}', "num_speculative_tokens"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "colour": 1}', "unknown"),
                       ('{"method": "ngram"}', "num_speculative_tokens"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "model"),
                       ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                        '"prompt_lookup_max": 2}', "prompt_lookup_max"),
                       ('{"method": "dspark", "num_speculative_tokens": 2, "rejection_sample_method": "x"}',
                        "rejection_sample_method"),
                       ("not json", "JSON")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_json(bad)
    with pytest.raises(ValueError, match="speculative_config"):
        ModelRunner(shared_lm(), dataclasses.replace(RUNNER_CONFIG, speculative_config={
            "method": "dspark", "num_speculative_tokens": 2}), warm_up=False)


def test_ngram_prompt_lookup():
    assert ngram.propose([5, 6, 7, 8, 5, 6], 3, 1, 3) == [7, 8, 5]       # "5 6" occurred: what followed it
    assert ngram.propose([5, 6, 7, 8, 9, 6], 2, 2, 3) == []              # no 2-gram "9 6" before
    assert ngram.propose([5, 6, 7, 8, 9, 6], 2, 1, 3) == [7, 8]          # the 1-gram "6"
    assert ngram.propose([1, 2, 1, 3, 1, 2], 2, 1, 2) == [1, 3]          # longest n first: "1 2"
    assert ngram.propose([256, 1, 0, 0, 1], 2, 1, 1) == [0, 0]           # byte-aligned matches only


def test_ngram_lookup_over_a_requests_growing_token_bytes():
    """The scheduler passes ``Request.token_bytes``, extended as tokens are appended: the same drafts as converting
    the whole list, at every length; bytes of another length are refused."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 6, 40).tolist()
    request = Request("r", prompt, SamplingParams(max_tokens=64))
    for token in rng.integers(0, 6, 30).tolist():
        tokens = request.all_token_ids
        assert ngram.propose(tokens, 4, 2, 5, request.token_bytes()) == ngram.propose(tokens, 4, 2, 5)
        request.append_output_token(token)
    assert bytes(request.token_bytes()) == np.asarray(request.all_token_ids, np.int32).tobytes()
    with pytest.raises(ValueError, match="data holds"):
        ngram.propose([1, 2, 1, 2], 2, 1, 2, np.asarray([1, 2, 1], np.int32).tobytes())


def test_ngram_steps_without_verification_copy_back_no_speculation_outputs(reference, monkeypatch):
    """N-gram drafts come from the host, so a step that verifies nothing returns only its tokens (each extra output
    is one more device-to-host copy per step); verification steps return their accepted counts."""
    oracle(monkeypatch, reference, seed=3, wrong=0.0, empty=0.5)
    e = engine()
    seen, apply = [], e.scheduler.update_from_output

    def record(output, sampled):
        if output.sequences:
            seen.append((bool(output.verify_len), sampled.spec is None))
        return apply(output, sampled)

    monkeypatch.setattr(e.scheduler, "update_from_output", record)
    e.add_request("a", PROMPTS["a"], greedy(NEW))
    assert outputs(run(e))["a"] == reference["a"]
    assert (True, False) in seen and (False, True) in seen
    assert (False, False) not in seen and (True, True) not in seen


@pytest.mark.parametrize("seed, wrong, empty", [(0, 0.0, 0.0), (1, 0.3, 0.2), (2, 1.0, 0.0)])
def test_greedy_outputs_equal_the_reference_whatever_the_drafts(reference, monkeypatch, seed, wrong, empty):
    oracle(monkeypatch, reference, seed=seed, wrong=wrong, empty=empty)
    e = engine()
    for name in ("a", "d", "h", "k", "f"):
        e.add_request(name, PROMPTS[name], greedy(NEW))
    got = outputs(run(e))
    assert got == {n: reference[n] for n in got}
    stats = e.stats().spec_decode
    assert stats.num_drafts > 0
    if wrong == 0.0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # perfect drafts: every one accepted
    if wrong == 1.0:
        assert stats.num_accepted_tokens == 0
    else:
        assert stats.num_accepted_tokens > 0 and stats.mean_acceptance_length > 1.5
    assert_pools_free(e)


def test_requests_whose_drafts_keep_failing_pause_drafting(monkeypatch):
    """Drafts that are always wrong: with the n-gram default floor (1.5 tokens per verification step) a request
    verifies a window of drafts, pauses for FIRST_PAUSE steps, verifies another window, pauses twice as long, and
    so on; outputs are the reference's either way, and a request with good drafts beside them keeps speculating."""
    new = 48
    names = ("f", "g")  # the shortest prompts: room for 48 tokens within max_model_len
    longer = dict(zip(names, (out[len(PROMPTS[n]):] for n, out in zip(names, shared_lm().generate(
        [PROMPTS[n] for n in names], max_new_tokens=new, stop_token_ids=[])))))

    def run_with(floor, wrong_for):
        def propose(tokens, k, lo, hi, data=None):  # the reference's next k tokens, each off by one if wrong_for
            name = next(n for n in names if tokens[:len(PROMPTS[n])] == PROMPTS[n])
            done = len(tokens) - len(PROMPTS[name])
            return [(t + (name in wrong_for)) % 3800 for t in longer[name][done:done + k]]

        monkeypatch.setattr(ngram, "propose", propose)
        e = LLMEngine(spec_runner(), config=EngineConfig(block_size=BLOCK, speculative_config={
            **SPEC, "min_acceptance_length": floor}))
        for name in names:
            e.add_request(name, PROMPTS[name], greedy(new))
        assert outputs(run(e)) == longer
        assert_pools_free(e)
        return e.stats().spec_decode

    always = run_with(0, wrong_for=names)
    paused = run_with(None, wrong_for=names)
    assert always.num_accepted_tokens == paused.num_accepted_tokens == 0
    # about new - 2 verification steps each without the gate; with it, windows of WINDOW steps between pauses of
    # FIRST_PAUSE and 2 * FIRST_PAUSE steps: 4 + 8 + 4 + 16 + 4 + ... of the 46
    assert always.num_drafts >= 2 * (new - 3)
    assert paused.num_drafts == 2 * 3 * WINDOW
    assert always.num_paused_steps == 0
    # pauses of 8 and 16 steps, then a third (of 32) that the end of the request cuts short
    assert 2 * 3 * FIRST_PAUSE < paused.num_paused_steps < 2 * 7 * FIRST_PAUSE
    mixed = run_with(None, wrong_for=("f",))
    # "g" (good drafts) still accepts all k in about every verification step: (new - 1) / (k + 1) of them
    assert mixed.num_accepted_tokens >= K * ((new - 1) // (K + 1) - 1)


def test_mixed_arrivals_preemption_prefix_hits_and_stops(reference, monkeypatch):
    """Requests arrive while others verify drafts; a small page pool forces preemption; prompts sharing pages
    hit the prefix cache (interval checkpoints from verification steps included); stop token ids and max_tokens
    end requests inside an accepted block."""
    oracle(monkeypatch, reference, seed=3, wrong=0.2, empty=0.1)
    e = engine(num_blocks_override=30, prefix_cache_retention_interval=4)
    names = sorted(PROMPTS)
    stop = {"b": reference["b"][5], "g": reference["g"][3]}
    pending = list(names)
    done = {}
    arrivals = random.Random(0)
    for _ in range(400):
        if pending and arrivals.random() < 0.5:
            n = pending.pop(0)
            params = greedy(NEW - (n == "c") * 7, stop_token_ids=[stop[n]] if n in stop else [])
            e.add_request(n, PROMPTS[n], params)
        if not e.has_unfinished_requests() and not pending:
            break
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    want = dict(reference)
    want["c"] = reference["c"][:NEW - 7]
    for n, token in stop.items():
        want[n] = reference[n][:reference[n].index(token) + 1]
    assert done == {n: want[n] for n in names}
    assert e.stats().num_preemptions > 0 and e.stats().prefix_cache_hits > 0
    assert e.stats().spec_decode.num_accepted_tokens > 0
    assert_pools_free(e)


def test_multi_turn_resume_from_a_verified_state(reference, monkeypatch):
    """Turn 2 extends turn 1's prompt and output: it resumes from turn 1's final state (kept from a verification
    step's slot) and its greedy continuation equals recomputing everything."""
    oracle(monkeypatch, reference, seed=4, wrong=0.2, empty=0.0)
    e = engine()
    e.add_request("t1", PROMPTS["h"], greedy(NEW))
    first = run(e)["t1"].outputs[0].token_ids
    turn2 = PROMPTS["h"] + first + [7, 8, 9]
    want = shared_lm().generate([turn2], max_new_tokens=8, stop_token_ids=[])[0][len(turn2):]
    monkeypatch.setattr(ngram, "propose", lambda tokens, k, lo, hi, data=None: want[len(tokens) - len(turn2):][:k])
    e.add_request("t2", turn2, greedy(8))
    done = run(e)
    assert done["t2"].outputs[0].token_ids == want and done["t2"].metrics.num_cached_tokens > len(PROMPTS["h"])
    assert_pools_free(e)


def test_opted_out_and_constrained_requests_are_not_speculated(reference, monkeypatch):
    oracle(monkeypatch, reference, seed=5, wrong=0.0, empty=0.0)
    e = engine()
    e.add_request("a", PROMPTS["a"], greedy(NEW, speculative=False))
    e.add_request("d", PROMPTS["d"], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1))
    got = outputs(run(e))
    assert got == {"a": reference["a"], "d": reference["d"]}
    assert e.stats().spec_decode.num_drafts == 0
    assert_pools_free(e)


def test_speculation_turns_off_for_large_batches(reference, monkeypatch):
    oracle(monkeypatch, reference, seed=6, wrong=0.0, empty=0.0)
    e = LLMEngine(spec_runner(), config=EngineConfig(block_size=BLOCK, speculative_config={
        **SPEC, "disable_by_batch_size": 3}))
    for name in ("a", "d", "h", "k"):
        e.add_request(name, PROMPTS[name], greedy(4 if name in "ad" else NEW))
    got = outputs(run(e))
    assert got == {n: reference[n][:len(got[n])] for n in got} and len(got["h"]) == NEW
    stats = e.stats().spec_decode
    assert 0 < stats.num_drafts  # once "a" and "d" have finished, two are left: below the bound
    batch4 = LLMEngine(spec_runner(), config=EngineConfig(block_size=BLOCK, speculative_config={
        **SPEC, "disable_by_batch_size": 1}))
    batch4.add_request("a", PROMPTS["a"], greedy(NEW))
    run(batch4)
    assert batch4.stats().spec_decode.num_drafts == 0


def test_sampled_outputs_reproduce_per_seed(monkeypatch, reference):
    """Sampling with speculation draws from the request's own seed: the same seed gives the same tokens
    whatever else is in the batch."""
    oracle(monkeypatch, reference, seed=7, wrong=0.3, empty=0.0)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW, ignore_eos=True, seed=11)
    e = engine()
    e.add_request("alone", PROMPTS["k"], params)
    alone = outputs(run(e))["alone"]
    e.add_request("again", PROMPTS["k"], params)
    e.add_request("other", PROMPTS["d"], greedy(NEW))
    got = outputs(run(e))
    assert len(alone) == NEW and got["again"] == alone
    assert_pools_free(e)


def test_verification_steps_keep_only_the_accepted_state(reference, monkeypatch):
    """The live slot after a verification row is the out slot after the last kept token, and every other
    verification slot is back on the free list."""
    oracle(monkeypatch, reference, seed=8, wrong=0.5, empty=0.0)
    e = engine(enable_prefix_caching=False)
    e.add_request("k", PROMPTS["k"], greedy(NEW))
    seen = []
    real = e.scheduler._apply_verified

    def spy(seq, row, sampled, queued):
        before = set(seq.checkpoint_slots)
        ok = real(seq, row, sampled, queued)
        request = seq.request
        if not request.is_finished:
            kept = int(sampled.spec.num_accepted[row]) + 1
            assert request.state_slot == seq.checkpoint_slots[kept - 1]
            assert all(e.scheduler.cache.slots.pool.is_free(s) for s in before - {request.state_slot})
            seen.append(kept)
        return ok

    monkeypatch.setattr(e.scheduler, "_apply_verified", spy)
    assert outputs(run(e)) == {"k": reference["k"]}
    assert seen and max(seen) > 1
    assert_pools_free(e)
    assert np.all(np.asarray(seen) >= 1)


def test_nan_state_in_a_verification_step_fails_only_its_request(reference, monkeypatch):
    """The live state of "h" turns NaN before a verification step: its rows' logits are non-finite, so it fails
    alone (its verification slots freed); the others still equal the reference."""
    from serve.engine.faults import FaultInjector

    oracle(monkeypatch, reference, seed=1, wrong=0.3, empty=0.0)
    e = engine()
    runner = e.runner
    verify_steps = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda out: (verify_steps.append(out.verify_len > 0), execute(out))[1])
    first = runner.num_launches
    runner.fault_injector = injector = FaultInjector(nan={first + s: ["h"] for s in range(3, 20)})
    try:
        for name in ("a", "d", "h", "k"):
            e.add_request(name, PROMPTS[name], greedy(NEW))
        done = run(e)
    finally:
        runner.fault_injector = None
    (kind, step, ids), = injector.fired
    assert kind == "nan" and ids == ("h",) and verify_steps[step - first]
    assert done["h"].error and done["h"].outputs[0].finish_reason == "error"
    assert {n: done[n].outputs[0].token_ids for n in ("a", "d", "k")} == {n: reference[n] for n in ("a", "d", "k")}
    assert_pools_free(e)
