"""Timing and profiler-trace helpers shared by the benchmarks (the kernel benches and
``serve.bench.trace_summary``; GPU runs, not the library)."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import time

import jax
import jax.numpy as jnp


def timed(fn, inputs) -> float:
    """Seconds per call: ``fn`` applied to each leading-axis slice of ``inputs[0]`` (the rest shared) inside one
    jit, so one dispatch covers them all; best of 3."""
    xs, *rest = inputs
    reps = xs.shape[0]
    many = jax.jit(lambda xs, *rest: tuple(fn(xs[i], *rest) for i in range(reps)))
    jax.block_until_ready(many(xs, *rest))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(many(xs, *rest))
        best = min(best, time.perf_counter() - t0)
    return best / reps


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s: a 2 GiB bf16 read + write, 10 chained calls, best of 3. The input is
    donated, so every call reuses the same two buffers (without that, a fresh 2 GiB output per call measured
    0.53 TB/s under ``XLA_PYTHON_CLIENT_PREALLOCATE=false``)."""
    a = jnp.ones((1 << 30,), jnp.bfloat16)
    nbytes = a.nbytes
    f = jax.jit(lambda v: v + 1, donate_argnums=0)
    a = jax.block_until_ready(f(a))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(10):
            a = f(a)
        jax.block_until_ready(a)
        best = min(best, (time.perf_counter() - t0) / 10)
    return 2 * nbytes / best


def kernel_times(folder: str) -> tuple[collections.Counter, collections.Counter, str]:
    """Summed microseconds and launch counts per event name on the busiest device-side thread group."""
    path = folder if os.path.isfile(folder) else sorted(
        glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in names.items() if "/device:" in name and "CPU" not in name.upper()}
    if not device_pids:  # CPU-only trace: the XLA ops run on host threads
        device_pids = set(names)
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e:
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    return total, count, path


def kernel_split_us(fn, args, repeats: int = 3) -> dict[str, float]:
    """Device microseconds per call of each kernel ``fn(*args)`` launches, from a ``jax.profiler`` trace of
    ``repeats`` calls (which kernel of a multi-launch op dominates)."""
    import tempfile

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(repeats):
                jax.block_until_ready(fn(*args))
        total, _, _ = kernel_times(folder)
    return {name: us / repeats for name, us in total.most_common(8)}


def device_seconds_and_kernels(fn, args, repeats: int = 20) -> tuple[float, int]:
    """(device seconds, distinct kernels) per call of ``fn(*args)``, from :func:`kernel_split_us` (at most its 8
    busiest kernels: small ops, where the launch count matters as much as the time)."""
    split = kernel_split_us(fn, args, repeats)
    return sum(split.values()) * 1e-6, len(split)


TIMING_HEADER = f"{'xla us':>8}{'n':>4} {'pallas us':>10}{'n':>4} {'roofline us':>12}"
"""Column titles of :func:`timing_columns`."""


def time_against_xla(xla, ours, args, repeats: int, roofline_s: float) -> dict:
    """A kernel bench's timing fields for one case: device seconds and kernels per call of XLA's lowering of the
    reference (``xla``) and of the Pallas version (``ours``) on ``args``, and the case's roofline."""
    (xla_s, xla_n), (ours_s, ours_n) = (device_seconds_and_kernels(f, args, repeats) for f in (xla, ours))
    return dict(xla_s=xla_s, xla_kernels=xla_n, pallas_s=ours_s, pallas_kernels=ours_n, roofline_s=roofline_s)


def timing_columns(case: dict) -> str:
    """The printed row's timing part for a case holding :func:`time_against_xla`'s fields."""
    return (f"{case['xla_s'] * 1e6:8.2f}{case['xla_kernels']:4d} {case['pallas_s'] * 1e6:10.2f}"
            f"{case['pallas_kernels']:4d} {case['roofline_s'] * 1e6:12.2f}")


def new_result() -> dict:
    """A bench's result record: the device and the copy bandwidth measured now (printed), and no cases yet."""
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    return dict(device=str(jax.devices()[0].device_kind), copy_bandwidth_Bps=bandwidth, cases=[])


def save_json(result: dict, filename: str) -> None:
    """Write a bench's results to ``$OUT/filename`` (the current folder without ``$OUT``)."""
    with open(os.path.join(os.environ.get("OUT", "."), filename), "w") as f:
        json.dump(result, f, indent=1)
