"""Does launching a jitted step return before the device finishes? (benchmark, GPU)

The engine hides host work behind the device only if ``executable(...)`` returns at once. XLA:GPU may block
the calling thread inside a launch: a ``while`` loop or a ``conditional`` that is not captured in a command
buffer reads its predicate on the host. This times, for a ~20 ms chain of matmuls: the call's return and its
completion, plain and wrapped in lax.cond / lax.fori_loop (dynamic trip count) / lax.cond around a Pallas
kernel. Prints one JSON line per case.

    python3 -m serve.bench.launch
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp


def chain(x):
    for _ in range(24):
        x = jnp.tanh(x @ x) * 0.5
    return x


def cases():
    yield "plain", jax.jit(lambda x, flag, n: chain(x))
    yield "cond", jax.jit(lambda x, flag, n: jax.lax.cond(flag, chain, lambda y: y, x))
    yield "cond_after", jax.jit(lambda x, flag, n: jax.lax.cond(flag, jnp.sin, jnp.cos, chain(x)))
    yield "fori_dynamic", jax.jit(lambda x, flag, n: jax.lax.fori_loop(0, n, lambda i, y: chain(y), x))
    yield "where_both", jax.jit(lambda x, flag, n: jnp.where(flag, chain(x), jnp.cos(x)))


def main() -> None:
    x = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.bfloat16) * 0.01
    flag, n = jnp.asarray(True), jnp.asarray(1)
    for name, fn in cases():
        jax.block_until_ready(fn(x, flag, n))
        returns, totals = [], []
        for _ in range(5):
            start = time.perf_counter()
            out = fn(x, flag, n)
            returned = time.perf_counter()
            jax.block_until_ready(out)
            returns.append(returned - start)
            totals.append(time.perf_counter() - start)
        row = dict(case=name, launch_returns_ms=1e3 * min(returns), done_ms=1e3 * min(totals))
        row["async"] = row["launch_returns_ms"] < 0.25 * row["done_ms"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
