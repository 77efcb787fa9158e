"""Bad input is answered with HTTP 400 and an OpenAI error body, and the server keeps serving."""

import httpx
import openai
import pytest

from kimi_jax.tokenizer import load_tokenizer
from serve.openai import ServerConfig, build_app
from serve.openai.app import MAX_JSON_DEPTH
from serve.openai.background import serve_in_thread
from tests.serve.fake_engine import FakeAsyncEngine

MODEL = "kimi-tiny"
MAX_MODEL_LEN = 256
USER = [{"role": "user", "content": "hi"}]


def nested_objects(depth: int) -> str:
    """A chat body whose `metadata` field nests objects so that the body is `depth` levels deep."""
    inner = depth - 1  # the body object is level 1
    return ('{"model": "kimi-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "metadata": '
            + '{"a": ' * inner + "1" + "}" * inner + "}")

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def url():
    engine = FakeAsyncEngine(load_tokenizer("tiny"), max_model_len=MAX_MODEL_LEN)
    with serve_in_thread(build_app(engine, ServerConfig((MODEL,), "tiny"))) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url) as client:  # one client: building one costs ~0.1 s (SSL context)
        yield client


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BAD_REQUESTS = {
    "malformed_json": (CHAT, '{"model": "kimi-tiny", "messages": [', None),
    "body_not_object": (CHAT, "[1, 2]", None),
    "max_tokens_wrong_type": (CHAT, {"messages": USER, "max_tokens": "ten"}, "max_tokens"),
    "temperature_wrong_type": (CHAT, {"messages": USER, "temperature": "hot"}, "temperature"),
    "messages_wrong_type": (CHAT, {"messages": "hi"}, "messages"),
    "n_as_string": (CHAT, {"messages": USER, "n": "2"}, "n"),
    "stop_wrong_type": (CHAT, {"messages": USER, "stop": 5}, "stop"),
    "content_wrong_type": (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    "negative_max_tokens": (CHAT, {"messages": USER, "max_tokens": -5}, "max_tokens"),
    "zero_max_tokens": (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    "huge_max_tokens": (CHAT, {"messages": USER, "max_tokens": 10**12}, "max_tokens"),
    "huge_max_completion_tokens": (CHAT, {"messages": USER, "max_completion_tokens": 10**6},
                                   "max_completion_tokens"),
    "prompt_over_max_model_len": (COMPLETIONS, {"prompt": "word " * (2 * MAX_MODEL_LEN)}, "prompt"),
    "chat_over_max_model_len": (CHAT, {"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]},
                                "messages"),
    "unknown_model": (CHAT, {"model": "gpt-9", "messages": USER}, "model"),
    "empty_messages": (CHAT, {"messages": []}, "messages"),
    "unknown_role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    "image_on_a_text_model": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages.0.content.0.image_url.url"),
    "unknown_part": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": "x"}]}]}, "messages.0.content.0"),
    "invalid_json_schema": (CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
    "schema_missing": (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}},
                       "response_format.json_schema"),
    "too_many_top_logprobs": (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    "top_logprobs_without_logprobs": (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    "temperature_negative": (COMPLETIONS, {"prompt": "x", "temperature": -1}, "temperature"),
    "top_p_zero": (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
    "empty_stop_string": (COMPLETIONS, {"prompt": "x", "stop": [""]}, "stop"),
    "empty_prompt_list": (COMPLETIONS, {"prompt": []}, "prompt"),
    "empty_prompt_text": (COMPLETIONS, {"prompt": ""}, "prompt"),
    "token_id_outside_vocab": (COMPLETIONS, {"prompt": [1, 2, 10**7]}, "prompt"),
    "auto_tool_choice_not_enabled": (CHAT, {"messages": USER, "tools": [TOOL]}, "tool_choice"),
    "named_tool_not_declared": (CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice"),
    "required_without_tools": (CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    "tool_result_without_call": (CHAT, {"messages": [{"role": "tool", "content": "42"}]}, "messages"),
    "bad_reasoning_effort": (CHAT, {"messages": USER, "reasoning_effort": "medium"}, "reasoning_effort"),
    "5000_nested_arrays": (CHAT, "[" * 5000 + "]" * 5000, None),
    "5000_nested_arrays_in_messages": (CHAT, '{"messages": ' + "[" * 5000 + "]" * 5000 + "}", None),
    "3000_nested_objects": (CHAT, nested_objects(3000), None),
    "3000_nested_objects_completion": (COMPLETIONS, '{"prompt": "x", "x": ' + '{"a": ' * 3000 + "1" + "}" * 3000 + "}",
                                       None),
    "just_too_deep": (CHAT, nested_objects(MAX_JSON_DEPTH + 1), None),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_input_is_a_400_with_an_openai_error_body(http, name):
    path, body, param = BAD_REQUESTS[name]
    if isinstance(body, dict):
        response = http.post(path, json={"model": MODEL, **body})
    else:
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


@pytest.mark.parametrize("name", [n for n in BAD_REQUESTS if "nested" in n or "deep" in n])
def test_deep_nesting_is_refused_before_parsing(http, name):
    path, body, _ = BAD_REQUESTS[name]
    error = http.post(path, content=body, headers={"content-type": "application/json"}).json()["error"]
    assert error["code"] == "json_too_deep" and str(MAX_JSON_DEPTH) in error["message"]
    assert "Recursion" not in error["message"]


def test_nesting_at_the_limit_is_served(http):
    response = http.post(CHAT, content=nested_objects(MAX_JSON_DEPTH), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


def test_server_keeps_serving_after_bad_input(url, http):
    for path, body, _ in BAD_REQUESTS.values():
        http.post(path, content=body if isinstance(body, str) else None,
                  json={"model": MODEL, **body} if isinstance(body, dict) else None)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3).usage.completion_tokens == 3
    assert http.get("/nope").json()["error"]["type"] == "not_found_error"


def test_null_fields_take_their_defaults(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": None}], "n": None,
            "temperature": None, "stop": None, "logprobs": None, "stream": None, "tools": None, "max_tokens": 2}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
