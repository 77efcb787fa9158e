"""Meshes, partition rules by parameter path, shard_map pieces, layouts from vLLM's flags, and the memory planner.

    pc = ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=8)    # the flags of `vllm serve`
    shape = validate_layout(cfg, pc, num_devices=8, hbm_bytes=...)                 # refused with suggestions
    mesh = replica_meshes(pc)[0]                                                   # ("data", "tensor", "expert", "dcp")
    shard_params(model, mesh)                                                      # NamedSharding per rule
    hidden, cache = forward(model, cache, step, parallel=Parallel(mesh))           # sublayers in jax.shard_map
    python -m sharding.planner --model k3 --gpus 16 --context 131072               # which layouts fit

* ``mesh``: the four axes and ``MeshShape`` (``expert_parallel``: experts over the whole replica).
* ``rules``: parameter path -> PartitionSpec (TP over ``tensor x dcp``, experts over ``expert`` or the whole
  replica, vocabulary-parallel embeddings), cache specs (MLA pages over ``dcp``, KDA state over heads).
* ``place``: parameters and pools onto a mesh (the KDA conv re-laid rank-major for the shard_map path).
* ``parallel``: ``Parallel``, every sublayer inside ``jax.shard_map`` with per-shard shapes and explicit collectives,
  for the Pallas kernels and the reference ops alike; ``dcp``: MLA decode context parallelism (per-rank partial
  attention over the rank's pages, merged by log-sum-exp); ``moe_ep``: expert parallelism by all-to-all dispatch
  and combine of latent-width rows.
* ``layout``: ``ParallelConfig`` (the serve flags), the dimensions a layout must divide, replica meshes,
  ``jax.distributed`` start.
* ``planner``: per-device memory of a model on a layout and the cache capacity in tokens and requests; start-up
  validation (``validate_layout``) with suggested layouts; the ``python -m sharding.planner`` CLI.
* ``experiments/decode_layouts.py``: times a decode step per layout and its collectives.

Without ``parallel`` the forward on placed parameters is partitioned by GSPMD (pure-XLA ops only).
"""

from sharding.layout import ParallelConfig, layout_problems, replica_meshes
from sharding.mesh import AXES, MeshShape, make_mesh
from sharding.parallel import Parallel, parallel_for
from sharding.place import param_specs, shard_cache, shard_params
from sharding.rules import PARAM_RULES, TP, cache_specs, fit_spec, param_spec

__all__ = ["AXES", "H200_HBM_BYTES", "MemoryPlan", "MeshShape", "PARAM_RULES", "Parallel", "ParallelConfig", "TP",
           "cache_specs", "fit_spec", "layout_problems", "make_mesh", "param_spec", "param_specs", "parallel_for",
           "plan_memory", "plans_table", "replica_meshes", "shard_cache", "shard_params", "suggest_layouts",
           "validate_layout"]

_PLANNER = ("H200_HBM_BYTES", "MemoryPlan", "plan_memory", "plans_table", "suggest_layouts", "validate_layout")


def __getattr__(name: str):
    """The planner's names, imported on first use so that ``python -m sharding.planner`` runs it once, as main."""
    if name in _PLANNER:
        from sharding import planner
        return getattr(planner, name)
    raise AttributeError(f"module 'sharding' has no attribute {name!r}")
