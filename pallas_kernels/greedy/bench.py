"""H200 benchmark: greedy sampling over a Kimi vocabulary, the Pallas kernel against XLA's reductions.

Run: ``PYTHONPATH=. python3 pallas_kernels/greedy/bench.py`` (JSON to ``$OUT/greedy_bench.json``). Device time
and distinct kernels per call from a ``jax.profiler`` trace (at decode sizes the launches matter: each kernel of
an engine step also costs host time, BENCHMARKS.md session 6). Roofline: the fp32 logits read once at the copy
bandwidth measured here.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from pallas_kernels.bench_timing import copy_bandwidth, kernel_split_us
from pallas_kernels.greedy.kernel import greedy_pallas
from pallas_kernels.greedy.reference import greedy_reference

VOCAB = 163840
REPEATS = 20


def main():
    bandwidth = copy_bandwidth()
    result = dict(device=str(jax.devices()[0].device_kind), copy_bandwidth_Bps=bandwidth, cases=[])
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    print(f"{'N':>5} {'xla us':>8}{'n':>4} {'pallas us':>10}{'n':>4} {'roofline us':>12} {'ids equal':>10}")
    xla, ours = jax.jit(greedy_reference), jax.jit(greedy_pallas)
    for rows in (1, 16, 64, 256):
        logits = jax.random.normal(jax.random.key(rows), (rows, VOCAB), jnp.float32) * 4
        same = bool(jnp.all(xla(logits)[0] == ours(logits)[0]))
        times = [kernel_split_us(f, (logits,), repeats=REPEATS) for f in (xla, ours)]
        case = dict(rows=rows, ids_equal=same, roofline_s=logits.nbytes / bandwidth,
                    xla_s=sum(times[0].values()) * 1e-6, xla_kernels=len(times[0]),
                    pallas_s=sum(times[1].values()) * 1e-6, pallas_kernels=len(times[1]))
        result["cases"].append(case)
        print(f"{rows:>5} {case['xla_s'] * 1e6:8.2f}{case['xla_kernels']:4d} {case['pallas_s'] * 1e6:10.2f}"
              f"{case['pallas_kernels']:4d} {case['roofline_s'] * 1e6:12.2f} {str(same):>10}", flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "greedy_bench.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
