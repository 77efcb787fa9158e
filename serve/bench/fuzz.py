"""Schema-driven fuzzing of a running server: ``python -m serve.bench.fuzz --url URL --requests N``.

Each request is a chat or completions body whose every field is drawn at random: a valid value, a value of the
wrong type, out of range, an odd size (empty, huge), unicode (astral, controls, lone-surrogate escapes, special
token names) or deep nesting. Only the server's answer class is judged: any status >= 500, or no answer within
``--timeout`` seconds, is a failure. After the run the server must still answer /health and give the same
greedy completion as before it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time

import httpx

STRINGS = ["", "hi", "é中\U0001f600", "\x00\x1f\u202e", "<|im_end|>", "<|open|>", "<|close|>", "a" * 5000,
           "\\ud800", " " * 50, "\n\t"]
NUMBERS = [0, 1, -1, 2, 16, 0.5, 1e308, -1e308, 2**63, -(2**63) - 1, 3.7, True]


def _junk(rng: random.Random, depth: int = 0):
    """A value of any JSON type (nested up to a few levels, now and then very deep)."""
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(STRINGS)
    if kind == 1:
        return rng.choice(NUMBERS)
    if kind == 2:
        return rng.choice([None, False, True])
    if kind == 3 and rng.random() < 0.05:
        return json.loads("[" * 200 + "]" * 200)
    if kind in (3, 4):
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["role", "content", "type", "x", "text"]): _junk(rng, depth + 1) for _ in range(3)}


def _pick(rng: random.Random, valid: list):
    """Mostly one of the valid values, else junk."""
    return rng.choice(valid) if rng.random() < 0.7 else _junk(rng)


def _message(rng: random.Random) -> dict:
    role = _pick(rng, ["system", "user", "assistant", "tool", "developer"])
    msg = {"role": role, "content": _pick(rng, STRINGS + [[{"type": "text", "text": rng.choice(STRINGS)}], None])}
    if rng.random() < 0.2:
        msg["tool_calls"] = _pick(rng, [[{"id": "c", "type": "function", "function": {
            "name": _pick(rng, ["f", "bad name", ""]), "arguments": _pick(rng, ["{}", "{", '{"a": 1}'])}}]])
    if rng.random() < 0.2:
        msg["reasoning_content"] = _pick(rng, STRINGS)
    if rng.random() < 0.2:
        msg["tool_call_id"] = _pick(rng, ["c", ""])
    return msg


def _common(rng: random.Random) -> dict:
    fields = {
        "n": lambda: _pick(rng, [1, 2, 0, 200]), "max_tokens": lambda: _pick(rng, [1, 4, 16, 0, 10**9]),
        "temperature": lambda: _pick(rng, [0, 0.7, 2.0, -1]), "top_p": lambda: _pick(rng, [1.0, 0.5, 0, 1.5]),
        "top_k": lambda: _pick(rng, [-1, 5, 0, -5]), "min_p": lambda: _pick(rng, [0.0, 0.1, 2.0]),
        "presence_penalty": lambda: _pick(rng, [0, 1.5, 3]), "frequency_penalty": lambda: _pick(rng, [0, -2, 9]),
        "repetition_penalty": lambda: _pick(rng, [1.0, 1.2, 0]), "seed": lambda: _pick(rng, [0, 7, 2**70]),
        "stop": lambda: _pick(rng, ["\n", ["a", "b"], [], [""], "x" * 300]),
        "stop_token_ids": lambda: _pick(rng, [[], [0], [10**9], [-1]]),
        "stream": lambda: _pick(rng, [True, False]), "ignore_eos": lambda: _pick(rng, [True, False]),
        "stream_options": lambda: _pick(rng, [{"include_usage": True}, {"continuous_usage_stats": True}]),
        "response_format": lambda: _pick(rng, [{"type": "json_object"}, {"type": "text"}, {"type": "json_schema",
                                               "json_schema": {"name": "r", "schema": {"type": "object"}}}]),
        "timeout": lambda: _pick(rng, [5, 0.01, 0, -1]), "user": lambda: _pick(rng, STRINGS),
        "skip_special_tokens": lambda: _pick(rng, [True, False]), "model": lambda: _pick(rng, [None, "nope"]),
    }
    chosen = rng.sample(sorted(fields), rng.randrange(len(fields) // 2))
    body = {name: fields[name]() for name in chosen}
    if isinstance(body.get("max_tokens"), int) and 16 < body["max_tokens"] < 10**6:
        body["max_tokens"] = 16  # bounded work per request
    body.setdefault("max_tokens", 8)
    return {k: v for k, v in body.items() if not (k == "model" and v is None)}


def random_request(rng: random.Random) -> tuple[str, dict | str]:
    """(route, body) of one fuzzed request; a body may also be a raw string (malformed JSON)."""
    if rng.random() < 0.03:
        return "/v1/chat/completions", rng.choice(["{", "[]", "null", '{"messages": [' * 300, "\xff"])
    body = _common(rng)
    if rng.random() < 0.5:
        body["prompt"] = _pick(rng, ["hi", ["a", "b"], [1, 2, 3], [[1], [2]], [10**9], [], ""])
        body["echo"] = _pick(rng, [False, True])
        body["logprobs"] = _pick(rng, [None, 0, 3, 100])
        return "/v1/completions", body
    body["messages"] = _pick(rng, [[_message(rng) for _ in range(rng.randrange(1, 5))], []])
    if rng.random() < 0.3:
        body["tools"] = _pick(rng, [[{"type": "function", "function": {"name": "f", "parameters": _pick(
            rng, [{"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}}}])}}]])
        body["tool_choice"] = _pick(rng, ["none", "auto", "required", {"type": "function",
                                                                         "function": {"name": "f"}}])
    if rng.random() < 0.2:
        body["logprobs"], body["top_logprobs"] = _pick(rng, [True, False]), _pick(rng, [0, 2, 50])
    return "/v1/chat/completions", body


async def _send(client: httpx.AsyncClient, route: str, body, timeout_s: float) -> int | str:
    """The status, or "hang" when no complete answer came within the timeout."""
    content = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else json.dumps(body).encode()
    try:
        async with asyncio.timeout(timeout_s):
            r = await client.post(route, content=content, headers={"Content-Type": "application/json"})
            return r.status_code
    except TimeoutError:
        return "hang"


async def _greedy(client: httpx.AsyncClient) -> str:
    r = await client.post("/v1/completions", json={"prompt": "The capital", "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def fuzz(url: str, *, requests: int, concurrency: int = 16, timeout_s: float = 60.0, seed: int = 0) -> dict:
    """Send ``requests`` fuzzed requests; returns counts by status and the failure checks."""
    rng = random.Random(seed)
    cases = [random_request(rng) for _ in range(requests)]
    statuses: collections.Counter = collections.Counter()
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        before = await _greedy(client)
        gate = asyncio.Semaphore(concurrency)

        async def one(route, body):
            async with gate:
                statuses[await _send(client, route, body, timeout_s)] += 1

        start = time.perf_counter()
        await asyncio.gather(*(one(route, body) for route, body in cases))
        elapsed = time.perf_counter() - start
        alive = (await client.get("/health")).status_code == 200
        same = alive and await _greedy(client) == before
    server_errors = sum(c for s, c in statuses.items() if isinstance(s, int) and s >= 500)
    return {"requests": requests, "seconds": round(elapsed, 1), "statuses": {str(k): v for k, v in
            sorted(statuses.items(), key=str)}, "server_errors": server_errors, "hangs": statuses["hang"],
            "alive_after": alive, "greedy_unchanged": same}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve.bench.fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a request counts as a hang")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    report = asyncio.run(fuzz(args.url, requests=args.requests, concurrency=args.concurrency,
                              timeout_s=args.timeout, seed=args.seed))
    print(json.dumps(report, indent=1))
    ok = not report["server_errors"] and not report["hangs"] and report["greedy_unchanged"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
