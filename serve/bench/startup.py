"""Start-up and first-request latency of ``kimi-jax serve`` (benchmark).

Launches the server ``--launches`` times in a row over one fresh compilation cache folder (the first launch is a
cold start that compiles every step shape; on a GPU later ones load the compiled steps from the cache's
``executables`` folder, ``serve.engine.executable_cache``), and for each
launch records: seconds from the process start to ``/health`` answering 200 (weights, pools and warm-up: with the
server's default progressive warm-up, the largest buckets only), the latency of the first and second requests (a
greedy completion of ``--max-tokens`` tokens and a chat turn, each sent twice), seconds from the process start
until ``kimi_jax:warm_up_executables_pending`` reads 0 (every bucket compiled), the same requests again then
(``warm_*``), and ``kimi_jax:compiles_after_warm_up`` from ``/metrics`` after them (0: no request compiled
anything). Everything after ``--`` is passed to ``kimi-jax serve``. A server that exits before it is ready ends
the run, its log's last line in the error; one that times out does not (the next launch reuses what it compiled).

    python -m serve.bench.startup --launches 2 -- tiny --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_OUT_NAME = "bench_startup.json"
_COMPILES = "kimi_jax:compiles_after_warm_up"
_PENDING = "kimi_jax:warm_up_executables_pending"


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launches", type=int, default=2, help="server launches over one compilation cache folder")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up on a launch after this many seconds")
    p.add_argument("--cache-dir", default=None, help="compilation cache folder (default: a fresh temporary one)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(own)
    if args.launches < 1:
        p.error("--launches must be >= 1")
    args.serve_args = serve_args
    return args


class ServerExited(RuntimeError):
    """The server process ended before it was ready (a later launch would fail the same way)."""


def last_line(path: str) -> str:
    """The last non-blank line of a log file ('' if none)."""
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else ""


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float, log_path: str) -> float:
    """Seconds until ``/health`` answers 200; ServerExited (with the log's last line) when the server exits,
    RuntimeError when the timeout passes."""
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise ServerExited(f"the server exited with status {proc.returncode} before it was ready: "
                               f"{last_line(log_path)}")
        try:
            if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s")


def timed_requests(base: str, model: str, max_tokens: int) -> dict:
    """Latency (s) of a greedy completion and of a chat turn, each sent twice."""
    import httpx

    bodies = {"completion": ("/v1/completions", {"model": model, "prompt": "def add(a, b):\n", "max_tokens": max_tokens,
                                                 "temperature": 0}),
              "chat": ("/v1/chat/completions", {"model": model, "max_tokens": max_tokens, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Say hello."}]})}
    out = {}
    with httpx.Client(timeout=600.0) as client:
        for name, (path, body) in bodies.items():
            for attempt in ("first", "second"):
                start = time.perf_counter()
                response = client.post(base + path, json=body)
                response.raise_for_status()
                out[f"{name}_{attempt}_s"] = time.perf_counter() - start
    return out


def metric(base: str, name: str) -> float | None:
    """A gauge's value from ``/metrics`` (None when the server does not export it)."""
    import httpx

    for line in httpx.get(base + "/metrics", timeout=10.0).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_compiled(base: str, proc: subprocess.Popen, deadline: float) -> float | None:
    """``time.perf_counter()`` when no executable is left compiling (None: still compiling at ``deadline``)."""
    while time.perf_counter() < deadline and proc.poll() is None:
        if not metric(base, _PENDING):
            return time.perf_counter()
        time.sleep(0.5)
    return None


def served_model(base: str) -> str:
    import httpx

    return httpx.get(base + "/v1/models", timeout=10.0).json()["data"][0]["id"]


def launch(args, cache_dir: str, index: int) -> dict:
    """One server launch: ready time, request latencies, compiles after warm-up; the server is then stopped."""
    base = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "KIMI_JAX_COMPILE_CACHE": cache_dir}
    log_path = os.path.join(args.out, f"startup_server_{index}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(args.port), *args.serve_args], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            start = time.perf_counter()
            row = dict(launch=index, ready_s=wait_ready(base, proc, args.timeout_s, log_path))
            model = served_model(base)
            row.update(timed_requests(base, model, args.max_tokens))
            compiled = wait_compiled(base, proc, start + args.timeout_s)
            row["all_compiled_s"] = None if compiled is None else compiled - start
            if compiled is not None:
                row.update({f"warm_{name}": s for name, s in timed_requests(base, model, args.max_tokens).items()})
            row["compiles_after_warm_up"] = metric(base, _COMPILES)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="kimi_jax_jit_")
    doc = dict(serve_args=args.serve_args, cache_dir=cache, launches=[])
    path = os.path.join(args.out, _OUT_NAME)
    failed = 0
    for index in range(args.launches):
        exited = False
        try:
            row = launch(args, cache, index)
        except Exception as err:  # noqa: BLE001 - reported in the JSON; a launch past a timeout reuses the cache
            row, failed, exited = dict(launch=index, error=str(err)), failed + 1, isinstance(err, ServerExited)
        doc["launches"].append(row)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(json.dumps(row), flush=True)
        if exited:  # a server that cannot start will not start next time either
            break
    return 1 if failed or any(r.get("compiles_after_warm_up") for r in doc["launches"]) else 0


if __name__ == "__main__":
    sys.exit(main())
