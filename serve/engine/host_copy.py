"""HostCopier: fixed-shape executables that copy whole MLA pages and KDA slots between the device pools and
host memory, one array per pool and entry.

A page entry is one array ``[L_mla, block_size, ...]`` per page pool (``mla``, and ``mla_scales`` for an fp8
cache); a slot entry one array ``[L_kda, ...]`` per slot pool (``kda_state``, ``kda_conv``). Saves write their
outputs straight into pinned host memory (``memory_kind="pinned_host"``: the device->host DMA is part of the
executable, so a save is dispatched like any step and the host never waits for it); loads copy pinned host
arrays (or numpy) to the device first (an asynchronous ``device_put``: XLA's GPU compiler rejects a scatter
whose operand lives in host memory) and scatter them into the donated pools. Every executable is compiled once, at start-up:
pages move in chunks of ``PAGE_CHUNKS`` (a count is split greedily into them, so nothing is padded), slots
one at a time (a K3 slot is ~414 MiB). Entries of one save are separate
buffers, so the host tier frees them one by one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kimi_jax.step import HybridCache

PAGE_CHUNKS = (16, 4, 1)
"""Pages per launch of the page executables (largest first)."""
SLOT_CHUNK = 1


@dataclasses.dataclass(frozen=True)
class EntryLayout:
    """The arrays of one page or slot entry: pool names, shapes without the entry axis, dtype names."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in zip(self.shapes, self.dtypes))

    def structs(self, sharding) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=sharding) for s, d in zip(self.shapes, self.dtypes))


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """What a page and a slot entry hold for one engine; two engines may exchange entries iff layouts are equal."""

    block_size: int
    page: EntryLayout
    slot: EntryLayout
    model: str  # fingerprint of the model configuration

    @classmethod
    def of(cls, cache: HybridCache, model_config) -> "CacheLayout":
        def entry(names):
            names = tuple(names)
            return EntryLayout(names, tuple(pools[n].shape[:1] + pools[n].shape[2:] for n in names),
                               tuple(str(pools[n].dtype) for n in names))

        pools = cache.pools()
        config = json.dumps(dataclasses.asdict(model_config), sort_keys=True, default=str)
        return cls(cache.block_size, entry(n for n in pools if n.startswith("mla")),
                   entry(n for n in pools if n.startswith("kda")),
                   hashlib.blake2b(config.encode(), digest_size=8).hexdigest())


def _gather(names: tuple[str, ...], count: int, cache: HybridCache, ids: jax.Array) -> tuple:
    """ids [count] -> count entries, each a tuple of ``pool[:, id]`` over ``names``."""
    pools = cache.pools()
    return tuple(tuple(pools[n][:, ids[i]] for n in names) for i in range(count))


def _scatter(names: tuple[str, ...], cache: HybridCache, ids: jax.Array, entries: tuple) -> HybridCache:
    """Write entry i into row ``ids[i]`` of each pool (out-of-range ids are padding, dropped)."""
    pools = cache.pools()
    new = {n: pools[n].at[:, ids].set(jnp.stack([e[k] for e in entries], axis=1), mode="drop")
           for k, n in enumerate(names)}
    return dataclasses.replace(cache, **new)


class HostCopier:
    """The save / load executables of one runner's cache (``compile`` before the first call)."""

    def __init__(self, cache: HybridCache, cache_shardings, device_sharding: NamedSharding, model_config):
        self.layout = CacheLayout.of(cache, model_config)
        memories = {m.kind for m in device_sharding.mesh.devices.flat[0].addressable_memories()}
        self.host_sharding = device_sharding.with_memory_kind("pinned_host") if "pinned_host" in memories \
            else device_sharding
        self._device_sharding = device_sharding
        self._cache_shardings = cache_shardings
        self._save: dict[tuple[str, int], jax.stages.Compiled] = {}
        self._load: dict[tuple[str, int], jax.stages.Compiled] = {}

    @property
    def num_executables(self) -> int:
        return len(self._save) + len(self._load)

    def compile(self, cache: HybridCache) -> None:
        """Compile every save and load executable for ``cache``'s shapes."""
        for kind, chunks in (("page", PAGE_CHUNKS), ("slot", (SLOT_CHUNK,))):
            entry = self._entry(kind)
            for count in chunks:
                ids = jax.ShapeDtypeStruct((count,), jnp.int32, sharding=self._device_sharding)
                out = tuple(tuple(self.host_sharding for _ in entry.names) for _ in range(count))
                self._save[kind, count] = jax.jit(partial(_gather, entry.names, count), out_shardings=out).lower(
                    cache, ids).compile()
                entries = tuple(entry.structs(self._device_sharding) for _ in range(count))
                self._load[kind, count] = jax.jit(partial(_scatter, entry.names), donate_argnums=(0,),
                                                  out_shardings=self._cache_shardings).lower(
                    cache, ids, entries).compile()

    def save(self, kind: str, cache: HybridCache, ids: list[int]) -> list[tuple]:
        """Host copies of pages (``kind="page"``) or slots ``ids``: one tuple of arrays per id, in order;
        the copies are queued, not waited for."""
        out = []
        for start, count in self._chunks(kind, len(ids)):
            chunk = ids[start:start + count]
            out.extend(self._save[kind, count](cache, np.asarray(chunk, np.int32)))
        return out

    def load(self, kind: str, cache: HybridCache, items: list[tuple[tuple, int]]) -> HybridCache:
        """Write host entries into pages / slots: ``items`` = (entry arrays, destination id); returns the cache."""
        for start, count in self._chunks(kind, len(items)):
            chunk = items[start:start + count]
            ids = np.asarray([dst for _, dst in chunk], np.int32)
            entries = jax.device_put(tuple(data for data, _ in chunk), self._device_sharding)
            cache = self._load[kind, count](cache, ids, entries)
        return cache

    def to_host(self, kind: str, arrays: tuple) -> tuple:
        """Host arrays received from elsewhere (numpy), placed where the load executables read them."""
        entry = self._entry(kind)
        return tuple(jax.device_put(np.asarray(a, jnp.dtype(d)), self.host_sharding)
                     for a, d in zip(arrays, entry.dtypes))

    def _entry(self, kind: str) -> EntryLayout:
        return self.layout.page if kind == "page" else self.layout.slot

    def _chunks(self, kind: str, n: int) -> list[tuple[int, int]]:
        """(start, size) launches covering n entries: the largest chunks first."""
        sizes = PAGE_CHUNKS if kind == "page" else (SLOT_CHUNK,)
        out, start = [], 0
        for size in sizes:
            while n - start >= size:
                out.append((start, size))
                start += size
        return out
