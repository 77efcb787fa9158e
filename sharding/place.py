"""Place a model's parameters and the hybrid cache on a mesh according to the partition rules.

With parameters placed, the unchanged forward (``kimi_jax.model.forward`` under ``jax.jit``) is partitioned by
GSPMD: it inserts the all-gathers / reductions the placements imply. That holds for the pure-XLA op
implementations (``impl="reference"``); Pallas kernels are opaque custom calls XLA cannot partition and need
``jax.shard_map`` wrappers (not written yet, see the package docstring).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax.model import KimiModel
from kimi_jax.step import HybridCache
from kimi_jax.weights.loader import param_leaves
from sharding.mesh import MeshShape
from sharding.rules import fit_spec, fitted_cache_specs, param_spec


def param_specs(model: KimiModel, sizes: Mapping[str, int] | MeshShape) -> dict[str, P]:
    """Parameter path -> its rule's PartitionSpec fitted to the parameter's shape on a mesh of ``sizes``.

    ``model`` may be abstract (``nnx.eval_shape``): only shapes are read."""
    sizes = sizes.sizes() if isinstance(sizes, MeshShape) else sizes
    return {path: fit_spec(param_spec(path), tuple(var.shape), sizes) for path, var in param_leaves(model).items()}


def shard_params(model: KimiModel, mesh: Mesh) -> KimiModel:
    """Move every parameter of ``model`` to ``mesh`` with its fitted spec (in place); returns ``model``."""
    specs = param_specs(model, MeshShape.of(mesh))
    for path, var in param_leaves(model).items():
        var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, specs[path])))
    return model


def shard_cache(cache: HybridCache, mesh: Mesh) -> HybridCache:
    """The cache's pools placed on ``mesh`` with their fitted specs."""
    specs = fitted_cache_specs(cache, MeshShape.of(mesh).sizes())
    return HybridCache(**{name: jax.device_put(pool, NamedSharding(mesh, getattr(specs, name)))
                          for name, pool in cache.pools().items()})
