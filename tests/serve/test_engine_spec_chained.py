"""Chained verification: with asynchronous scheduling a verification step is launched while the one before it
still runs, its rows built on the device from that step's carry (``speculation.chain_verification``). Its outputs,
speculation counters and freed pools must equal those of serial scheduling (every verification step built on the
host after reading the step before) token for token: drafts accepted in full (a draft model with the target's
weights), in part (sampled DSpark drafts with block verification) or not at all; requests that stop mid-chain
(max_tokens, a stop token, an abort) drain; sampled requests draw the same tokens. Each run also checks that
chained steps were launched, so none of this passes by falling back to serial steps."""

from __future__ import annotations

import functools

import pytest

from serve.engine import EngineConfig, SamplingParams
from serve.engine.engine import LLMEngine
from serve.engine.faults import FaultInjector
from tests.serve import test_engine_draft_model as draft_model
from tests.serve import test_engine_dspark as dspark
from tests.serve.test_engine_runner import BLOCK, PROMPTS, assert_pools_free, greedy, run, shared_lm


@functools.cache
def reference(name: str) -> list[int]:
    """The target's own greedy continuation of PROMPTS[name] (no cache, no speculation)."""
    out = shared_lm().generate([PROMPTS[name]], max_new_tokens=draft_model.NEW, stop_token_ids=[])[0]
    return out[len(PROMPTS[name]):]


def run_engine(runner, spec: dict, requests: dict, *, async_scheduling: bool, abort: str | None = None
               ) -> tuple[dict, tuple, int]:
    """Run ``requests`` (name -> SamplingParams) to completion -> (token ids by name, the speculation counters,
    verification steps launched chained). ``abort``: abort that request once a chained step is in flight."""
    e = LLMEngine(runner, config=EngineConfig(block_size=BLOCK, speculative_config=spec,
                                              async_scheduling=async_scheduling))
    chained = []
    execute = e.runner.execute

    def counting(out):
        chained.append(bool(out.verify_len) and any(seq.scheduled_ahead for seq in out.sequences))
        return execute(out)

    e.runner.execute = counting
    for name, params in requests.items():
        e.add_request(name, PROMPTS[name], params)
    if abort is not None:
        while not any(chained):
            e.step()
        e.abort_request(abort)
    done = run(e)
    s = e.stats().spec_decode
    assert_pools_free(e)
    counters = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, tuple(s.accepted_per_pos))
    return {n: list(o.outputs[0].token_ids) for n, o in done.items()}, counters, sum(chained)


def assert_chained_equals_serial(runner, spec: dict, requests: dict) -> tuple[dict, tuple]:
    serial, serial_counts, none = run_engine(runner, spec, requests, async_scheduling=False)
    chained, chained_counts, launched = run_engine(runner, spec, requests, async_scheduling=True)
    assert none == 0 and launched > 0
    assert chained == serial
    assert chained_counts == serial_counts
    return chained, chained_counts


def test_drafts_accepted_in_full_and_cut_by_max_tokens():
    """The twin draft model's greedy drafts are all accepted (so each chained row starts from the state after k
    accepted drafts); max_tokens of 3, 5 and 8 end requests inside a chain, and the rows left get fewer drafts."""
    lengths = {"a": 3, "d": 5, "h": 8, "k": draft_model.NEW}
    outputs, (_, drafted, accepted, _) = assert_chained_equals_serial(
        draft_model.draft_runner(), draft_model.SPEC, {n: greedy(m) for n, m in lengths.items()})
    assert outputs == {n: reference(n)[:m] for n, m in lengths.items()}
    assert accepted == drafted > 0


def test_drafts_accepted_in_part_with_sampling():
    """Sampled DSpark drafts under block verification, sampled and greedy requests: some drafts are accepted,
    some rejected, and every drawn token equals serial scheduling's (the chained row's sampling index advances by
    what the step before emitted)."""
    requests = {n: SamplingParams(temperature=0.0 if n == "a" else 0.9, max_tokens=dspark.NEW, ignore_eos=True,
                                  seed=i) for i, n in enumerate(("a", "d", "h", "k"))}
    _, (_, drafted, accepted, _) = assert_chained_equals_serial(dspark.dspark_runner(), dspark.SPEC, requests)
    assert 0 < accepted < drafted


def test_a_stop_token_mid_chain_drains():
    """A stop token inside an accepted run ends "d" while the next (chained) step already holds it: it drains, and
    the others continue as in serial scheduling."""
    stop = reference("d")[5]
    requests = {"a": greedy(draft_model.NEW), "d": greedy(draft_model.NEW, stop_token_ids=[stop]),
                "h": greedy(draft_model.NEW)}
    outputs, _ = assert_chained_equals_serial(draft_model.draft_runner(), draft_model.SPEC, requests)
    assert outputs["d"] == reference("d")[:reference("d").index(stop) + 1]
    assert outputs["a"] == reference("a") and outputs["h"] == reference("h")


def test_an_abort_while_a_chained_step_runs():
    requests = {n: greedy(draft_model.NEW) for n in ("a", "d", "h")}
    outputs, _, launched = run_engine(draft_model.draft_runner(), draft_model.SPEC, requests, async_scheduling=True,
                                      abort="d")
    assert launched > 0
    assert outputs["a"] == reference("a") and outputs["h"] == reference("h")
    assert outputs["d"] == reference("d")[:len(outputs["d"])] and len(outputs["d"]) < draft_model.NEW


@pytest.mark.parametrize("fault", ["launch", "result"])
def test_a_failed_step_in_a_chain_fails_its_requests_and_the_engine_goes_on(fault):
    """A chained step whose launch raises fails its requests; a step whose result read raises while a chained step
    is queued after it fails both steps' requests. Either way slots and pages come back, and requests added
    afterwards decode the reference tokens."""
    e = LLMEngine(draft_model.draft_runner(),
                  config=EngineConfig(block_size=BLOCK, speculative_config=draft_model.SPEC))
    injector = FaultInjector()
    e.runner.fault_injector = injector
    queued = []
    execute = e.runner.execute

    def arm(out):  # the first chained step: fail it, or the step before it
        chained = bool(out.verify_len) and any(seq.scheduled_ahead for seq in out.sequences)
        if chained and not queued:
            queued.append(e.runner.num_launches)
            if fault == "launch":
                injector.launch = {e.runner.num_launches}
            else:
                injector.result = {e.runner.num_launches - 1}
        return execute(out)

    e.runner.execute = arm
    try:
        for name in ("a", "d"):
            e.add_request(name, PROMPTS[name], greedy(draft_model.NEW))
        failed = run(e)
        assert queued and injector.fired and {o.outputs[0].finish_reason for o in failed.values()} == {"error"}
        e.add_request("h", PROMPTS["h"], greedy(draft_model.NEW))
        assert run(e)["h"].outputs[0].token_ids == reference("h")
    finally:
        e.runner.fault_injector = None
    assert_pools_free(e)


def test_a_paused_draft_gate_stops_the_chain():
    """A floor of k + 1 tokens per verification step (every draft accepted) pauses the random DSpark drafter's
    requests after one window: chaining stops for them, greedy outputs stay the target's, fewer drafts are
    verified than without the gate."""
    requests = {n: greedy(dspark.NEW) for n in ("a", "d")}
    k = dspark.SPEC["num_speculative_tokens"]
    gated, (gated_drafts, *_), _ = run_engine(dspark.dspark_runner(), {**dspark.SPEC, "min_acceptance_length": k + 1},
                                              requests, async_scheduling=True)
    free, (free_drafts, *_), launched = run_engine(dspark.dspark_runner(), dspark.SPEC, requests,
                                                   async_scheduling=True)
    assert gated == free == {n: reference(n)[:dspark.NEW] for n in requests}
    assert launched > 0 and gated_drafts < free_drafts
