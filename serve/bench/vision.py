"""Vision encoder throughput (images/s) with random weights at a tower's shape, through the engine's encoder
executable (tower + projector + the write into the media pool; ``serve.engine.encoder``).

    python -m serve.bench.vision                      # K3's tower: 27 blocks, hidden 1024, 12 x 128 heads
    python -m serve.bench.vision --layers 2 --hidden 64 --heads 4 --head-dim 16 --intermediate 128 \
        --text-hidden 64 --grid 8 --batch 2 --repeats 2     # a quick run on a CPU

Each configuration encodes ``batch`` images of ``grid x grid`` patches (``grid * 14`` pixels a side, grid^2 / 4
tokens each) per launch; the figure is the median of ``repeats`` timed launches after one warm-up launch.
Prints one JSON line per grid.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from kimi_jax.step import HybridCache
from kimi_jax.vision.config import VisionConfig
from kimi_jax.vision.preprocess import PreparedImage, merge_block_order
from kimi_jax.vision.tower import VisionModel
from serve.engine.encoder import VisionEncoder
from sharding import make_mesh


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--text-hidden", type=int, default=7168)
    ap.add_argument("--grid", type=int, nargs="+", default=[32, 64], help="patch grid sides (32: 448 px images)")
    ap.add_argument("--batch", type=int, default=8, help="images per launch")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--attention", choices=("xla", "cudnn"), default="xla",
                    help="jax.nn.dot_product_attention implementation (cudnn: GPU, bf16)")
    ap.add_argument("--dtype", default="bfloat16" if jax.default_backend() == "gpu" else "float32")
    return ap.parse_args(argv)


def random_image(grid: int, cfg: VisionConfig, rng: np.random.Generator) -> PreparedImage:
    order = merge_block_order(grid, grid)
    pixels = rng.standard_normal((grid * grid, cfg.patch_dim)).astype(np.float32)
    return PreparedImage(pixels, (order // grid).astype(np.int32), (order % grid).astype(np.int32), (grid, grid),
                         (grid * 14, grid * 14), b"")


def bench(args, grid: int) -> dict:
    cfg = VisionConfig(text_hidden_size=args.text_hidden, hidden_size=args.hidden, num_layers=args.layers,
                       num_heads=args.heads, head_dim=args.head_dim, intermediate_size=args.intermediate,
                       max_patches=grid * grid)
    model = VisionModel(cfg, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    mesh = make_mesh()
    replicated = NamedSharding(mesh, PartitionSpec())
    rows = 1 + args.batch * grid * grid // 4
    cache = HybridCache(mla=jnp.zeros((1, 1, 1, 1)), kda_state=jnp.zeros((1, 1, 1, 1, 1)),
                        kda_conv=jnp.zeros((1, 1, 1, 1)), media=jnp.zeros((rows, args.text_hidden), model.dtype))
    shardings = jax.tree.map(lambda _: replicated, cache)
    encoder = VisionEncoder(model, args.batch, replicated, attention=args.attention)
    start = time.perf_counter()
    lowered = encoder.lower(cache, shardings)
    encoder.set_compiled({key: lo.compile() for key, lo in lowered.items()})
    compile_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    images = [random_image(grid, cfg, rng) for _ in range(args.batch)]
    items = [(im, list(range(1 + i * im.num_tokens, 1 + (i + 1) * im.num_tokens))) for i, im in enumerate(images)]
    cache = jax.block_until_ready(encoder.encode(cache, items))  # warm-up launch
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        cache = jax.block_until_ready(encoder.encode(cache, items))
        times.append(time.perf_counter() - start)
    launch = float(np.median(times))
    params = sum(np.size(x) for x in jax.tree.leaves(nnx.state(model)))
    return dict(device=jax.devices()[0].device_kind, dtype=args.dtype, attention=args.attention, layers=args.layers, hidden=args.hidden,
                heads=args.heads, head_dim=args.head_dim, params_m=round(params / 1e6, 1), grid=grid,
                pixels=grid * 14, tokens_per_image=grid * grid // 4, batch=args.batch,
                launch_ms=round(launch * 1e3, 2), images_per_s=round(args.batch / launch, 1),
                patches_per_s=round(args.batch * grid * grid / launch), compile_s=round(compile_s, 1))


def main(argv=None) -> None:
    args = parse_args(argv)
    for grid in args.grid:
        print(json.dumps(bench(args, grid)), flush=True)


if __name__ == "__main__":
    main()
