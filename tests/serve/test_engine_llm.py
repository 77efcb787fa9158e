"""The offline ``LLM`` API on the engine with the tiny tokenizer: text in, text and token ids out, stop strings,
stop token ids, n > 1 and request validation. Uses the small random model and shared runner of
test_engine_runner.py (its vocabulary matches the tiny tokenizer's 4096 ids)."""

from __future__ import annotations

import functools

import pytest

from kimi_jax.tokenizer import IncrementalDetokenizer, load_tokenizer
from serve.engine import SamplingParams
from serve.engine.llm import LLM
from tests.serve.test_engine_runner import make_engine

PROMPTS = ["def fibonacci(n):", "Hello, world", "import numpy as np\n"]


@functools.cache
def tokenizer():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.from_engine(make_engine(tokenizer=tokenizer(), max_num_seqs=8, max_num_batched_tokens=64))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def streamed_text(ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer(), skip_special_tokens=True)
    return "".join(detok.add(t) for t in ids) + detok.flush()


def test_text_and_token_prompts_in_prompt_order(llm):
    outs = llm.generate(PROMPTS, greedy(6))
    assert [o.prompt_token_ids for o in outs] == [tokenizer().encode(p) for p in PROMPTS]
    for out in outs:
        (completion,) = out.outputs
        assert out.finished and completion.finish_reason == "length" and len(completion.token_ids) == 6
        assert completion.text == streamed_text(completion.token_ids)
    ids = [o.prompt_token_ids for o in outs]
    assert llm.generate(ids[1], greedy(6))[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    again = llm.generate(ids[::-1], [greedy(6), greedy(3), greedy(6)])
    assert [o.outputs[0].token_ids for o in again] == [outs[2].outputs[0].token_ids,
                                                       outs[1].outputs[0].token_ids[:3],
                                                       outs[0].outputs[0].token_ids]
    assert llm.generate([]) == []


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate(PROMPTS[0], greedy(12))[0].outputs[0]
    text = base.text
    at = next(k for k in range(2, len(text) - 6) if text[k:k + 3].strip() and text.find(text[k:k + 3]) == k)
    stop = text[at:at + 3]
    cut = llm.generate(PROMPTS[0], greedy(12, stop=[stop, "\x00never"]))[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (text[:at], "stop", stop)
    assert base.token_ids[:len(cut.token_ids)] == cut.token_ids and len(cut.token_ids) < 12
    kept = llm.generate(PROMPTS[0], greedy(12, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:at + 3] and kept.token_ids == cut.token_ids

    j = 4
    stop_id = base.token_ids[j]
    j = base.token_ids.index(stop_id)
    by_id = llm.generate(PROMPTS[0], greedy(12, stop_token_ids=[stop_id]))[0].outputs[0]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", stop_id)
    assert by_id.token_ids == base.token_ids[:j + 1]
    assert by_id.text == streamed_text(base.token_ids[:j])  # the stop token's text is not part of the output


def test_n_completions_reproducible_per_seed(llm):
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=7)
    hits_before = engine.stats().prefix_cache_hits
    (alone,) = llm.generate(PROMPTS[2], params)
    prompt_len = len(alone.prompt_token_ids)
    assert engine.stats().prefix_cache_hits - hits_before >= 2 * (prompt_len - 1)  # siblings reuse the prompt
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    texts = [c.token_ids for c in alone.outputs]
    assert len({tuple(t) for t in texts}) == 3
    mixed = llm.generate(PROMPTS, [greedy(4), greedy(2), params])[2]
    assert [c.token_ids for c in mixed.outputs] == texts
    single = llm.generate(PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=5, seed=8))[0]
    assert single.outputs[0].token_ids == texts[1]  # completion i samples with seed + i
    greedy_two = llm.generate(PROMPTS[2], greedy(5, n=2))[0]
    greedy_one = llm.generate(PROMPTS[2], greedy(5))[0]
    assert [c.token_ids for c in greedy_two.outputs] == [greedy_one.outputs[0].token_ids] * 2


def test_invalid_requests_raise_value_error(llm):
    engine = llm.engine
    for prompt, params, match in [
        ([], greedy(2), "empty"),
        ([5000], greedy(2), "out of range"),
        ([1] * 64, greedy(2), "max_model_len"),
        ([1, 2], greedy(2, logprobs=21), "logprobs"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], params)
    no_text = LLM.from_engine(make_engine())
    with pytest.raises(ValueError, match="tokenizer"):
        no_text.generate("text needs a tokenizer")
    with pytest.raises(ValueError, match="stop"):
        no_text.generate([[1, 2]], greedy(2, stop=["x"]))
    with pytest.raises(ValueError, match="neither a checkpoint folder nor a preset"):
        LLM("no-such-model")
    assert engine.is_idle() and no_text.engine.is_idle()
