"""H200 benchmark: fused AttnRes mix (Pallas) vs XLA's fusion of the jnp reference, K3 width D = 7168.

Run: ``PYTHONPATH=. python3 pallas_kernels/attnres/bench.py`` (JSON to ``$OUT/attnres_bench.json``).
Roofline: bytes of the sources read once + the output written once, at the copy bandwidth measured here.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from pallas_kernels.attnres.config import AttnResConfig
from pallas_kernels.attnres.kernel import attnres_mix_pallas
from pallas_kernels.attnres.reference import attnres_mix_reference
from pallas_kernels import bench_checks
from pallas_kernels.bench_timing import copy_bandwidth, timed

D = 7168
REPS = 8
MAX_REL_ERR = {"float32": 1e-5, "bfloat16": 1e-2}
"""The tests' bounds on the max error relative to the largest reference value (fp32 math; bf16 output rounding)."""
CONFIGS = {"n1w4": dict(block_n=1, num_warps=4), "n4w4": dict(block_n=4, num_warps=4),
           "n2w8c512": dict(block_n=2, num_warps=8, max_chunk=512)}


def main():
    key = jax.random.key(0)
    q, w, ow = (jax.random.normal(k, (D,), jnp.float32) * 0.05 for k in jax.random.split(key, 3))
    result = dict(device=str(jax.devices()[0].device_kind), copy_bandwidth_Bps=copy_bandwidth(), cases=[])
    bw = result["copy_bandwidth_Bps"]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for L, N, dtype in ((9, 64, jnp.bfloat16), (9, 8192, jnp.bfloat16), (2, 8192, jnp.bfloat16),
                        (9, 8192, jnp.float32)):
        xs = jax.random.normal(jax.random.key(L * N), (REPS, L, N, D), dtype)
        ref = attnres_mix_reference(q, xs[0], w, output_rms_weight=ow, eps=1e-5)
        case = dict(L=L, N=N, dtype=jnp.dtype(dtype).name, bytes=(L + 1) * N * D * jnp.dtype(dtype).itemsize,
                    xla_s=timed(lambda s, q, w, ow: attnres_mix_reference(q, s, w, output_rms_weight=ow, eps=1e-5),
                                (xs, q, w, ow)), pallas_s={}, max_rel_err={})
        for name, cfg in CONFIGS.items():
            fn = lambda s, q, w, ow, cfg=cfg: attnres_mix_pallas(q, s, w, output_rms_weight=ow, eps=1e-5,
                                                                 config=AttnResConfig(**cfg))
            try:
                got = fn(xs[0], q, w, ow)
                case["max_rel_err"][name] = float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - ref[0].astype(
                    jnp.float32))) / jnp.max(jnp.abs(ref[0].astype(jnp.float32))))
                case["pallas_s"][name] = timed(fn, (xs, q, w, ow))
            except Exception as err:  # noqa: BLE001 - report and go on
                case["pallas_s"][name] = f"error: {type(err).__name__}: {str(err)[:200]}"
        result["cases"].append(case)
        with open(os.path.join(os.environ.get("OUT", "."), "attnres_bench.json"), "w") as f:
            json.dump(result, f, indent=1)
        print_row(case, bw)
    bench_checks.finish("attnres bench", [
        f"L={c['L']} N={c['N']} {c['dtype']} {name}: {v}" for c in result["cases"] for name, v in
        {**{n: e for n, e in c["max_rel_err"].items() if not e <= MAX_REL_ERR[c["dtype"]]},
         **{n: s for n, s in c["pallas_s"].items() if isinstance(s, str)}}.items()])


def print_row(c, bw):
    """One table row: L N dtype | XLA us %BW | best Pallas us %BW config | speedup, its max relative error."""
    ok = {k: v for k, v in c["pallas_s"].items() if isinstance(v, float)}
    name, t = min(ok.items(), key=lambda kv: kv[1]) if ok else ("-", float("nan"))
    err = c["max_rel_err"].get(name, float("nan"))
    print(f"L={c['L']} N={c['N']} {c['dtype']} | XLA {c['xla_s'] * 1e6:.1f} us "
          f"({100 * c['bytes'] / c['xla_s'] / bw:.0f}% BW) | pallas {t * 1e6:.1f} us "
          f"({100 * c['bytes'] / t / bw:.0f}% BW, {name}) | speedup {c['xla_s'] / t:.2f}x relerr {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
