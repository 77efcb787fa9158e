"""H200 benchmark: MoE routing at decode, the two Pallas kernels (at several logits program counts) against XLA's
lowering of the reference.

Run: ``PYTHONPATH=. python3 pallas_kernels/router/bench.py [--models kimi-linear] [--rows 1 16] [--targets 128]
[--logits-warps 2 4] [--topk-warps 1 4]`` (JSON to ``$OUT/router_bench.json``). Two times per
variant: device microseconds per call summed over its kernels (``jax.profiler`` trace), and the wall time per call
of a chain of ``CHAIN`` calls inside one jit, which also counts the gaps between launches. Every call of every
chain (``CHAIN`` x ``ROUNDS``) is checked against the reference's ids. Roofline: the
fp32 router weight read once at the copy bandwidth measured here. Shapes: Kimi-Linear-48B (D=2304, E=256, k=8)
and K3 (D=7168, E=896, k=16).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bench_checks
from pallas_kernels.bench_timing import kernel_split_us, new_result, save_json
from pallas_kernels.router.config import RouterConfig
from pallas_kernels.router.kernel import route_pallas
from pallas_kernels.router.reference import route_reference

CHAIN, ROUNDS, REPEATS = 50, 10, 20
SHAPES = {"kimi-linear": (2304, 256, 8, 2.446), "k3": (7168, 896, 16, 1.0)}


def variants(k, scaling, args):
    """name -> f(x [T, D], router, bias) -> (weights, ids): XLA, and the Pallas kernels for every combination of
    the program target and warp counts asked for."""
    out = {"xla": lambda x, w, b: route_reference(x, w[1], b[1], k=k, scaling=scaling)}
    for target, lw, tw in itertools.product(args.targets, args.logits_warps, args.topk_warps):
        out[f"p{target}_w{lw}_{tw}"] = functools.partial(
            route_pallas, layer=1, k=k, renormalize=True, scaling=scaling,
            config=RouterConfig(target_programs=target, logits_warps=lw, topk_warps=tw))
    return out


def chain_run(fn, xs, w, b):
    """The ids of ``len(xs)`` calls in one jit -> [N, T, k]."""
    return jax.jit(lambda xs, w, b: jnp.stack([fn(xs[i], w, b)[1] for i in range(xs.shape[0])]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--targets", type=int, nargs="+", default=[128, 64, 32])
    parser.add_argument("--logits-warps", type=int, nargs="+", default=[4])
    parser.add_argument("--topk-warps", type=int, nargs="+", default=[4])
    args = parser.parse_args()
    result = new_result()
    bandwidth = result["copy_bandwidth_Bps"]
    print(f"{'model':>12}{'T':>4} {'variant':>14} {'device us':>10}{'n':>3} {'chain us':>9} {'roofline us':>12}"
          f" {'ids ok':>7}")
    for model in args.models:
        dim, experts, k, scaling = SHAPES[model]
        for rows in args.rows:
            keys = jax.random.split(jax.random.key(rows * dim), 3)
            xs = jax.random.normal(keys[0], (CHAIN, rows, dim), jnp.bfloat16)
            router = jax.random.normal(keys[1], (2, dim, experts), jnp.float32) * dim**-0.5
            bias = jax.random.normal(keys[2], (2, experts), jnp.float32) * 0.01
            want = np.asarray(jax.vmap(lambda x: route_reference(x, router[1], bias[1], k=k, scaling=scaling)[1])(xs))
            for name, fn in variants(k, scaling, args).items():
                chain = chain_run(fn, xs, router, bias)
                bad = 0
                for _ in range(ROUNDS):
                    bad += int(np.sum(np.any(np.asarray(chain(xs, router, bias)) != want, axis=(1, 2))))
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    jax.block_until_ready(chain(xs, router, bias))
                    best = min(best, (time.perf_counter() - t0) / CHAIN)
                split = kernel_split_us(jax.jit(fn), (xs[0], router, bias), REPEATS)
                device_s, kernels = sum(split.values()) * 1e-6, len(split)
                case = dict(model=model, rows=rows, dim=dim, experts=experts, k=k, variant=name, device_s=device_s,
                            kernels=kernels, kernel_us=split, chain_s=best, roofline_s=dim * experts * 4 / bandwidth,
                            bad_calls=bad, calls_checked=CHAIN * ROUNDS)
                result["cases"].append(case)
                print(f"{model:>12}{rows:>4} {name:>14} {device_s * 1e6:10.2f}{kernels:3d} {best * 1e6:9.2f}"
                      f" {case['roofline_s'] * 1e6:12.2f} {bad == 0!s:>7}", flush=True)
                save_json(result, "router_bench.json")
    bench_checks.finish("router bench", [f"{c['model']} T={c['rows']} {c['variant']}: {c['bad_calls']} of "
                                         f"{c['calls_checked']} calls chose other experts than the reference"
                                         for c in result["cases"] if c["bad_calls"]])


if __name__ == "__main__":
    main()
