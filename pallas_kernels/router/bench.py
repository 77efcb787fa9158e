"""H200 benchmark: MoE routing at decode, the two Pallas kernels against XLA's lowering of the reference.

Run: ``PYTHONPATH=. python3 pallas_kernels/router/bench.py`` (JSON to ``$OUT/router_bench.json``). Device time
and kernel launches per call from a ``jax.profiler`` trace. Roofline: the fp32 router weight read once at the
copy bandwidth measured here. Shapes: Kimi-Linear-48B (D=2304, E=256, k=8) and K3 (D=7168, E=896, k=16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.bench_timing import TIMING_HEADER, new_result, save_json, time_against_xla, timing_columns
from pallas_kernels.router.kernel import route_pallas
from pallas_kernels.router.reference import route_reference

REPEATS = 20
SHAPES = {"kimi-linear": (2304, 256, 8, 2.446), "k3": (7168, 896, 16, 1.0)}


def main():
    result = new_result()
    bandwidth = result["copy_bandwidth_Bps"]
    print(f"{'model':>12}{'T':>5} {TIMING_HEADER} {'ids equal':>10}")
    for model, (dim, experts, k, scaling) in SHAPES.items():
        for rows in (1, 16, 64):
            keys = jax.random.split(jax.random.key(rows * dim), 3)
            x = jax.random.normal(keys[0], (rows, dim), jnp.bfloat16)
            router = jax.random.normal(keys[1], (2, dim, experts), jnp.float32) * dim**-0.5
            bias = jax.random.normal(keys[2], (2, experts), jnp.float32) * 0.01
            xla = jax.jit(lambda x, w, b: route_reference(x, w[1], b[1], k=k, scaling=scaling))
            ours = jax.jit(functools.partial(route_pallas, layer=1, k=k, renormalize=True, scaling=scaling))
            (w_ref, ids_ref), (w_ours, ids_ours) = xla(x, router, bias), ours(x, router, bias)
            same = bool(np.array_equal(np.asarray(ids_ref), np.asarray(ids_ours)))
            diff = float(jnp.max(jnp.abs(w_ref - w_ours)))
            case = dict(model=model, rows=rows, dim=dim, experts=experts, k=k, ids_equal=same, max_weight_diff=diff,
                        **time_against_xla(xla, ours, (x, router, bias), REPEATS, dim * experts * 4 / bandwidth))
            result["cases"].append(case)
            print(f"{model:>12}{rows:>5} {timing_columns(case)} {str(same):>10}", flush=True)
            save_json(result, "router_bench.json")


if __name__ == "__main__":
    main()
