"""Host-tier copy and prefill -> decode wire figures for one long request on a preset's cache shapes (benchmark).

One request of ``--tokens`` tokens holds ``tokens / block_size`` full pages and one KDA slot (recurrent + conv
state). Timed, each ``--repeats`` times after a warm-up: device -> host saves (``HostCopier.save`` into pinned
host memory, waited for), host -> device loads (``HostCopier.load``), and the wire format (``kv_transfer.encode``
and ``decode`` of the same entries). Only cache pools are allocated (no weights), so the full-depth 48B shapes fit.
Prints one JSON line.

    PYTHONPATH=. python3 -m serve.bench.transfer --preset kimi-linear-48b --tokens 32768 --block-size 64
"""

from __future__ import annotations

import argparse
import json
import time

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kimi_jax.presets import PRESETS
from kimi_jax.step import init_cache
from serve.engine.host_copy import HostCopier
from serve.engine.kv_connector import TransferItem
from serve.engine.kv_store import HostCheckpoint, HostPage
from serve.engine.kv_transfer import decode, encode


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(preset: str, tokens: int, block_size: int, repeats: int) -> dict:
    cfg = PRESETS[preset]()
    num_pages = tokens // block_size
    cache = init_cache(cfg, num_blocks=num_pages + 1, block_size=block_size, num_slots=2)
    mesh = Mesh(jax.devices()[:1], ("d",))
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = jax.tree.map(lambda _: replicated, cache)
    cache = jax.device_put(cache, shardings)
    copier = HostCopier(cache, shardings, replicated, cfg)
    copier.compile(cache)
    layout = copier.layout
    blocks = list(range(1, num_pages + 1))
    held = {}

    def save():
        held["pages"] = copier.save("page", cache, blocks)
        held["slot"] = copier.save("slot", cache, [1])[0]
        jax.block_until_ready((held["pages"], held["slot"]))

    save_s = _best(save, repeats)

    def load():
        nonlocal cache
        cache = copier.load("page", cache, [(data, b) for data, b in zip(held["pages"], blocks)])
        cache = copier.load("slot", cache, [(held["slot"], 1)])
        jax.block_until_ready(cache)

    load_s = _best(load, repeats)
    item = TransferItem([HostPage(bytes([i % 256]) * 16, layout.page.nbytes, "remote", data)
                         for i, data in enumerate(held["pages"])],
                        HostCheckpoint(b"\0" * 16, (), num_pages * block_size, layout.slot.nbytes, "remote",
                                       state=held["slot"]))
    blob = {}
    encode_s = _best(lambda: blob.update(b=encode([item], layout)), repeats)
    decode_s = _best(lambda: decode(blob["b"], layout), repeats)
    nbytes = item.nbytes
    return dict(preset=preset, tokens=tokens, block_size=block_size, device=str(jax.devices()[0].device_kind),
                host_memory=str(copier.host_sharding.memory_kind), bytes=nbytes, pages=num_pages,
                page_bytes=layout.page.nbytes, slot_bytes=layout.slot.nbytes,
                save_s=save_s, save_gb_s=nbytes / save_s / 1e9, load_s=load_s, load_gb_s=nbytes / load_s / 1e9,
                encode_s=encode_s, decode_s=decode_s, wire_bytes=len(blob["b"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="kimi-linear-48b", choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.tokens < args.block_size or args.tokens % args.block_size:
        parser.error("--tokens must be a positive multiple of --block-size")
    print(json.dumps(measure(args.preset, args.tokens, args.block_size, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
