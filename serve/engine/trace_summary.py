"""Device time per kernel from a ``jax.profiler`` trace (``*.trace.json.gz``), to see where a step goes.

    python -m serve.engine.trace_summary OUT/trace_b64 [--top 25] [--steps 3]   (a folder or a .trace.json.gz)
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def kernel_times(folder: str) -> tuple[collections.Counter, collections.Counter, str]:
    """Summed microseconds and launch counts per event name on the busiest device-side thread group."""
    path = folder if os.path.isfile(folder) else sorted(
        glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in names.items() if "/device:" in name and "CPU" not in name.upper()}
    if not device_pids:  # CPU-only trace: the XLA ops run on host threads
        device_pids = set(names)
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e:
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    return total, count, path


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
