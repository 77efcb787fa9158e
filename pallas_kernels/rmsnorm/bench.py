"""H200 benchmark: residual add + RMSNorm, the Pallas kernel against XLA's fusion of the reference.

Run: ``PYTHONPATH=. python3 pallas_kernels/rmsnorm/bench.py`` (JSON to ``$OUT/rmsnorm_bench.json``). Device
time and kernel launches per call come from a ``jax.profiler`` trace; at decode sizes the launches matter more
than the bytes (every kernel of an engine step also costs host time, BENCHMARKS.md session 6). Roofline: bytes
read + written (x, delta in; sum, normed out) at the copy bandwidth measured here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.bench_timing import device_seconds_and_kernels, new_result, save_json
from pallas_kernels.rmsnorm.kernel import add_rms_norm_pallas
from pallas_kernels.rmsnorm.reference import add_rms_norm_reference

EPS = 1e-5
REPEATS = 20


def main():
    result = new_result()
    bandwidth = result["copy_bandwidth_Bps"]
    print(f"{'T':>6}{'D':>6} {'xla us':>8}{'n':>4} {'pallas us':>10}{'n':>4} {'roofline us':>12} {'max diff':>9}")
    for rows in (1, 16, 64, 256, 2048):
        for dim in (2304, 7168):
            keys = jax.random.split(jax.random.key(rows * dim), 3)
            x, delta = (jax.random.normal(k, (rows, dim), jnp.bfloat16) for k in keys[:2])
            weight = jax.random.uniform(keys[2], (dim,), jnp.float32, 0.5, 1.5)
            xla = jax.jit(lambda x, d, w: add_rms_norm_reference(x, d, w, EPS))
            ours = jax.jit(lambda x, d, w: add_rms_norm_pallas(x, d, w[None], eps=EPS))
            diff = float(jnp.max(jnp.abs(xla(x, delta, weight)[1].astype(jnp.float32)
                                         - ours(x, delta, weight)[1].astype(jnp.float32))))
            (xla_s, xla_n), (ours_s, ours_n) = (device_seconds_and_kernels(f, (x, delta, weight), REPEATS)
                                                  for f in (xla, ours))
            case = dict(rows=rows, dim=dim, xla_s=xla_s, xla_kernels=xla_n, pallas_s=ours_s, pallas_kernels=ours_n,
                        roofline_s=4 * x.nbytes / bandwidth, max_abs_diff=diff)
            result["cases"].append(case)
            print(f"{rows:>6}{dim:>6} {xla_s * 1e6:8.2f}{xla_n:4.0f} {ours_s * 1e6:10.2f}{ours_n:4.0f} "
                  f"{case['roofline_s'] * 1e6:12.2f} {diff:9.1e}", flush=True)
            save_json(result, "rmsnorm_bench.json")


if __name__ == "__main__":
    main()
