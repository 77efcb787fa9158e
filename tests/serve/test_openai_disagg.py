"""`kimi-jax serve --role prefill|decode|proxy` as three processes on one machine (the tiny K3 checkpoint):
* greedy answers through the proxy equal one engine's, and the decode replica resumed from pulled entries;
* a decode replica killed mid-stream gives the client an in-band error and `[DONE]` (never a hang), and the
  prefill replica holds no blocks and no staged export afterwards."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from serve.openai.cli_args import add_serve_args
from serve.openai.disagg_args import check_disagg_args
from tests.sharding_cases import K3_TINY, ROOT, subprocess_env, write_checkpoint

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens",
                "64", "--block-size", "16"]
PROMPTS = [[5, 17, 300, 42, 7, 99, 1000, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3000, 12, 12, 12]]
MAX_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"a server exited with {proc.returncode}:\n{proc.stdout.read()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise AssertionError("the server did not start in time")
        time.sleep(1)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """(proxy, prefill, decode) base URLs and the decode replica's process."""
    checkpoint = write_checkpoint(K3_TINY, tmp_path_factory.mktemp("k3_tiny"))
    ports = [_free_port() for _ in range(3)]
    prefill, decode, proxy = (f"http://127.0.0.1:{p}" for p in ports)
    roles = [["--role", "prefill"], ["--role", "decode", "--kv-transfer-config", json.dumps({"peers": [prefill]})],
             ["--role", "proxy", "--prefill", prefill, "--decode", decode]]
    procs = []
    try:
        for port, flags in zip(ports, roles):
            cmd = [sys.executable, "-m", "serve.cli", "serve", str(checkpoint), "--served-model-name", "m",
                   "--host", "127.0.0.1", "--port", str(port), *ENGINE_FLAGS, *flags]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(1), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        for proc, url in zip(procs, (prefill, decode, proxy)):
            _wait_healthy(proc, url)
        yield proxy, prefill, decode, procs[1]
    finally:
        for p in procs:  # only the processes started here
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _complete(url: str, prompt: list[int], **extra) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=300)


def _metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_proxied_answers_equal_one_engine(replicas):
    proxy, prefill, decode, _ = replicas
    want = [_complete(prefill, p).json()["choices"][0]["text"] for p in PROMPTS]  # no headers: a plain engine
    got = []
    for p in PROMPTS:
        answer = _complete(proxy, p)
        assert answer.status_code == 200, answer.text
        got.append(answer.json()["choices"][0]["text"])
    assert got == want
    assert _metric(decode, "kimi_jax:kv_transfer_pulls_total", result="ok") == len(PROMPTS)
    assert _metric(decode, "kimi_jax:prefix_cache_hits_by_tier_total", tier="remote") == sum(
        len(p) - 1 for p in PROMPTS)
    bad = httpx.post(proxy + "/v1/completions", content=b"{", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_killed_decode_replica_gives_an_error_and_frees_the_prefill_side(replicas):
    proxy, prefill, _, decode_proc = replicas
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.stream("POST", proxy + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 1:
                decode_proc.send_signal(signal.SIGKILL)
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2]), events[-2]
    assert len(events) < 200
    deadline = time.monotonic() + 30
    while (_metric(prefill, "vllm:kv_cache_usage_perc") or _metric(prefill, "kimi_jax:kv_transfers_pending")
           or _metric(prefill, "vllm:num_requests_running")):
        assert time.monotonic() < deadline, "the prefill replica still holds the request's blocks"
        time.sleep(0.5)


@pytest.mark.parametrize("flags,field", [
    (["--cpu-offload-gb", "-1"], "--cpu-offload-gb"),
    (["--role", "proxy", "--prefill", "http://a:1"], "--role proxy"),
    (["--role", "proxy", "--prefill", "ftp://a", "--decode", "http://b:2"], "--prefill"),
    (["--role", "decode"], "--role decode"),
    (["--role", "decode", "--kv-transfer-config", "{"], "--kv-transfer-config"),
    (["--role", "decode", "--kv-transfer-config", '{"peers": ["http://a:1"], "timeout_s": 0}'], "timeout_s"),
    (["--role", "prefill", "--kv-transfer-config", '{"hosts": []}'], "unknown field"),
    (["--decode", "http://b:2"], "--role proxy"),
])
def test_bad_disagg_flags_name_the_flag(flags, field):
    args = add_serve_args(argparse.ArgumentParser()).parse_args(flags)
    with pytest.raises(ValueError, match=re.escape(field)):
        check_disagg_args(args)
