"""Cost of dependent launches under XLA options (benchmark): does programmatic dependent launch (PDL) shorten a
chain of our decode-sized kernels?

A decode step at batch 1 is a chain of ~25 dependent small kernels per layer, each paying a launch ramp (BENCHMARKS.md,
engine: each launch's fixed ramp, which only fewer launches on the critical path can remove). XLA can
launch a kernel before its predecessor finishes (``xla_gpu_enable_pdl``; the kernel's ``griddepcontrol.wait`` holds
its reads) and let a predecessor release its successors early (``xla_gpu_enable_pdl_launch``); both are on by
default in jax 0.11.2 (the dumped ``*.debug_options``, which list non-default options, show them only when turned
off). This times, per option set, one jitted chain of ``--links`` x (one-row GEMV ``D -> D`` on a layer stack
through our grouped kernel, then our residual add + RMSNorm), and the same chain in plain XLA, checks that every
option set gives bit-identical results, and counts the PDL instructions in what XLA emitted for a 2-link chain
under each option set (a child process per set with ``XLA_FLAGS=--xla_dump_to=...``: given as a compile option,
``xla_dump_to`` writes nothing on the H200), which says whether our Pallas kernels get
``griddepcontrol.wait`` at all.

    PYTHONPATH=. python3 -m serve.bench.kernel_launch --links 32
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.layers.common import stacked_linear
from pallas_kernels.rmsnorm import add_rms_norm

_CONCURRENT = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}  # the engine's option
OPTION_SETS = {
    "engine (PDL on: XLA's default)": _CONCURRENT,
    "PDL launch insertion off": {**_CONCURRENT, "xla_gpu_enable_pdl_launch": False},
    "PDL off": {**_CONCURRENT, "xla_gpu_enable_pdl": False, "xla_gpu_enable_pdl_launch": False},
    "no command buffer (PDL on)": {"xla_gpu_enable_command_buffer": ""},
}


def pallas_chain(h: jax.Array, w: jax.Array, norm: jax.Array, links: int) -> jax.Array:
    """h [1, D]; w [L, D, D] bf16; norm [L, D] -> h after ``links`` (GEMV, add + RMSNorm) pairs."""
    x = h
    for i in range(links):
        y = stacked_linear(x, w, i % w.shape[0], impl="pallas")
        h, x = add_rms_norm(h, y, norm, eps=1e-6, layer=i % w.shape[0], impl="pallas")
    return h


def xla_chain(h: jax.Array, w: jax.Array, norm: jax.Array, links: int) -> jax.Array:
    """The same chain with XLA's dot and fusions."""
    x = h
    for i in range(links):
        j = i % w.shape[0]
        y = jnp.dot(x, w[j], preferred_element_type=jnp.float32).astype(h.dtype)
        h, x = add_rms_norm(h, y, norm, eps=1e-6, layer=j, impl="reference")
    return h


def dump_counts(folder: str) -> dict:
    """Files XLA dumped under ``folder`` by extension, and how many of them (and of those naming our Pallas kernels)
    hold each PDL instruction."""
    files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]
    counts = {"files_by_ext": dict(collections.Counter(os.path.splitext(f)[1] for f in files))}
    texts = [open(f, errors="replace").read() for f in files]
    for word in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
        counts[word] = sum(t.count(word) for t in texts)
        counts[word + " (files naming grouped_gemm)"] = sum(word in t for t in texts if "grouped_gemm" in t)
    return counts


def xla_flags(options: dict) -> str:
    """A compile-option set as XLA_FLAGS text."""
    text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    return " ".join(f"--{name}={text(value)}" for name, value in options.items())


def probe_dumps(option_sets: dict) -> dict[str, dict]:
    """Per option set: :func:`dump_counts` of a child process that compiles a 2-link chain of each kind under
    ``XLA_FLAGS`` = the set plus ``--xla_dump_to``."""
    found = {}
    for name, options in option_sets.items():
        folder = tempfile.mkdtemp(prefix="pdl_dump_")
        env = {**os.environ, "XLA_FLAGS": f"{xla_flags(options)} --xla_dump_to={folder}"}
        done = subprocess.run([sys.executable, __file__, "--child-compile"], env=env, capture_output=True, text=True,
                              timeout=300)
        found[name] = dump_counts(folder) if done.returncode == 0 else {"error": done.stderr[-300:]}
        print(json.dumps({"dump": name, **found[name]}), flush=True)
    return found


def time_calls(fn, args, calls: int = 30) -> float:
    """Seconds per call of ``calls`` back-to-back calls (device-bound when one call outlasts its dispatch);
    median of 5 rounds."""
    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t0) / calls)
    return float(np.median(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--links", type=int, default=32)
    parser.add_argument("--dim", type=int, default=2304)
    parser.add_argument("--stack", type=int, default=8, help="distinct weight matrices cycled through")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--child-compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_compile:  # probe_dumps' child: XLA_FLAGS carry the options and the dump folder
        args.links, args.stack = 2, 2
    key = jax.random.PRNGKey(0)
    kw, kh, kn = jax.random.split(key, 3)
    w = (jax.random.normal(kw, (args.stack, args.dim, args.dim), jnp.float32) * args.dim ** -0.5).astype(jnp.bfloat16)
    h = jax.random.normal(kh, (1, args.dim), jnp.float32).astype(jnp.bfloat16)
    norm = (1.0 + 0.1 * jax.random.normal(kn, (args.stack, args.dim), jnp.float32))
    if args.child_compile:
        for chain in (pallas_chain, xla_chain):
            jax.block_until_ready(jax.jit(lambda h, w, n: chain(h, w, n, args.links))(h, w, norm))
        return
    rows, reference = [], {}
    for chain_name, chain in (("pallas", pallas_chain), ("xla", xla_chain)):
        lowered = jax.jit(lambda h, w, n: chain(h, w, n, args.links)).lower(h, w, norm)
        for name, options in OPTION_SETS.items():
            try:
                compiled = lowered.compile(options)
            except Exception as e:  # an option this XLA rejects: say so, keep going
                rows.append(dict(chain=chain_name, options=name, error=str(e)[:200]))
                print(json.dumps(rows[-1]), flush=True)
                continue
            out = np.asarray(compiled(h, w, norm).astype(jnp.float32))
            reference.setdefault(chain_name, out)
            seconds = time_calls(compiled, (h, w, norm))
            rows.append(dict(chain=chain_name, options=name, us_per_call=seconds * 1e6,
                             us_per_link=seconds * 1e6 / args.links,
                             identical=bool(np.array_equal(out, reference[chain_name]))))
            print(json.dumps(rows[-1]), flush=True)
    dumps = probe_dumps(OPTION_SETS)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_bench.json"), "w") as f:
        json.dump(dict(args=vars(args), device=jax.devices()[0].device_kind, rows=rows, dumps=dumps), f, indent=1)
    print(f"\n{args.links} links of (1 x {args.dim} GEMV, add + RMSNorm); bytes per GEMV "
          f"{args.dim * args.dim * 2 / 1e6:.1f} MB")
    print("| chain | options | us per call | us per link | identical |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['chain']} | {r['options']} | error: {r['error'][:60]} | | |")
        else:
            print(f"| {r['chain']} | {r['options']} | {r['us_per_call']:.1f} | {r['us_per_link']:.2f} | "
                  f"{r['identical']} |")
    print("\n| options | dumped files | griddepcontrol.wait (in files naming grouped_gemm) | launch_dependents |")
    print("|---|---|---|---|")
    for name, d in dumps.items():
        if "error" in d:
            print(f"| {name} | error: {d['error'][-80:]} | | |")
        else:
            w, ld = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
            print(f"| {name} | {d['files_by_ext']} | {d[w]} ({d[w + ' (files naming grouped_gemm)']}) | {d[ld]} |")


if __name__ == "__main__":
    main()
