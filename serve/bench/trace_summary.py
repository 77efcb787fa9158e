"""Device time per kernel from a ``jax.profiler`` trace (``*.trace.json.gz``), to see where a step goes.

    python -m serve.bench.trace_summary OUT/trace_b64 [--top 25] [--steps 3]   (a folder or a .trace.json.gz)
"""

from __future__ import annotations

import argparse

from pallas_kernels.bench_timing import kernel_times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--steps", type=int, default=3, help="steps in the trace (per-step numbers)")
    args = parser.parse_args(argv)
    total, count, path = kernel_times(args.folder)
    busy = sum(total.values())
    print(f"{path}: {busy / args.steps / 1e3:.3f} ms of device events per step")
    for name, us in total.most_common(args.top):
        print(f"{us / args.steps:10.1f} us/step {count[name] / args.steps:6.1f}x  {us / busy:6.1%}  {name[:110]}")


if __name__ == "__main__":
    main()
