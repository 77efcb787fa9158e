"""H200 benchmark: residual add + RMSNorm, the Pallas kernel against XLA's fusion of the reference.

Run: ``PYTHONPATH=. python3 pallas_kernels/rmsnorm/bench.py`` (JSON to ``$OUT/rmsnorm_bench.json``). Device
time and kernel launches per call come from a ``jax.profiler`` trace; at decode sizes the launches matter more
than the bytes (every kernel of an engine step also costs host time: BENCHMARKS.md, engine step graph). Roofline: bytes
read + written (x, delta in; sum, normed out) at the copy bandwidth measured here.

``--partials`` (``BENCH_PARTIALS=1``): :class:`PartialSum` addends instead, against XLA summing them then running
its add + norm: o_proj's 4 split-K float32 parts (the decode step's case), and 8 router-weighted expert rows plus
4 split-K parts (the MoE's outputs, which the step leaves to XLA: slower this way in the step; BENCHMARKS.md,
RMSNorm);
Kimi-Linear D=2304, batch 1 and 4.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import bench_checks
from pallas_kernels.bench_timing import TIMING_HEADER, new_result, save_json, time_against_xla, timing_columns
from pallas_kernels.rmsnorm import PartialSum, add_rms_norm
from pallas_kernels.rmsnorm.reference import add_rms_norm_reference

EPS = 1e-5
REPEATS = 20
MAX_DIFF = 0.0625
"""Bound on the max absolute difference from XLA: the bf16 outputs stay below 8 in magnitude, where two bf16 ulps
are 2 * 2**-5 (the sum rounds once either way; the norm's reduction order differs)."""


def finish(bench: str, result: dict) -> None:
    """Exit non-zero, with a line per case, when a case's output differs from XLA's by more than MAX_DIFF."""
    bench_checks.finish(bench, [f"{c.get('case', 'plain')} T={c['rows']} D={c['dim']}: max diff "
                                f"{c['max_abs_diff']:.3e} > {MAX_DIFF}" for c in result["cases"]
                                if not c["max_abs_diff"] <= MAX_DIFF])


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
            ours = jax.jit(lambda x, d, w: add_rms_norm(x, d, w, eps=EPS, impl="pallas"))
            diff = float(jnp.max(jnp.abs(xla(x, delta, weight)[1].astype(jnp.float32)
                                         - ours(x, delta, weight)[1].astype(jnp.float32))))
            case = dict(rows=rows, dim=dim, max_abs_diff=diff,
                        **time_against_xla(xla, ours, (x, delta, weight), REPEATS, 4 * x.nbytes / bandwidth))
            result["cases"].append(case)
            print(f"{rows:>6}{dim:>6} {timing_columns(case)} {diff:9.1e}", flush=True)
            save_json(result, "rmsnorm_bench.json")
    finish("rmsnorm bench", result)


def partials_main():
    result = new_result()
    bandwidth = result["copy_bandwidth_Bps"]
    dim = 2304
    print(f"{'case':>8}{'T':>4} {TIMING_HEADER} {'max diff':>9}")
    for rows in (1, 4):
        keys = jax.random.split(jax.random.key(rows), 5)
        x = jax.random.normal(keys[0], (rows, dim), jnp.bfloat16)
        split = jax.random.normal(keys[1], (rows, 4, dim), jnp.float32)
        experts = jax.random.normal(keys[2], (rows, 8, dim), jnp.bfloat16)
        router = jax.random.uniform(keys[3], (rows, 8), jnp.float32)
        weight = jax.random.uniform(keys[4], (dim,), jnp.float32, 0.5, 1.5)
        cases = {"o_proj": (lambda s, e, r: PartialSum.of((s, None)), split.nbytes),
                 "moe": (lambda s, e, r: PartialSum.of((e, r), (s, None)), split.nbytes + experts.nbytes)}
        for name, (partials, nbytes) in cases.items():
            def xla(x, s, e, r, w, partials=partials):  # XLA's sum as the step ran it before: one array addend
                return add_rms_norm_reference(x, partials(s, e, r).total(x.dtype), w, EPS)

            def ours(x, s, e, r, w, partials=partials):
                return add_rms_norm(x, partials(s, e, r), w, eps=EPS, impl="pallas")

            args = (x, split, experts, router, weight)
            xla, ours = jax.jit(xla), jax.jit(ours)
            diff = float(jnp.max(jnp.abs(xla(*args)[1].astype(jnp.float32) - ours(*args)[1].astype(jnp.float32))))
            case = dict(case=name, rows=rows, dim=dim, max_abs_diff=diff,
                        **time_against_xla(xla, ours, args, REPEATS, (3 * x.nbytes + nbytes) / bandwidth))
            result["cases"].append(case)
            print(f"{name:>8}{rows:>4} {timing_columns(case)} {diff:9.1e}", flush=True)
            save_json(result, "rmsnorm_partials_bench.json")
    finish("rmsnorm partials bench", result)


if __name__ == "__main__":
    if "--partials" in sys.argv or os.environ.get("BENCH_PARTIALS"):
        partials_main()
    else:
        main()
