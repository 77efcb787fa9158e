"""The vision encoder on the device: one ahead-of-time compiled executable per patch bucket, writing the merged
tokens of up to ``batch`` images per launch into rows of the media pool (``HybridCache.media``).

Buckets: B = ``batch`` images of L patches each, L from a powers-of-4 ladder starting at 64 and ending at the
tower's ``max_patches``. An image goes to the smallest bucket that holds it; the images of one step are encoded
together, fewest launches first (each launch fills its B lanes). Unused lanes and padding tokens write to row 0,
which no step reads. The cache is donated, so the pool is updated in place and ordered with the steps.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.step import HybridCache
from kimi_jax.vision.preprocess import PreparedImage
from kimi_jax.vision.tower import ImageBatch, VisionModel, encode_images, pack_images


def patch_buckets(max_patches: int, smallest: int = 64) -> tuple[int, ...]:
    """L sizes: smallest, 4x, 16x ... below ``max_patches``, then ``max_patches``."""
    sizes, size = [], smallest
    while size < max_patches:
        sizes.append(size)
        size *= 4
    return tuple(sizes + [max_patches])


def _encode(graphdef, attention, params, cache: HybridCache, batch: ImageBatch, dest: jax.Array) -> HybridCache:
    """dest [B, L/4] int32: the pool row of each merged token (0 for padding)."""
    out = encode_images(nnx.merge(graphdef, params), batch, attention)
    media = cache.media.at[dest.reshape(-1)].set(out.reshape(-1, out.shape[-1]).astype(cache.media.dtype))
    return dataclasses.replace(cache, media=media)


class VisionEncoder:
    """Compiled encoder executables of one vision tower (parameters replicated over ``sharding``'s mesh);
    ``attention``: see ``kimi_jax.vision.tower.encode_tower``."""

    def __init__(self, vision: VisionModel, batch: int, sharding, *, attention: str | None = None):
        self.config = vision.config
        self.batch = batch
        self.buckets = patch_buckets(self.config.max_patches)
        graphdef, state = nnx.split(vision)
        self._graphdef = graphdef
        self._attention = attention
        self._params = jax.device_put(state, sharding)
        self._sharding = sharding
        self._compiled: dict[int, jax.stages.Compiled] = {}
        self.launches = 0

    def lower(self, cache: HybridCache, cache_shardings) -> dict[tuple, jax.stages.Lowered]:
        """Lowered executables keyed ("encode", L)."""
        fn = jax.jit(partial(_encode, self._graphdef, self._attention), donate_argnums=(1,),
                     out_shardings=cache_shardings)
        lowered = {}
        for size in self.buckets:
            batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._sharding),
                                 pack_images([], self.batch, size, self.config))
            dest = jax.ShapeDtypeStruct((self.batch, size // 4), jnp.int32, sharding=self._sharding)
            lowered[("encode", size)] = fn.lower(self._params, cache, batch, dest)
        return lowered

    def set_compiled(self, compiled: dict[tuple, jax.stages.Compiled]) -> None:
        self._compiled = {key[1]: compiled.pop(key) for key in list(compiled) if key[0] == "encode"}

    @property
    def num_executables(self) -> int:
        return len(self._compiled)

    def run_once(self, cache: HybridCache) -> HybridCache:
        """Run every bucket on an all-padding batch (writes only row 0), so one that cannot run fails at start."""
        for size in self.buckets:
            cache = self._launch(cache, size, [])
        return cache

    def encode(self, cache: HybridCache, items: Sequence[tuple[PreparedImage, Sequence[int]]]) -> HybridCache:
        """Encode ``(image, pool rows of its merged tokens)`` pairs into the pool; -> the new cache."""
        by_bucket: dict[int, list] = {}
        for image, rows in items:
            size = next(s for s in self.buckets if s >= image.num_patches)
            by_bucket.setdefault(size, []).append((image, rows))
        for size, group in sorted(by_bucket.items()):
            for i in range(0, len(group), self.batch):
                cache = self._launch(cache, size, group[i:i + self.batch])
        return cache

    def _launch(self, cache: HybridCache, size: int, group: list) -> HybridCache:
        batch = pack_images([image for image, _ in group], self.batch, size, self.config)
        dest = np.zeros((self.batch, size // 4), np.int32)
        for lane, (_, rows) in enumerate(group):
            dest[lane, :len(rows)] = rows
        self.launches += 1
        return self._compiled[size](self._params, cache, batch, dest)
