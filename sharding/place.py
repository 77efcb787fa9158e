"""Place a model's parameters and the hybrid cache on a mesh according to the partition rules.

With parameters placed, ``kimi_jax.model.forward`` is partitioned either by GSPMD from the placements (pure-XLA
ops, ``parallel=None``) or sublayer by sublayer inside ``jax.shard_map`` (``forward(..., parallel=Parallel(mesh))``,
``sharding.parallel``; the only way the Pallas kernels run on a multi-device mesh, since XLA cannot partition a
Pallas custom call).

One parameter is re-laid for the shard_map path: the KDA depthwise conv ``kda.conv [L, C, W]`` has channels
``[q | k | v]``, each split by heads, so a contiguous TP shard of it would not hold one rank's heads. For ``t``
tensor-parallel ranks its channels are put in the rank-major order :func:`conv_channel_order` (rank r's contiguous
block is ``[q_r | k_r | v_r]``) and ``KDAStack.conv_tp`` records ``t``. The conv *state* pool needs no transform:
it is zero-initialised and written only by the layer, so under TP its channel axis simply is in that order.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax.config import ModelConfig
from kimi_jax.model import KimiModel
from kimi_jax.step import HybridCache
from kimi_jax.weights.loader import param_leaves
from sharding.mesh import MeshShape
from sharding.rules import conv_channel_order, fit_spec, fitted_cache_specs, param_spec


def param_specs(model: KimiModel, sizes: Mapping[str, int] | MeshShape) -> dict[str, P]:
    """Parameter path -> its rule's PartitionSpec fitted to the parameter's shape on a mesh of ``sizes`` (a
    MeshShape also says whether experts are split over the whole replica, ``expert_parallel``).

    ``model`` may be abstract (``nnx.eval_shape``): only shapes are read."""
    ep = isinstance(sizes, MeshShape) and sizes.expert_parallel
    sizes = sizes.sizes() if isinstance(sizes, MeshShape) else sizes
    return {path: fit_spec(param_spec(path, ep), tuple(var.shape), sizes)
            for path, var in param_leaves(model).items()}


def relayout_conv(model: KimiModel, tp: int) -> None:
    """Re-lay ``model.kda.conv`` (in place, on its devices) into the channel order of ``tp`` ranks."""
    stack = getattr(model, "kda", None)
    if stack is None or getattr(stack, "conv_tp", 1) == tp:
        return
    cfg = model.config
    back = np.argsort(conv_channel_order(cfg, stack.conv_tp))  # current layout -> [q | k | v]
    order = back[conv_channel_order(cfg, tp)]
    value = stack.conv.get_value()
    sharding = getattr(value, "sharding", None)
    moved = jax.jit(lambda w: w[:, order, :], out_shardings=sharding)(value) if sharding is not None else \
        value[:, order, :]
    stack.conv.set_value(moved)
    stack.conv_tp = tp


def place_array(value, sharding: NamedSharding) -> jax.Array:
    """``value`` (a host or single-device array that every process holds whole) placed with ``sharding``; on a
    multi-process mesh each process builds only its addressable shards."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(tuple(value.shape), sharding, lambda index: np.asarray(value[index]))


def shard_params(model: KimiModel, mesh: Mesh, *, expert_parallel: bool = False,
                 for_parallel: bool | None = None) -> KimiModel:
    """Move every parameter of ``model`` to ``mesh`` with its fitted spec (in place); returns ``model``.

    ``for_parallel`` (default: the mesh has more than one device): lay ``kda.conv`` out for the mesh's TP size,
    as ``sharding.Parallel`` needs; False keeps the ``[q | k | v]`` order for the GSPMD-only forward."""
    shape = MeshShape.of(mesh, expert_parallel=expert_parallel)
    relayout_conv(model, shape.tensor_parallel if (mesh.size > 1 if for_parallel is None else for_parallel) else 1)
    specs = param_specs(model, shape)
    for path, var in param_leaves(model).items():
        var.set_value(place_array(var.get_value(), NamedSharding(mesh, specs[path])))
    return model


def cache_shardings(cfg: ModelConfig, mesh: Mesh, **pool_sizes) -> HybridCache:
    """NamedShardings of the pools ``init_cache(cfg, **pool_sizes)`` would make, fitted to ``mesh``."""
    from kimi_jax.step import init_cache

    specs = fitted_cache_specs(jax.eval_shape(lambda: init_cache(cfg, **pool_sizes)), MeshShape.of(mesh).sizes())
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def zero_cache(cfg: ModelConfig, mesh: Mesh, **pool_sizes) -> HybridCache:
    """Zeroed pools created directly in their shards on ``mesh`` (no whole pool on one device)."""
    from kimi_jax.step import init_cache

    return jax.jit(lambda: init_cache(cfg, **pool_sizes), out_shardings=cache_shardings(cfg, mesh, **pool_sizes))()


def shard_cache(cache: HybridCache, mesh: Mesh) -> HybridCache:
    """The cache's pools placed on ``mesh`` with their fitted specs."""
    specs = fitted_cache_specs(cache, MeshShape.of(mesh).sizes())
    media = None if cache.media is None else jax.device_put(cache.media, NamedSharding(mesh, specs.media))
    return HybridCache(**{name: jax.device_put(pool, NamedSharding(mesh, getattr(specs, name)))
                          for name, pool in cache.pools().items()}, media=media)
