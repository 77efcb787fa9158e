"""Meshes, partition rules by parameter path, parameter/cache placement, and the memory planner.

    mesh = sharding.make_mesh(tensor=4, expert=2)          # axes ("data", "tensor", "expert", "dcp")
    sharding.shard_params(lm.model, mesh)                  # NamedSharding per rule; GSPMD partitions the forward
    print(sharding.plan_memory(get_preset("k3"), MeshShape(tensor=16), context_len=131072, batch=4).table())

What is done: the mesh, the rules (tensor-parallel projections over ``tensor x dcp``, experts over ``expert``,
vocabulary-parallel embeddings, MLA pages over ``dcp``, KDA state over heads), placement of an nnx model's
parameters and of the hybrid cache, and a planner that counts bytes from the real parameter shapes under those
rules. With ``impl="reference"`` the forward is plain XLA and the sharded model gives the unsharded logits
(tests/test_sharding.py, 8 fake CPU devices).

Not done yet:
* ``jax.shard_map`` wrappers for the Pallas kernels (KDA, MLA, MXFP4, AttnRes). XLA cannot partition a Pallas
  custom call, so with ``impl="pallas"`` on a multi-device mesh the kernels need per-shard wrappers. The KDA
  conv state would then need a head-major channel layout: today's ``[q | k | v]`` channel axis is split into
  equal contiguous pieces, which matches the per-head split in bytes but not in which channels a rank holds.
* Expert parallelism as all-to-all dispatch/combine: GSPMD partitions ``ragged_dot`` over sharded experts by
  gathering what it needs, which is correct but not the EP communication pattern.
* DCP attention: per-rank partial attention over the rank's pages merged by log-sum-exp. With pages split over
  ``dcp`` GSPMD gathers the pages a step reads instead.
* Loading a checkpoint straight into shards (the loader fills whole stacked parameters on the host first),
  data-parallel attention (requests split over ``expert`` ranks), multi-host meshes (``jax.distributed``).
"""

from sharding.mesh import AXES, MeshShape, make_mesh
from sharding.place import param_specs, shard_cache, shard_params
from sharding.planner import H200_HBM_BYTES, MemoryPlan, plan_memory, plans_table
from sharding.rules import PARAM_RULES, TP, cache_specs, fit_spec, param_spec

__all__ = ["AXES", "H200_HBM_BYTES", "MemoryPlan", "MeshShape", "PARAM_RULES", "TP", "cache_specs", "fit_spec",
           "make_mesh", "param_spec", "param_specs", "plan_memory", "plans_table", "shard_cache", "shard_params"]
