"""K2-format (Kimi-Linear) output parser on hand-written completions, in every chunking."""

import json

import pytest

from kimi_jax.chat import K2OutputParser, ToolCallDelta

from .chat_stream_helpers import parse_in_all_chunkings, stream

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}]
CALL = '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "北京"}<|tool_call_end|>'
SECTION = f"<|tool_calls_section_begin|>{CALL}<|tool_calls_section_end|>"


def parse(text, tools=TOOLS):
    return parse_in_all_chunkings(lambda: K2OutputParser(tools=tools), text)


def test_plain_content_and_leading_think():
    message = parse("It's sunny <b>today</b>.<|im_end|>")
    assert (message.reasoning_content, message.content) == ("", "It's sunny <b>today</b>.")
    message = parse("\n<think>Check the sky.</think>Sunny.<|im_end|>")
    assert (message.reasoning_content, message.content) == ("Check the sky.", "Sunny.")
    assert parse("  text with <think> inside").content == "  text with <think> inside"


def test_without_reasoning_split_the_think_text_is_content():
    message = parse_in_all_chunkings(lambda: K2OutputParser(split_reasoning=False),
                                     "\n<think>Check the sky.</think>Sunny.<|im_end|>")
    assert (message.reasoning_content, message.content) == ("", "Check the sky.Sunny.")


def test_tool_call_section():
    message = parse(f"Checking.{SECTION}<|im_end|>")
    assert message.content == "Checking."
    assert message.tool_calls == [ToolCallDelta(0, "functions.get_weather:0", "get_weather",
                                                json.dumps({"city": "北京"}, ensure_ascii=False))]


def test_two_calls_singular_section_spelling_and_no_section_end():
    second = CALL.replace(":0", ":1").replace("北京", "上海")
    message = parse(f"<|tool_call_section_begin|>{CALL}{second}")
    assert [(c.index, c.id, json.loads(c.arguments)["city"]) for c in message.tool_calls] == [
        (0, "functions.get_weather:0", "北京"), (1, "functions.get_weather:1", "上海")]


def test_call_counts_only_at_its_end_marker():
    deltas, _ = stream(lambda: K2OutputParser(tools=TOOLS), list(SECTION))
    assert [k for k, d in enumerate(deltas) if d.tool_calls] == [SECTION.index(CALL) + len(CALL) - 1]


BAD_CALLS = {
    "unknown tool": CALL.replace("get_weather", "rm_rf"),
    "invalid json": CALL.replace('{"city": "北京"}', '{"city": 北京'),
    "not an object": CALL.replace('{"city": "北京"}', '["北京"]'),
    "schema violation": CALL.replace('"city"', '"town"'),
    "NaN": CALL.replace('{"city": "北京"}', '{"city": "北京", "n": NaN}'),
    "no argument marker": CALL.replace("<|tool_call_argument_begin|>", " "),
}


@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_call_degrades_to_content(call):
    message = parse(f"Sure.<|tool_calls_section_begin|>{call}<|tool_calls_section_end|>")
    assert message.tool_calls == [] and message.content == "Sure." + call


def test_unterminated_call_is_kept_as_content():
    unfinished = CALL[:-len("<|tool_call_end|>")]
    assert parse(f"<|tool_calls_section_begin|>{unfinished}").content == unfinished
    message = parse(f"<|tool_calls_section_begin|>{unfinished}{CALL}<|tool_calls_section_end|>after")
    assert message.content == unfinished + "after" and len(message.tool_calls) == 1


def test_without_declared_tools_calls_are_accepted_unchecked():
    assert [c.name for c in parse(SECTION.replace("get_weather", "anything"), tools=None).tool_calls] == ["anything"]
