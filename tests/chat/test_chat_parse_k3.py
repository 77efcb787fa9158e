"""K3 XTML output parser on hand-written completions, fed whole, split at every position, and char by char."""

import json
import random

import pytest

from kimi_jax.chat import K3OutputParser, ToolCallDelta

from .chat_stream_helpers import parse_in_all_chunkings, stream

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                       "unit": {"type": "string", "enum": ["C", "F"]}}}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}},
                                         "env": {"type": "object"}, "note": {"type": ["string", "null"]}}}}},
]
WEATHER_CALL = ('<|open|>call tool="get_weather" index="1"<|sep|>'
                '<|open|>argument key="city" type="string"<|sep|>Paris <b>&</b><|close|>argument<|sep|>'
                '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>')
END = "<|close|>message<|sep|><|end_of_msg|>"


def parse(text, *, thinking=True, tools=TOOLS):
    return parse_in_all_chunkings(lambda: K3OutputParser(thinking=thinking, tools=tools), text)


def test_reasoning_then_response():
    message = parse("Let me think.\n<|close|>think<|sep|><|open|>response<|sep|>Hello, **world**!"
                    "<|close|>response<|sep|>" + END)
    assert (message.reasoning_content, message.content, message.tool_calls) == ("Let me think.\n", "Hello, **world**!",
                                                                                [])


def test_thinking_off_starts_in_response():
    message = parse("Plain answer <|close|>response<|sep|>" + END, thinking=False)
    assert (message.reasoning_content, message.content) == ("", "Plain answer ")


def test_tool_call_in_tools_channel():
    text = ("Need weather.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
            f"<|open|>tools<|sep|>{WEATHER_CALL}<|close|>tools<|sep|>" + END)
    message = parse(text)
    assert message.reasoning_content == "Need weather." and message.content == ""
    assert message.tool_calls == [ToolCallDelta(0, "functions.get_weather:1", "get_weather",
                                                json.dumps({"city": "Paris <b>&</b>", "days": 3}))]


def test_typed_arguments_and_several_calls():
    second = ('<|open|>call tool="run" index="2"<|sep|>'
              '<|open|>argument key="flags" type="array"<|sep|>[true, false]<|close|>argument<|sep|>'
              '<|open|>argument key="env" type="object"<|sep|>{"A": {"b": null}}<|close|>argument<|sep|>'
              '<|open|>argument key="note" type="null"<|sep|>null<|close|>argument<|sep|><|close|>call<|sep|>')
    json_block = ('<|open|>call tool="run" index="3"<|sep|><|open|>json type="object"<|sep|>{"flags": [true]}'
                  "<|close|>json<|sep|><|close|>call<|sep|>")
    message = parse(f"<|close|>think<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|><|open|>tools<|sep|>"
                    f"{WEATHER_CALL}{second}{json_block}<|close|>tools<|sep|>")
    assert message.content == "On it."
    assert [(c.index, c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        (0, "get_weather", {"city": "Paris <b>&</b>", "days": 3}),
        (1, "run", {"flags": [True, False], "env": {"A": {"b": None}}, "note": None}),
        (2, "run", {"flags": [True]})]


def test_call_is_emitted_only_when_its_close_marker_arrives():
    text = f"r<|close|>think<|sep|><|open|>tools<|sep|>{WEATHER_CALL}<|close|>tools<|sep|>"
    deltas, _ = stream(lambda: K3OutputParser(thinking=True, tools=TOOLS), list(text))
    steps = [k for k, d in enumerate(deltas) if d.tool_calls]
    assert steps == [text.index(WEATHER_CALL) + len(WEATHER_CALL) - 1]


def test_missing_think_close_before_response_or_call():
    message = parse("thinking<|open|>response<|sep|>Answer<|close|>response<|sep|>")
    assert (message.reasoning_content, message.content) == ("thinking", "Answer")
    message = parse(f"thinking then calling{WEATHER_CALL}" + END)  # vLLM #53246: no transition marker
    assert message.reasoning_content == "thinking then calling"
    assert [c.name for c in message.tool_calls] == ["get_weather"]


def test_missing_closing_markers_keep_text():
    message = parse("r<|close|>think<|sep|><|open|>response<|sep|>cut off mid-sent")
    assert (message.reasoning_content, message.content) == ("r", "cut off mid-sent")
    assert parse("only reasoning, truncated").reasoning_content == "only reasoning, truncated"
    unfinished = WEATHER_CALL[:-len("<|close|>call<|sep|>")]
    message = parse(f"r<|close|>think<|sep|><|open|>tools<|sep|>{unfinished}")
    assert message.tool_calls == [] and message.content == unfinished
    message = parse(f"r<|close|>think<|sep|><|open|>tools<|sep|>{unfinished}<|close|>tools<|sep|>" + END)
    assert message.tool_calls == [] and message.content == unfinished
    message = parse(f"r<|close|>think<|sep|><|open|>tools<|sep|>{unfinished}{WEATHER_CALL}")
    assert message.content == unfinished and len(message.tool_calls) == 1


BAD_CALLS = {
    "unknown tool": WEATHER_CALL.replace("get_weather", "launch_rockets"),
    "invalid number": WEATHER_CALL.replace('type="number"<|sep|>3', 'type="number"<|sep|>three'),
    "boolean typed as number": WEATHER_CALL.replace('type="number"<|sep|>3', 'type="number"<|sep|>true'),
    "number beyond a double": WEATHER_CALL.replace('type="number"<|sep|>3', 'type="number"<|sep|>1e999'),
    "NaN": WEATHER_CALL.replace('type="number"<|sep|>3', 'type="number"<|sep|>NaN'),
    "unknown type": WEATHER_CALL.replace('type="number"', 'type="decimal"'),
    "schema: wrong type": WEATHER_CALL.replace('type="number"<|sep|>3', 'type="string"<|sep|>3'),
    "schema: missing required": WEATHER_CALL.replace("city", "town"),
    "schema: enum": WEATHER_CALL.replace('key="days" type="number"<|sep|>3', 'key="unit" type="string"<|sep|>K'),
    "stray text in call": WEATHER_CALL.replace("<|close|>call", "oops<|close|>call"),
    "unclosed argument": WEATHER_CALL.replace("3<|close|>argument<|sep|>", "3"),
    "invalid json block": '<|open|>call tool="run"<|sep|><|open|>json type="object"<|sep|>{"flags": [tru'
                          "<|close|>json<|sep|><|close|>call<|sep|>",
    "no tool attribute": WEATHER_CALL.replace('tool="get_weather" ', ""),
}


@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_call_degrades_to_content_with_raw_text(call):
    message = parse(f"r<|close|>think<|sep|><|open|>response<|sep|>Sure.<|close|>response<|sep|>"
                    f"<|open|>tools<|sep|>{call}<|close|>tools<|sep|>" + END)
    assert message.tool_calls == [] and message.content == "Sure." + call


def test_without_reasoning_split_the_think_text_is_content():
    text = ("Let me think.<|close|>think<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|>"
            f"<|open|>tools<|sep|>{WEATHER_CALL}<|close|>tools<|sep|>" + END)
    message = parse_in_all_chunkings(lambda: K3OutputParser(thinking=True, tools=TOOLS, split_reasoning=False), text)
    assert (message.reasoning_content, message.content) == ("", "Let me think.Hello!")
    assert [c.name for c in message.tool_calls] == ["get_weather"]
    message = parse_in_all_chunkings(lambda: K3OutputParser(thinking=True, split_reasoning=False), "never closes")
    assert (message.reasoning_content, message.content) == ("", "never closes")


def test_constrained_output_cut_off_drops_its_partial_marker_and_unfinished_call():
    """Under a grammar a cut-off tail is structure, not text; unconstrained it is kept."""
    cut_header = "r<|close|>think<|sep|><|open|>resp"
    unfinished = WEATHER_CALL[:-len("<|close|>call<|sep|>")]
    cut_call = f"r<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>{unfinished}"
    for text, kept in ((cut_header, "<|open|>resp"), (cut_call, unfinished)):
        constrained = parse_in_all_chunkings(lambda: K3OutputParser(thinking=True, tools=TOOLS, constrained=True), text)
        assert (constrained.reasoning_content, constrained.content, constrained.tool_calls) == ("r", "", [])
        assert parse(text).content == kept


def test_without_declared_tools_calls_are_accepted_unchecked():
    call = WEATHER_CALL.replace("get_weather", "anything")
    message = parse(f"<|close|>think<|sep|><|open|>tools<|sep|>{call}", tools=None)
    assert [c.name for c in message.tool_calls] == ["anything"]


def test_marker_lookalikes_are_plain_text():
    text = 'a <b> c <|x|> <|open d <|open|>unknown attr="1"<|sep|> <|close|>nope<|sep|> <|sep|> [EOS] <|op'
    message = parse(text, thinking=False)
    assert message.content == text
    message = parse("<|open|>think<|sep|>dup opener<|close|>think<|sep|>")
    assert message.reasoning_content == "dup opener"


def test_long_unterminated_tag_is_released_as_text():
    text = "<|open|>call tool=\"" + "x" * 600
    parser = K3OutputParser(thinking=False)
    assert parser.feed(text).content == text


MARKER_PIECES = ["<|open|>think<|sep|>", "<|close|>think<|sep|>", "<|open|>response<|sep|>",
                 "<|close|>response<|sep|>", "<|open|>tools<|sep|>", "<|close|>tools<|sep|>",
                 '<|open|>call tool="get_weather" index="1"<|sep|>', "<|close|>call<|sep|>",
                 '<|open|>argument key="city" type="string"<|sep|>', "<|close|>argument<|sep|>",
                 '<|open|>json type="object"<|sep|>', "<|close|>json<|sep|>", "<|close|>message<|sep|>",
                 "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|", "<", " ", "\n"]


@pytest.mark.parametrize("seed", range(12))
def test_random_marker_soup_never_loses_words(seed):
    """Words of the form wNx (never part of a marker) all survive in reasoning + content when no call is valid."""
    rng = random.Random(seed)
    pieces = [rng.choice(MARKER_PIECES) if rng.random() < 0.6 else f"w{k}x" for k in range(40)]
    message = parse("".join(pieces), thinking=bool(seed % 2), tools=[])
    survived = message.reasoning_content + message.content
    assert [p for p in pieces if p.startswith("w") and p not in survived] == []
