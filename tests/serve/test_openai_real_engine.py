"""The OpenAI server over the REAL engine and the shipped tiny model, driven by the real `openai` client.

The fake-engine suites (test_openai_server.py, test_openai_errors.py) cover the protocol corner by corner;
this module checks that the pieces compose: tokenizer + K3 renderer + engine + llguidance masks on device +
parsers + SSE + metrics, and that an aborted stream gives its cache back."""

import json
import threading
import time

import httpx
import pytest
from openai import OpenAI

from serve.engine.async_engine import AsyncEngine
from serve.engine.engine import LLMEngine
from serve.openai.app import build_app
from serve.openai.background import serve_in_thread
from serve.openai.config import ServerConfig


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(LLMEngine.from_pretrained("tiny", dtype="float32", max_model_len=512, max_num_seqs=8,
                                                max_num_batched_tokens=128))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def base_url(engine):
    app = build_app(engine, ServerConfig(served_model_names=("tiny",), model_root="tiny", chat_format="k3",
                                         enable_auto_tool_choice=True))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


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
    bad = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    long = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "x " * 2000, "max_tokens": 4})
    assert long.status_code == 400
    ok = client.completions.create(model="tiny", prompt="y = 2\n", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2
