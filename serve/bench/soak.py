"""`kimi-jax bench soak`: many concurrent greedy streams against a running server, some cut off at random.

Each round opens ``--streams`` concurrent streaming completions (greedy, random prompts from a fixed set); a
``--disconnect`` fraction of them is dropped after a random number of chunks (the client closes the
connection). Every stream that completes must equal its prompt's solo greedy output, token for token (nothing
lost, nothing duplicated). After each round the server must be idle again (no running or waiting requests in
/metrics); with ``--server-pid`` the server's resident memory is recorded per round, so growth shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time

import httpx

PROMPTS = [f"Story {i}: once upon a time" + " and then" * (i % 7) for i in range(24)]


def add_soak_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=200, help="concurrent streams per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=60.0, help="seconds per round (streams are re-opened)")
    p.add_argument("--disconnect", type=float, default=0.2, help="fraction of streams cut off mid-way")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--server-pid", type=int, default=None, help="record this process's resident memory")
    p.add_argument("--seed", type=int, default=0)
    return p


def _body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


def _rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, cut_after: int | None) -> str | None:
    """The streamed text, or None when this stream was cut off on purpose after ``cut_after`` chunks."""
    text, chunks = [], 0
    async with client.stream("POST", "/v1/completions", json=_body(prompt, max_tokens, True)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"in-band error: {event['error']}")
            text.append(event["choices"][0]["text"])
            chunks += 1
            if cut_after is not None and chunks >= cut_after:
                return None
    return "".join(text)


async def _idle(client: httpx.AsyncClient, timeout_s: float = 30.0) -> dict:
    """Wait until /metrics shows no running or waiting request; its engine gauges."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = (await client.get("/metrics")).text
        gauges = {name: float(v) for name, v in re.findall(r"^vllm:(num_requests_\w+|kv_cache_usage_perc)\{[^}]*\} "
                                                           r"(\S+)$", text, re.M)}
        if not gauges.get("num_requests_running") and not gauges.get("num_requests_waiting"):
            return gauges
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not idle after the round: {gauges}")
        await asyncio.sleep(0.2)


async def soak(url: str, *, streams: int, rounds: int, duration_s: float, disconnect: float, max_tokens: int,
               server_pid: int | None = None, seed: int = 0) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        solo = {}
        for prompt in PROMPTS:
            r = await client.post("/v1/completions", json=_body(prompt, max_tokens, False))
            r.raise_for_status()
            solo[prompt] = r.json()["choices"][0]["text"]
        report = {"completed": 0, "mismatched": 0, "cut_off": 0, "errors": 0, "rounds": []}

        async def worker(stop_at: float) -> None:
            while time.monotonic() < stop_at:
                prompt = rng.choice(PROMPTS)
                cut = rng.randrange(1, max_tokens) if rng.random() < disconnect else None
                try:
                    text = await _stream(client, prompt, max_tokens, cut)
                except (httpx.HTTPError, RuntimeError):
                    report["errors"] += 1
                    continue
                if text is None:
                    report["cut_off"] += 1
                else:
                    report["completed"] += 1
                    report["mismatched"] += text != solo[prompt]

        for _ in range(rounds):
            start = time.monotonic()
            await asyncio.gather(*(worker(start + duration_s) for _ in range(streams)))
            gauges = await _idle(client)
            report["rounds"].append({"seconds": round(time.monotonic() - start, 1), "rss_mib": _rss_mib(server_pid),
                                     "kv_cache_usage": gauges.get("kv_cache_usage_perc")})
    return report


def main(args: argparse.Namespace) -> int:
    report = asyncio.run(soak(args.url, streams=args.streams, rounds=args.rounds, duration_s=args.duration,
                              disconnect=args.disconnect, max_tokens=args.max_tokens, server_pid=args.server_pid,
                              seed=args.seed))
    print(json.dumps(report, indent=1))
    return 0 if not report["mismatched"] and not report["errors"] else 1
