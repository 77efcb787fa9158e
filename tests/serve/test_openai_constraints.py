"""llguidance constraints on the tiny tokenizer: bitmask layout, masks that admit exactly the grammar, random
walks through the mask that always end in output that parses and validates, and the K3 / K2 chat grammars."""

import json
import random

import numpy as np
import pytest

from kimi_jax.tokenizer import load_tokenizer
from kimi_jax.chat import K2OutputParser, K3OutputParser, schema_error
from serve.openai.constraints import ConstraintFactory, allowed_ids, bitmask_of
from serve.openai.grammars import MAX_CALLS, K2Grammars, K3Grammars, json_grammar

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "tags"],
          "properties": {"name": {"enum": ["ann", "bob"]}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                                     "exact": {"type": "boolean"}}, "required": ["query", "exact"]}}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def k3():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def k2():
    return load_tokenizer("tiny-k2")


def allowed(constraint, tokenizer) -> set[int]:
    return set(allowed_ids(constraint.allowed_token_bitmask(), tokenizer.vocab_size).tolist())


def feed(constraint, tokenizer, text: str) -> None:
    """Advance through `text`, checking that every token was allowed by the mask before it."""
    for token in tokenizer.encode(text, allow_special=True):
        assert token in allowed(constraint, tokenizer), f"{tokenizer.decode([token])!r} refused"
        constraint.advance(token)


def random_walk(constraint, tokenizer, rng: random.Random, max_steps: int = 300) -> list[int]:
    """Sample among the allowed tokens until the grammar ends; returns the ids.

    Biased so walks end in reasonable time: an allowed special token 30% of the time, else a short (<= 2 byte)
    token half the time, else any allowed token.
    """
    ids = []
    for _ in range(max_steps):
        if constraint.is_terminated():
            return ids
        choices = sorted(allowed(constraint, tokenizer))
        assert choices, "the mask allowed nothing before the grammar ended"
        special = [t for t in choices if tokenizer.is_special(t)]
        short = [t for t in choices if len(tokenizer.token_bytes(t)) <= 2]
        if special and rng.random() < 0.3:
            choices = special
        elif short and rng.random() < 0.5:
            choices = short
        token = rng.choice(choices)
        constraint.advance(token)
        ids.append(token)
    raise AssertionError("random walk did not terminate")


def test_bitmask_layout(k3):
    ids = [0, 31, 32, 63, k3.vocab_size - 1]
    mask = bitmask_of(ids, k3.vocab_size)
    assert mask.dtype == np.int32 and mask.shape == ((k3.vocab_size + 31) // 32,)
    assert mask[0] == np.int32(-(2**31) + 1)  # bits 0 and 31
    assert allowed_ids(mask, k3.vocab_size).tolist() == ids


def test_json_mask_matches_grammar(k3):
    constraint = ConstraintFactory(k3, json_grammar({"type": "object"}))()
    mask = constraint.allowed_token_bitmask()
    assert mask.dtype == np.int32 and mask.shape == (k3.vocab_size // 32,)
    first = allowed(constraint, k3)
    texts = {i: k3.token_bytes(i) for i in first}
    assert all(t.lstrip().startswith(b"{") or not t.strip() for t in texts.values())
    assert k3.encode("{")[0] in first and k3.encode("x")[0] not in first
    assert not any(k3.is_special(i) for i in first)
    feed(constraint, k3, '{"a": [1, 2]}')
    assert allowed(constraint, k3) == set(k3.eos_token_ids)
    constraint.advance(k3.eos_token_ids[0])
    assert constraint.is_terminated()
    assert allowed(constraint, k3) == set(k3.eos_token_ids)


def test_type_mismatch_is_masked(k3):
    constraint = ConstraintFactory(k3, json_grammar({"type": "object", "properties": {"n": {"type": "integer"}},
                                                     "required": ["n"]}))()
    feed(constraint, k3, '{"n": ')  # separators are fixed json.dumps style: ', ' and ': '
    options = allowed(constraint, k3)
    assert k3.encode('"')[0] not in options and k3.encode("7")[0] in options


@pytest.mark.parametrize("seed", range(4))
def test_random_walks_produce_valid_json(k3, seed):
    factory = ConstraintFactory(k3, json_grammar(PERSON))
    ids = random_walk(factory(), k3, random.Random(seed))
    value = json.loads(k3.decode(ids, skip_special_tokens=True))  # ends at `}` (nothing may follow) or EOS
    assert schema_error(value, PERSON) is None


@pytest.mark.parametrize("thinking", [True, False])
def test_k3_response_grammar_walks_parse(k3, thinking):
    factory = ConstraintFactory(k3, K3Grammars(k3).response(PERSON, thinking=thinking, think_tokens=20))
    for seed in range(2):
        ids = random_walk(factory(), k3, random.Random(seed))
        parser = K3OutputParser(thinking=thinking)
        parser.feed(k3.decode(ids))
        parsed = parser.finish()
        assert schema_error(json.loads(parsed.content), PERSON) is None and not parsed.tool_calls


def test_k3_think_channel_is_free_text_without_control_tokens(k3):
    constraint = ConstraintFactory(k3, K3Grammars(k3).response(PERSON, thinking=True, think_tokens=50))()
    feed(constraint, k3, "Some <thoughts> here")
    options = allowed(constraint, k3)
    assert k3.special_token_id("<|close|>") in options and k3.special_token_id("<|open|>") not in options
    assert k3.encode("more")[0] in options


@pytest.mark.parametrize("think_tokens", [0, 1, 7])
def test_k3_think_channel_is_closed_after_its_budget(k3, think_tokens):
    """However long a model would think, the think channel closes after `think_tokens` and the JSON follows."""
    for grammar in (K3Grammars(k3).response(PERSON, thinking=True, think_tokens=think_tokens),
                    K3Grammars(k3).tool_calls(TOOLS, thinking=True, multiple=False, think_tokens=think_tokens)):
        constraint = ConstraintFactory(k3, grammar)()
        word = k3.encode(" word")[0]
        for _ in range(think_tokens):
            assert word in allowed(constraint, k3)
            constraint.advance(word)
        assert allowed(constraint, k3) == {k3.special_token_id("<|close|>")}


@pytest.mark.parametrize("multiple", [True, False])
def test_k3_tool_grammar_walks_give_valid_calls(k3, multiple):
    factory = ConstraintFactory(k3, K3Grammars(k3).tool_calls(TOOLS, thinking=True, multiple=multiple,
                                                              think_tokens=10, call_tokens=40))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        ids = random_walk(factory(), k3, random.Random(seed), max_steps=3000)
        parser = K3OutputParser(thinking=True, tools=TOOLS)
        parser.feed(k3.decode(ids))
        calls = parser.finish().tool_calls
        assert calls and (multiple or len(calls) == 1) and len(calls) <= MAX_CALLS
        assert [c.id.rsplit(":", 1)[1] for c in calls] == [str(k) for k in range(1, len(calls) + 1)]
        for call in calls:
            assert schema_error(json.loads(call.arguments), schemas[call.name]) is None


def _longest_non_special(constraint, tokenizer) -> int:
    """The allowed plain-text token with the most bytes that is no closing quote (a model that never stops)."""
    options = [t for t in allowed(constraint, tokenizer) if not tokenizer.is_special(t)]
    return max(options, key=lambda t: (len(tokenizer.token_bytes(t)), t)) if options else min(
        allowed(constraint, tokenizer))


def _adversary_completion(constraint, tokenizer, limit: int = 400) -> list[int]:
    ids = []
    while not constraint.is_terminated():
        token = _longest_non_special(constraint, tokenizer)
        constraint.advance(token)
        ids.append(token)
        assert len(ids) < limit, tokenizer.decode(ids)
    return ids


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("call_tokens", [140, 300])  # the markup alone takes about 120
def test_k3_free_text_arguments_fit_the_call_budget(k3, thinking, call_tokens):
    """An adversary that never picks `<|close|>` while anything else is allowed still completes the call, all
    arguments present, within call_tokens: free string text and plain numbers stop at their shares."""
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "required": ["path", "text", "size", "offset"],
        "properties": {"path": {"type": "string"}, "text": {"type": "string"}, "mode": {"enum": ["w", "a"]},
                       "size": {"type": "integer"}, "offset": {"type": "number"}}}}}]
    constraint = ConstraintFactory(k3, K3Grammars(k3).tool_calls(tools, thinking=thinking, multiple=False,
                                                                 call_tokens=call_tokens))()
    ids = _adversary_completion(constraint, k3)
    assert len(ids) <= call_tokens
    parser = K3OutputParser(thinking=thinking, tools=tools)
    parser.feed(k3.decode(ids))
    [call] = parser.finish().tool_calls
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"path", "text", "mode", "size", "offset"} and arguments["path"] and arguments["text"]
    assert isinstance(arguments["size"], int) and isinstance(arguments["offset"], (int, float))
    if call_tokens == 300:
        assert len(ids) > 200  # the shares are used, not just a token each


def test_k3_number_arguments_are_bounded_and_finite(k3):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["x", "n"], "properties": {"x": {"type": "number"}, "n": {"type": "integer"}}}}}]
    constraint = ConstraintFactory(k3, K3Grammars(k3).tool_calls(tools, thinking=False, multiple=False))()
    ids = _adversary_completion(constraint, k3)
    parser = K3OutputParser(thinking=False, tools=tools)
    parser.feed(k3.decode(ids))
    [call] = parser.finish().tool_calls
    arguments = json.loads(call.arguments)
    assert isinstance(arguments["x"], float) and isinstance(arguments["n"], int) and abs(arguments["n"]) < 10**18


def test_k3_union_types_get_one_form_per_type(k3):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["note", "pick"],
        "properties": {"note": {"type": ["string", "null"], "maxLength": 4}, "pick": {"enum": [1, "two"]}}}}}]
    grammar = K3Grammars(k3).tool_calls(tools, thinking=False, multiple=False)
    head = '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
    constraint = ConstraintFactory(k3, grammar)()
    feed(constraint, k3, head + '<|open|>argument key="note" type="null"<|sep|>null<|close|>argument<|sep|>'
                                '<|open|>argument key="pick" type="string"<|sep|>two<|close|>argument<|sep|>')
    constraint = ConstraintFactory(k3, grammar)()
    feed(constraint, k3, head + '<|open|>argument key="note" type="')
    assert k3.encode("number")[0] not in allowed(constraint, k3)
    constraint = ConstraintFactory(k3, grammar)()
    feed(constraint, k3, head + '<|open|>argument key="note" type="string"<|sep|>abcd<|close|>argument<|sep|>'
                                '<|open|>argument key="pick" type="string"<|sep|>')
    assert allowed(constraint, k3) == {k3.encode("two")[0]}  # only the enum's string, not free text
    with pytest.raises(ValueError, match="decimal"):
        K3Grammars(k3).tool_calls([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "decimal"}}}}}], thinking=False, multiple=False)


def test_k3_tool_grammar_refuses_undeclared_tool(k3):
    constraint = ConstraintFactory(k3, K3Grammars(k3).tool_calls(TOOLS, thinking=False, multiple=False))()
    feed(constraint, k3, '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="')
    prefix_ok = {k3.encode(name)[0] for name in ("lookup", "ping")}
    assert prefix_ok <= allowed(constraint, k3)
    assert k3.encode("zzz")[0] not in allowed(constraint, k3)


def test_k3_tool_grammar_accepts_rendered_call(k3):
    constraint = ConstraintFactory(k3, K3Grammars(k3).tool_calls(TOOLS, thinking=True, multiple=True,
                                                                 think_tokens=5))()
    feed(constraint, k3, 'plan<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>'
                         '<|open|>tools<|sep|><|open|>call tool="lookup" index="1"<|sep|>'
                         '<|open|>argument key="query" type="string"<|sep|>a "quoted" & raw text'
                         '<|close|>argument<|sep|>'
                         '<|open|>argument key="exact" type="boolean"<|sep|>true<|close|>argument<|sep|>'
                         '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
    assert constraint.is_terminated() and not constraint.error


def test_k2_grammars(k2):
    grammars = K2Grammars(k2)
    factory = ConstraintFactory(k2, grammars.tool_calls(TOOLS[:1], thinking=False, multiple=False))
    feed(factory(), k2, '<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0'
                        '<|tool_call_argument_begin|>{"query": "q", "exact": false}<|tool_call_end|>'
                        '<|tool_calls_section_end|><|im_end|>')
    for seed in range(2):
        ids = random_walk(factory(), k2, random.Random(seed))
        parser = K2OutputParser(tools=TOOLS)
        parser.feed(k2.decode(ids))
        [call] = parser.finish().tool_calls
        assert call.name == "lookup"
    ids = random_walk(ConstraintFactory(k2, grammars.response(PERSON, thinking=False, think_tokens=5))(), k2,
                      random.Random(0))
    parser = K2OutputParser()
    parser.feed(k2.decode(ids))
    assert schema_error(json.loads(parser.finish().content), PERSON) is None
    no_think = ConstraintFactory(k2, grammars.response(PERSON, thinking=False))()
    assert k2.special_token_id("<think>") not in allowed(no_think, k2)


def test_invalid_schema_is_refused_up_front(k3):
    with pytest.raises(ValueError, match="bogus"):
        ConstraintFactory(k3, json_grammar({"type": "bogus"}))
    with pytest.raises(ValueError):
        ConstraintFactory(k3, K3Grammars(k3).response({"type": "object", "properties": {"a": {"type": 5}}},
                                                      thinking=True))


def test_mask_is_as_wide_as_a_padded_model_vocabulary(k3):
    padded = k3.vocab_size + 100
    constraint = ConstraintFactory(k3, json_grammar({"type": "object"}), vocab_size=padded)()
    mask = constraint.allowed_token_bitmask()
    assert mask.shape == ((padded + 31) // 32,)
    assert max(allowed_ids(mask, padded)) < k3.vocab_size
    with pytest.raises(ValueError, match="smaller"):
        ConstraintFactory(k3, json_grammar({"type": "object"}), vocab_size=k3.vocab_size - 1)
