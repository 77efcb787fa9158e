"""``kimi-jax serve`` with parallelism flags, answering the real ``openai`` client end to end.

Each server is the CLI in a subprocess (fake CPU devices must be set before JAX starts) over a random tiny-K3
checkpoint folder with the shipped tokenizer: ``--tensor-parallel-size 2`` and ``--data-parallel-size 2`` on 8 fake
devices, and one replica over two processes of one device each started with ``jax.distributed`` (multi-host,
simulated on one machine: gloo collectives, host 0 serves HTTP and schedules, host 1 replays its launches). Greedy
answers must equal a one-device engine's on the same checkpoint (fp32). An impossible layout is refused at
start-up with the reason and the planner's suggested layouts.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from tests.sharding_cases import K3_TINY, ROOT, subprocess_env, write_checkpoint

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens",
                "128", "--block-size", "16"]
PROMPTS = [[5, 17, 300, 42, 7, 99, 1000], [3000, 12, 12, 12]]
CHAT = [{"role": "user", "content": "def add(a, b):"}]
MAX_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(K3_TINY, tmp_path_factory.mktemp("k3_tiny"))


@pytest.fixture(scope="module")
def expected(checkpoint):
    """Greedy answers of the one-device engine (this process's single CPU device)."""
    from serve.engine.async_engine import AsyncEngine
    from serve.engine.engine import LLMEngine
    from serve.openai.app import build_app
    from serve.openai.background import serve_in_thread
    from serve.openai.config import ServerConfig

    engine = AsyncEngine(LLMEngine.from_pretrained(str(checkpoint), dtype="float32", max_model_len=256,
                                                   max_num_seqs=4, max_num_batched_tokens=128, block_size=16))
    app = build_app(engine, ServerConfig(served_model_names=("m",), model_root="m", chat_format="k3"))
    try:
        with serve_in_thread(app) as url:
            yield _answers(url)
    finally:
        engine.shutdown()


def _answers(base_url: str) -> dict:
    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    texts = [client.completions.create(model="m", prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
             for p in PROMPTS]
    chat = client.chat.completions.create(model="m", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    message = chat.choices[0].message
    metrics = httpx.get(base_url + "/metrics", timeout=30).text
    return dict(texts=texts, chat=(message.content or "") + (getattr(message, "reasoning_content", "") or ""),
                usage=chat.usage.completion_tokens, router_metric="kimi_jax:router_expert_tokens_total" in metrics)


@contextlib.contextmanager
def _servers(checkpoint, flags_per_process: list[list[str]], devices: int, timeout: float = 900):
    """Start one ``kimi-jax serve`` per entry of ``flags_per_process``; yield the first one's base URL."""
    port = _free_port()
    procs = []
    try:
        for flags in flags_per_process:
            cmd = [sys.executable, "-m", "serve.cli", "serve", str(checkpoint), "--served-model-name", "m",
                   "--host", "127.0.0.1", "--port", str(port), *ENGINE_FLAGS, *flags]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(devices), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                raise AssertionError(f"a server exited with {dead[0].returncode}:\n{dead[0].stdout.read()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError("the server did not start in time")
            time.sleep(1)
        yield url
    finally:
        for p in procs:  # only the processes started here
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.mark.parametrize("flags", [["--tensor-parallel-size", "2"], ["--data-parallel-size", "2"]],
                         ids=["TP2", "DP2"])
def test_server_on_a_mesh_answers_like_one_device(checkpoint, expected, flags):
    with _servers(checkpoint, [flags], devices=8) as url:
        got = _answers(url)
    assert got == expected


def test_two_jax_distributed_processes_serve_one_model(checkpoint, expected):
    coordinator = f"127.0.0.1:{_free_port()}"
    hosts = [["--tensor-parallel-size", "2", "--num-hosts", "2", "--host-rank", str(rank),
              "--coordinator-address", coordinator] for rank in (0, 1)]
    with _servers(checkpoint, hosts, devices=1) as url:
        got = _answers(url)
    assert got == expected


def test_an_impossible_layout_is_refused_at_start_up_with_suggestions(checkpoint):
    cmd = [sys.executable, "-m", "serve.cli", "serve", str(checkpoint), *ENGINE_FLAGS, "--tensor-parallel-size", "8"]
    run = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(8), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "--tensor-parallel-size 8: kda_num_heads=4 is not divisible by --tensor-parallel-size 8" in run.stderr
    assert "Layouts that fit 8 devices" in run.stderr and "--tensor-parallel-size 4" in run.stderr
    cmd[-1] = "16"
    run = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(8), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "kda_num_heads=4 is not divisible" in run.stderr
    run = subprocess.run(cmd[:-2] + ["--data-parallel-size", "16"], cwd=ROOT, env=subprocess_env(8),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "needs 16 devices" in run.stderr and "only 8 are visible" in run.stderr
