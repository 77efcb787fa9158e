"""The thinking budget in the engine (``SamplingParams.thinking_token_budget``) on the small fp32 hybrid model.

When a request's budget runs out, the engine appends the section's closing tokens as if sampled; everything after
them must be exactly the greedy continuation of ``prompt + thought + closing tokens``, i.e. the closing tokens are
fed to the model (MLA pages and KDA state) like any other token. Covered: with and without asynchronous scheduling,
under speculative decoding with drafts that cross the budget, through preemption, the model closing the section
itself (the engine completes a closer the model starts), closing tokens cut by max_tokens, logprobs of the closing
tokens; pools end free, nothing compiles after warm-up. References come from ``KimiLM.generate`` (one batch,
contiguous cache).
"""

from __future__ import annotations

import pytest

from serve.engine import SamplingParams
from serve.engine.engine import LLMEngine
from tests.serve.test_engine_runner import PROMPTS, assert_pools_free, greedy, make_engine, run, shared_lm
from tests.serve.test_engine_spec import engine as spec_engine
from tests.serve.test_engine_spec import oracle

NEW = 16
END = [4001, 4002, 4003]  # stand-ins for "<|close|>think<|sep|><|open|>response<|sep|>"
BUDGETS = {"a": 3, "d": 1, "h": 6, "k": 9, "f": 4}


def continuation(prompt: list[int], new: int) -> list[int]:
    return shared_lm().generate([prompt], max_new_tokens=new, stop_token_ids=[])[0][len(prompt):]


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """Per prompt: ``budget`` thought tokens, the closing tokens, then the continuation of all of that."""
    want = {}
    for name, budget in BUDGETS.items():
        thought = continuation(PROMPTS[name], budget)
        assert END[0] not in thought
        head = thought + END
        want[name] = head + continuation(PROMPTS[name] + head, NEW - len(head))
    return want


def budgeted(name: str, **kw) -> SamplingParams:
    return greedy(NEW, thinking_token_budget=BUDGETS[name], thinking_end_token_ids=list(END), **kw)


def finish(engine: LLMEngine, names) -> dict[str, list[int]]:
    for name in names:
        engine.add_request(name, PROMPTS[name], budgeted(name))
    return {n: out.outputs[0].token_ids for n, out in run(engine).items()}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_closing_tokens_are_fed_like_sampled_ones(expected, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling)
    assert finish(e, BUDGETS) == expected
    assert_pools_free(e)


def test_through_preemption(expected):
    e = make_engine(num_blocks_override=20, max_num_batched_tokens=16)
    assert finish(e, BUDGETS) == expected
    assert e.stats().num_preemptions > 0
    assert_pools_free(e)


@pytest.mark.parametrize("wrong", [0.0, 0.3])
def test_speculation_stops_an_accepted_block_at_the_budget(expected, monkeypatch, wrong):
    """Drafts follow the expected output (closing tokens included), so accepted blocks run across the budget:
    verification must keep only the tokens up to it, then feed the closing tokens."""
    drafts_follow = {n: next((expected[m] for m in expected if PROMPTS[m] == PROMPTS[n]), []) for n in PROMPTS}
    oracle(monkeypatch, drafts_follow, seed=5, wrong=wrong, empty=0.0)
    e = spec_engine()
    assert finish(e, BUDGETS) == expected
    assert e.stats().spec_decode.num_accepted_tokens > 0
    assert_pools_free(e)


def test_a_section_the_model_closes_itself_gets_nothing_appended():
    plain = continuation(PROMPTS["g"], NEW)
    e = make_engine()
    e.add_request("g", PROMPTS["g"], greedy(NEW, thinking_token_budget=5, thinking_end_token_ids=[plain[2], *END]))
    assert run(e)["g"].outputs[0].token_ids == plain  # its 3rd token is the closing one: the budget is off


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_closer_the_model_starts_is_completed_by_the_engine(async_scheduling):
    """The model's own 3rd token opens the closer (``thinking_end_token_ids[0]``); the engine appends the rest of
    the closer (``thinking_close_len`` = 3: two more tokens, which the model would not have sampled) and the model
    continues from there, also when the step after the closer's first token was launched ahead."""
    plain = continuation(PROMPTS["g"], NEW)
    closer = [plain[2], 4001, 4002]
    head = plain[:3] + closer[1:]
    want = head + continuation(PROMPTS["g"] + head, NEW - len(head))
    e = make_engine(async_scheduling=async_scheduling)
    e.add_request("g", PROMPTS["g"], greedy(NEW, thinking_token_budget=9, thinking_end_token_ids=[*closer, 4003],
                                            thinking_close_len=3, logprobs=0))
    out = run(e)["g"].outputs[0]
    assert out.token_ids == want
    assert out.logprobs[3:5] == [{4001: 0.0}, {4002: 0.0}] and out.logprobs[2][plain[2]] < 0.0
    assert_pools_free(e)


def test_max_tokens_cuts_the_closing_tokens_and_they_carry_logprob_zero():
    thought = continuation(PROMPTS["b"], 4)
    e = make_engine()
    e.add_request("b", PROMPTS["b"], greedy(6, thinking_token_budget=4, thinking_end_token_ids=list(END), logprobs=0))
    out = run(e)["b"].outputs[0]
    assert out.token_ids == thought + END[:2] and out.finish_reason == "length"
    assert out.logprobs[4:] == [{END[0]: 0.0}, {END[1]: 0.0}]
    assert all(lp[t] < 0.0 for lp, t in zip(out.logprobs[:4], thought))


def test_budget_fields_are_validated():
    with pytest.raises(ValueError, match="thinking_end_token_ids"):
        SamplingParams(thinking_token_budget=3).validate()
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=0, thinking_end_token_ids=[1]).validate()
    with pytest.raises(ValueError, match="thinking_end_token_ids"):
        SamplingParams(thinking_token_budget=2, thinking_end_token_ids=[-1]).validate()
    with pytest.raises(ValueError, match="thinking_close_len"):
        SamplingParams(thinking_token_budget=2, thinking_end_token_ids=[1, 2], thinking_close_len=3).validate()
