"""H200 benchmark: greedy sampling over a Kimi vocabulary, the Pallas kernel against XLA's reductions.

Run: ``PYTHONPATH=. python3 pallas_kernels/greedy/bench.py`` (JSON to ``$OUT/greedy_bench.json``). Device time
and distinct kernels per call from a ``jax.profiler`` trace (at decode sizes the launches matter: each kernel of
an engine step also costs host time: BENCHMARKS.md, engine step graph). Roofline: the fp32 logits read once at the copy
bandwidth measured here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import bench_checks
from pallas_kernels.bench_timing import TIMING_HEADER, new_result, save_json, time_against_xla, timing_columns
from pallas_kernels.greedy.kernel import greedy_pallas
from pallas_kernels.greedy.reference import greedy_reference

VOCAB = 163840
REPEATS = 20


def main():
    result = new_result()
    bandwidth = result["copy_bandwidth_Bps"]
    print(f"{'N':>5} {TIMING_HEADER} {'ids equal':>10}")
    xla, ours = jax.jit(greedy_reference), jax.jit(greedy_pallas)
    for rows in (1, 16, 64, 256):
        logits = jax.random.normal(jax.random.key(rows), (rows, VOCAB), jnp.float32) * 4
        same = bool(jnp.all(xla(logits)[0] == ours(logits)[0]))
        case = dict(rows=rows, ids_equal=same,
                    **time_against_xla(xla, ours, (logits,), REPEATS, logits.nbytes / bandwidth))
        result["cases"].append(case)
        print(f"{rows:>5} {timing_columns(case)} {str(same):>10}", flush=True)
        save_json(result, "greedy_bench.json")
    bench_checks.finish("greedy bench", [f"N={c['rows']}: token ids differ from the reference" for c in result["cases"]
                                         if not c["ids_equal"]])


if __name__ == "__main__":
    main()
