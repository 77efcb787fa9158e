"""The OpenAI server over the REAL engine and the shipped tiny model, driven by the real `openai` client.

The fake-engine suites (test_openai_server.py, test_openai_errors.py) cover the protocol corner by corner;
this module checks that the pieces compose: tokenizer + K3 renderer + engine + llguidance masks on device +
parsers + SSE + metrics, and that an aborted stream gives its cache back.

It is also issue 37's evidence, taken as a new user would (server defaults: thinking on, no reasoning parser):
chat and streaming chat answer in `content`; json_schema / json_object replies parse and validate for several
schemas; required and named tool choice always return a parsed, schema-valid call; deep bodies are a 400. It serves
the code-only `tiny-code` checkpoint (served as "tiny"; trained on Python code, never on chat), which never closes
its think channel and never picks `<|close|>` by itself, so these pass only because the grammar bounds the whole turn."""

import json
import threading
import time

import httpx
import llguidance
import pytest
from openai import OpenAI

from kimi_jax.chat import schema_error
from serve.engine.async_engine import AsyncEngine
from serve.engine.engine import LLMEngine
from serve.openai.app import build_app
from serve.openai.background import serve_in_thread
from serve.openai.config import ServerConfig
from serve.openai.constraints import guidance_tokenizer
from serve.openai.grammars import json_grammar


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(LLMEngine.from_pretrained("tiny-code", dtype="float32", max_model_len=512, max_num_seqs=8,
                                                max_num_batched_tokens=128))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def base_url(engine):
    app = build_app(engine, ServerConfig(served_model_names=("tiny",), model_root="tiny-code", chat_format="k3",
                                         enable_auto_tool_choice=True))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reasoning_client(engine):
    """The same engine behind a server started with --reasoning-parser kimi_k3."""
    app = build_app(engine, ServerConfig(served_model_names=("tiny",), model_root="tiny-code", chat_format="k3",
                                         split_reasoning=True))
    with serve_in_thread(app) as url:
        yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _wait_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def test_completion_greedy_is_deterministic_and_counts_usage(client):
    a = client.completions.create(model="tiny", prompt="import os\nimport", max_tokens=12, temperature=0)
    b = client.completions.create(model="tiny", prompt="import os\nimport", max_tokens=12, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text.strip()
    assert a.usage.completion_tokens == 12 and a.usage.prompt_tokens > 0


def test_streaming_chat_with_usage_and_seeded_sampling(client):
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.8, seed=7,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 8
    text = "".join((c.choices[0].delta.content or "") + (getattr(c.choices[0].delta, "reasoning_content", "") or "")
                   for c in chunks if c.choices)
    again = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.8, seed=7)
    m = again.choices[0].message
    assert (m.content or "") + (getattr(m, "reasoning_content", "") or "") == text


def test_n_stop_and_logprobs(client):
    r = client.completions.create(model="tiny", prompt="def f(x):\n", max_tokens=10, n=2, temperature=1.0, seed=3,
                                  logprobs=2, stop=["\n\n"])
    assert len(r.choices) == 2
    for c in r.choices:
        assert "\n\n" not in c.text
        assert len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) and all(len(t) <= 2 for t in c.logprobs.top_logprobs)


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
              "required": ["name", "size"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Describe a file as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}},
        extra_body={"chat_template_kwargs": {"thinking": False}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "size"} and isinstance(value["size"], int)


def test_tool_call_round_trip(client):
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
              "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}},
                                                    "required": ["path"]}}}]
    msgs = [{"role": "user", "content": "Open setup.py"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=80, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "read_file"}},
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "read_file" and isinstance(json.loads(call.function.arguments)["path"], str)
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "print('hello')"}]
    final = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=8, temperature=0,
                                           tool_choice="none")
    assert final.choices[0].finish_reason in ("stop", "length")


def test_concurrent_clients_and_disconnect_frees_cache(engine, client, base_url):
    results = []

    def one(i):
        results.append(client.completions.create(model="tiny", prompt=f"# file {i}\n", max_tokens=6, temperature=0))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    with httpx.stream("POST", base_url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "class A:\n", "max_tokens": 400, "stream": True,
                            "ignore_eos": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk: the server must abort the request
    stats = _wait_idle(engine)
    assert stats.num_running == 0 and stats.num_waiting == 0
    deadline = time.monotonic() + 10
    while not engine.engine.is_idle():  # pages and slots of the aborted stream returned (cache may keep prefixes)
        assert time.monotonic() < deadline, "aborted request still holds cache pages or state slots"
        time.sleep(0.05)


def test_metrics_move_and_bad_input_is_a_400(client, base_url):
    before = httpx.get(base_url + "/metrics").text
    client.completions.create(model="tiny", prompt="x = 1\n", max_tokens=3, temperature=0)
    after = httpx.get(base_url + "/metrics").text

    def value(text, name):
        lines = [l for l in text.splitlines() if l.startswith(name + " ") or l.startswith(name + "{")]
        return sum(float(l.rsplit(" ", 1)[1]) for l in lines)

    assert value(after, "vllm:generation_tokens_total") >= value(before, "vllm:generation_tokens_total") + 3
    assert 'kimi_jax:compiles_after_warm_up{model_name="tiny"}' in after  # the no-recompilation check
    bad = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    long = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "x " * 2000, "max_tokens": 4})
    assert long.status_code == 400
    ok = client.completions.create(model="tiny", prompt="y = 2\n", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


# ---------------------------------------------------------------- issue 37: first contact, server defaults

USER = [{"role": "user", "content": "Describe the file setup.py."}]
SCHEMAS = {
    "required_fields": {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
                        "required": ["name", "size"], "additionalProperties": False},
    "nested_objects": {"type": "object", "required": ["file", "ok"], "additionalProperties": False, "properties": {
        "file": {"type": "object", "required": ["path", "lines"], "additionalProperties": False,
                 "properties": {"path": {"type": "string"}, "lines": {"type": "integer"},
                                "owner": {"type": "object", "properties": {"uid": {"type": "integer"}}}}},
        "ok": {"type": "boolean"}}},
    "arrays_and_enums": {"type": "object", "required": ["tags", "level", "sizes"], "additionalProperties": False,
                         "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3},
                                        "level": {"enum": ["low", "mid", "high"]},
                                        "sizes": {"type": "array", "items": {"type": "number"}, "maxItems": 4}}},
    "open_object": {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]},
}


def _is_valid_prefix(text: str, schema: dict, tokenizer) -> bool:
    """Whether `text` can be continued into a JSON value matching `schema` (the compact form the server forces)."""
    matcher = llguidance.LLMatcher(guidance_tokenizer(tokenizer), json_grammar(schema), log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text)) and not matcher.is_error()


def test_chat_answers_in_content_without_a_reasoning_parser(client):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, seed=1)
    message = r.choices[0].message
    assert message.content and message.content.strip()
    assert getattr(message, "reasoning_content", None) is None
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, seed=1, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert sum(bool(d.content) for d in deltas) > 1
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == message.content


def test_with_a_reasoning_parser_the_think_channel_is_split_off(reasoning_client):
    message = reasoning_client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, seed=1,
                                                       ).choices[0].message
    assert message.reasoning_content.strip() and not message.content  # the tiny model never leaves think
    message = reasoning_client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=16, seed=1,
        extra_body={"chat_template_kwargs": {"thinking": False}}).choices[0].message
    assert message.content.strip() and getattr(message, "reasoning_content", None) is None  # never opened


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_replies_parse_and_validate(client, name):
    schema = SCHEMAS[name]
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=120, n=3, seed=5,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": name, "schema": schema}})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        assert schema_error(value, schema) is None, choice.message.content
        assert getattr(choice.message, "reasoning_content", None) is None
    if name == "arrays_and_enums":
        assert all(1 <= len(json.loads(c.message.content)["tags"]) <= 3 for c in r.choices)


def test_json_object_and_streamed_json_schema(client):
    # {"type": "object"} lets a model add keys or grow a string forever; the tiny model does at some seeds (then
    # finish_reason is "length" and the text a valid prefix, see below); these seeds end
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=120, n=2, seed=0,
                                       response_format={"type": "json_object"})
    for choice in r.choices:
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
    schema = SCHEMAS["nested_objects"]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=120, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert schema_error(json.loads(text), schema) is None
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_cut_by_max_tokens_is_a_valid_prefix(client, engine):
    schema = SCHEMAS["nested_objects"]
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=14, seed=5,  # 8 for the markup
                                       response_format={"type": "json_schema", "json_schema": {"name": "n",
                                                                                               "schema": schema}})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    assert _is_valid_prefix(choice.message.content, schema, engine.tokenizer)
    assert not _is_valid_prefix(choice.message.content + "]", schema, engine.tokenizer)  # the check can fail


def test_json_schema_with_a_reasoning_parser_thinks_then_answers(reasoning_client):
    schema = SCHEMAS["required_fields"]
    r = reasoning_client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=160, n=2, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        assert choice.message.reasoning_content.strip()  # it thought (up to half of max_tokens)...
        assert schema_error(json.loads(choice.message.content), schema) is None  # ...then answered


TOOLS = [  # short: with the thinking-effort and tool-choice messages the prompt takes ~400 of 512 tokens
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "required": ["path"],
        "properties": {"path": {"type": "string"}, "mode": {"enum": ["r", "rb"]}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "number"}, "b": {"type": "integer"}, "exact": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "required": ["tags"],
        "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
                       "note": {"type": ["string", "null"]}}}}},
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _assert_valid_calls(choice, names, finish_reasons=("tool_calls",)):
    calls = choice.message.tool_calls
    assert choice.finish_reason in finish_reasons and calls, choice.message.content
    for call in calls:
        assert call.function.name in names
        assert schema_error(json.loads(call.function.arguments), SCHEMA_OF[call.function.name]) is None


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_always_returns_a_valid_call(client, parallel):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Open setup.py"}],
                                       tools=TOOLS[:2], tool_choice="required", parallel_tool_calls=parallel,
                                       max_tokens=110, n=3, seed=11)
    for choice in r.choices:
        # the first call always fits in max_tokens; with parallel calls the model may start more and run out
        _assert_valid_calls(choice, {"read_file", "add"}, ("tool_calls", "length") if parallel else ("tool_calls",))
        assert parallel or len(choice.message.tool_calls) == 1
        assert not choice.message.content  # an unfinished further call is dropped, not shown as text


def test_named_tool_choice_always_returns_that_call(client, reasoning_client):
    named = {"type": "function", "function": {"name": "read_file"}}
    for each, tools, max_tokens, n in ((client, TOOLS[:2], 110, 3), (reasoning_client, TOOLS[:1], 160, 2)):
        r = each.chat.completions.create(model="tiny", messages=USER, tools=tools, max_tokens=max_tokens, n=n,
                                         seed=12, tool_choice=named)
        for choice in r.choices:
            _assert_valid_calls(choice, {"read_file"})
            assert len(choice.message.tool_calls) == 1


def test_named_tool_choice_streams_its_call(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS[2:], max_tokens=110, seed=14, stream=True,
        tool_choice={"type": "function", "function": {"name": "tag"}}))
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [t.function.name for t in calls] == ["tag"]
    arguments = json.loads(calls[0].function.arguments)
    assert schema_error(arguments, SCHEMA_OF["tag"]) is None and len(arguments["tags"]) <= 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("body", ["[" * 5000 + "]" * 5000,
                                  '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "x": '
                                  + '{"a": ' * 3000 + "1" + "}" * 3000 + "}"], ids=["5000_arrays", "3000_objects"])
def test_deep_nesting_is_a_400(base_url, body):
    r = httpx.post(base_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "json_too_deep"
    assert "Recursion" not in r.text
