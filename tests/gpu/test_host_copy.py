"""The host tier's copies on the GPU: MLA pages and KDA slots saved into pinned host memory and loaded back into
other rows of the donated pools, bit for bit (a copy has no tolerance). The CPU has no separate host memory, so
only this test sees the GPU compiler's rules for host-memory operands."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kimi_jax.presets import PRESETS
from kimi_jax.step import init_cache
from serve.engine.host_copy import HostCopier


def _random_cache(cfg, num_blocks: int, block_size: int, num_slots: int, seed: int):
    cache = init_cache(cfg, num_blocks=num_blocks, block_size=block_size, num_slots=num_slots)
    rng = np.random.default_rng(seed)
    pools = {name: jnp.asarray(rng.standard_normal(pool.shape), pool.dtype) for name, pool in cache.pools().items()}
    return dataclasses.replace(cache, **pools)


@pytest.mark.kernel("host tier copies")
@pytest.mark.parametrize("preset", ["tiny", "kimi-linear-48b"])
def test_save_load_round_trip(preset, check):
    cfg = PRESETS[preset]()
    mesh = Mesh(jax.devices()[:1], ("d",))
    replicated = NamedSharding(mesh, PartitionSpec())
    cache = _random_cache(cfg, num_blocks=48, block_size=16, num_slots=4, seed=0)
    shardings = jax.tree.map(lambda _: replicated, cache)
    cache = jax.device_put(cache, shardings)
    copier = HostCopier(cache, shardings, replicated, cfg)
    copier.compile(cache)
    assert copier.host_sharding.memory_kind == "pinned_host"

    pages = list(range(1, 22))  # 21 pages: chunks of 16, 4 and 1
    saved_pages = copier.save("page", cache, pages)
    saved_slot = copier.save("slot", cache, [1])[0]
    assert all(a.sharding.memory_kind == "pinned_host" for entry in saved_pages for a in entry)
    want = jax.tree.map(np.asarray, cache.pools())
    destinations = list(range(24, 45))
    cache = copier.load("page", cache, list(zip(saved_pages, destinations)))
    cache = copier.load("slot", cache, [(saved_slot, 3)])
    got = jax.tree.map(np.asarray, cache.pools())

    differing = 0
    for name in got:
        if name.startswith("mla"):
            differing += int(np.sum(got[name][:, destinations] != want[name][:, pages]))
            differing += int(np.sum(got[name][:, :24] != want[name][:, :24]))  # the rest untouched
        else:
            differing += int(np.sum(got[name][:, 3] != want[name][:, 1]))
            differing += int(np.sum(got[name][:, :3] != want[name][:, :3]))
    check(f"{preset} elements differing after save + load", differing, 0)
