"""H200 benchmark: residual add + RMSNorm, the Pallas kernel against XLA's fusion of the reference.

Run: ``PYTHONPATH=. python3 pallas_kernels/rmsnorm/bench.py`` (JSON to ``$OUT/rmsnorm_bench.json``). Device
time and kernel launches per call come from a ``jax.profiler`` trace; at decode sizes the launches matter more
than the bytes (every kernel of an engine step also costs host time, BENCHMARKS.md session 6). Roofline: bytes
read + written (x, delta in; sum, normed out) at the copy bandwidth measured here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.bench_timing import TIMING_HEADER, new_result, save_json, time_against_xla, timing_columns
from pallas_kernels.rmsnorm.kernel import add_rms_norm_pallas
from pallas_kernels.rmsnorm.reference import add_rms_norm_reference

EPS = 1e-5
REPEATS = 20


def main():
    result = new_result()
    bandwidth = result["copy_bandwidth_Bps"]
    print(f"{'T':>6}{'D':>6} {TIMING_HEADER} {'max diff':>9}")
    for rows in (1, 16, 64, 256, 2048):
        for dim in (2304, 7168):
            keys = jax.random.split(jax.random.key(rows * dim), 3)
            x, delta = (jax.random.normal(k, (rows, dim), jnp.bfloat16) for k in keys[:2])
            weight = jax.random.uniform(keys[2], (dim,), jnp.float32, 0.5, 1.5)
            xla = jax.jit(lambda x, d, w: add_rms_norm_reference(x, d, w, EPS))
            ours = jax.jit(lambda x, d, w: add_rms_norm_pallas(x, d, w[None], eps=EPS))
            diff = float(jnp.max(jnp.abs(xla(x, delta, weight)[1].astype(jnp.float32)
                                         - ours(x, delta, weight)[1].astype(jnp.float32))))
            case = dict(rows=rows, dim=dim, max_abs_diff=diff,
                        **time_against_xla(xla, ours, (x, delta, weight), REPEATS, 4 * x.nbytes / bandwidth))
            result["cases"].append(case)
            print(f"{rows:>6}{dim:>6} {timing_columns(case)} {diff:9.1e}", flush=True)
            save_json(result, "rmsnorm_bench.json")


if __name__ == "__main__":
    main()
