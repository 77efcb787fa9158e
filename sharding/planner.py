"""Memory planner: per-device bytes of a model on a mesh, and how many requests / tokens the rest holds.

Weights are counted from the model's real parameter shapes (``nnx.eval_shape``, nothing allocated) with the
partition rules applied (``sharding.rules``), so the plan and the placement can never disagree. The caches use
the cache specs: KDA state split over heads on ``tensor x dcp``, MLA pages split over ``dcp`` (blocks striped
over the DCP ranks) and replicated over ``tensor``.

Per device: ``budget = hbm_bytes * memory_utilization - workspace_bytes - weights``; one request at context
``c`` costs ``kda_state + c * mla_per_token``. Attention and caches are replicated over the ``expert`` axis
(no data-parallel attention), so one replica (``tensor x expert x dcp`` devices) serves what one device holds,
and the mesh serves ``data`` times that.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.config import ModelConfig
from kimi_jax.model import KimiModel
from kimi_jax.step import init_cache
from kimi_jax.weights.loader import param_leaves
from sharding.mesh import MeshShape
from sharding.rules import fit_spec, fitted_cache_specs, param_spec, shard_factor

GiB = 1 << 30
MiB = 1 << 20
H200_HBM_BYTES = 143771 * MiB
"""HBM of one H200 as nvidia-smi reports it (141 GB class)."""

WEIGHT_KINDS = ("embed + lm_head", "KDA", "MLA", "dense MLP", "MoE routed experts", "MoE shared/latent/router",
                "norms + AttnRes")


def weight_kind(path: str) -> str:
    """The row of the weights table a parameter path is counted in."""
    top = path.split(".")[0]
    if top in ("embed", "lm_head"):
        return "embed + lm_head"
    if top == "moe":
        routed = re.fullmatch(r"moe\.w[123](_packed|_pairs|_words|_scale|_mgpu|_mgpu_scale)?", path)
        return "MoE routed experts" if routed else "MoE shared/latent/router"
    return {"kda": "KDA", "mla": "MLA", "dense_mlp": "dense MLP"}.get(top, "norms + AttnRes")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory of one model on one mesh (bytes unless named otherwise).

    weights              per-device weight bytes by :data:`WEIGHT_KINDS`
    model_bytes          the unsharded model (all parameters once)
    kda_state_per_request  recurrent + conv state of one request, all KDA layers, on one device
    mla_per_token        MLA latent cache of one token, all MLA layers, on one device
    cache_budget         bytes left for both pools on one device (negative: the weights do not fit)
    max_requests         requests of ``context_len`` tokens that fit at once (per replica)
    max_context_at_batch longest context each of ``batch`` concurrent requests can have
    kv_tokens_at_batch   MLA tokens one device holds after reserving ``batch`` KDA states
    replicated           parameters whose rule was cut down because an axis did not divide them
    """

    model_name: str
    mesh: MeshShape
    weight_dtype: str
    kv_dtype: str
    state_dtype: str
    context_len: int
    batch: int
    hbm_bytes: int
    usable_bytes: int
    weights: dict[str, int]
    model_bytes: int
    kda_state_per_request: int
    mla_per_token: int
    cache_budget: int
    max_requests: int
    max_context_at_batch: int
    kv_tokens_at_batch: int
    replicated: tuple[str, ...]

    @property
    def weights_per_device(self) -> int:
        return sum(self.weights.values())

    @property
    def fits(self) -> bool:
        """The weights fit and ``batch`` requests of ``context_len`` tokens fit at once."""
        return self.max_requests >= self.batch

    @property
    def max_requests_on_mesh(self) -> int:
        return self.max_requests * self.mesh.data

    def table(self) -> str:
        """A two-column text table of the plan."""
        m = self.mesh
        rows = [("model", f"{self.model_name} ({self.model_bytes / GiB:,.1f} GiB unsharded)"),
                ("mesh", f"{m.label()} = {m.num_devices} devices {m.sizes()}"),
                ("dtypes", f"weights {self.weight_dtype} (MXFP4 experts stay packed), MLA cache {self.kv_dtype}, "
                           f"KDA state {self.state_dtype}")]
        rows += [(f"weights: {k}", _gib(v)) for k, v in self.weights.items() if v]
        rows += [("weights per device", _gib(self.weights_per_device)),
                 ("usable HBM per device", f"{_gib(self.usable_bytes)} of {_gib(self.hbm_bytes)}"),
                 ("cache budget per device", _gib(self.cache_budget)),
                 ("KDA state per request", f"{self.kda_state_per_request / MiB:,.2f} MiB"),
                 ("MLA cache per token", f"{self.mla_per_token / 1024:,.2f} KiB"),
                 (f"max requests at {self.context_len:,} tokens",
                  f"{self.max_requests:,} per replica, {self.max_requests_on_mesh:,} on the mesh"),
                 (f"max context at batch {self.batch}", f"{self.max_context_at_batch:,} tokens"),
                 (f"MLA tokens per device at batch {self.batch}", f"{self.kv_tokens_at_batch:,}")]
        if self.replicated:
            rows.append(("split less than the rule asks", ", ".join(self.replicated)))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f} GiB"


def _dtype_bytes(name: str) -> int:
    try:
        return jnp.dtype(name).itemsize
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}") from None


def _abstract_model(cfg: ModelConfig, weight_dtype: str) -> KimiModel:
    return nnx.eval_shape(lambda: KimiModel(cfg, dtype=jnp.dtype(weight_dtype), rngs=nnx.Rngs(0)))


def plan_memory(cfg: ModelConfig, mesh: MeshShape, *, context_len: int, batch: int, model_name: str = "model",
                weight_dtype: str = "bfloat16", kv_dtype: str = "bfloat16", state_dtype: str = "float32",
                hbm_bytes: int = H200_HBM_BYTES, memory_utilization: float = 0.9,
                workspace_bytes: int = 4 * GiB) -> MemoryPlan:
    """Plan one model on one mesh.

    Args:
      cfg: the architecture (e.g. ``kimi_jax.get_preset("k3")``).
      mesh: axis sizes (no devices needed).
      context_len: tokens per request (prompt + output) the request count is computed for.
      batch: concurrent requests the per-request context is computed for.
      weight_dtype / kv_dtype / state_dtype: parameter, MLA page and KDA state dtypes (dtype names; the conv
        state is fp32 as in ``kimi_jax.step.init_cache``).
      hbm_bytes, memory_utilization: device memory and the fraction the process may use (vLLM's 0.9).
      workspace_bytes: activations and compiler scratch kept free (the engine's ``activation_reserve_bytes``).
    """
    if context_len < 1 or batch < 1:
        raise ValueError(f"context_len and batch must be >= 1, got {context_len}, {batch}")
    sizes = mesh.sizes()
    weights = dict.fromkeys(WEIGHT_KINDS, 0)
    model_bytes = 0
    replicated = []
    for path, var in param_leaves(_abstract_model(cfg, weight_dtype)).items():
        shape = tuple(var.shape)
        nbytes = math.prod(shape) * jnp.dtype(var.dtype).itemsize
        rule = param_spec(path, mesh.expert_parallel)
        spec = fit_spec(rule, shape, sizes)
        if shard_factor(spec, sizes) < shard_factor(rule, sizes):
            replicated.append(path)
        weights[weight_kind(path)] += nbytes // shard_factor(spec, sizes)
        model_bytes += nbytes

    pools = jax.eval_shape(lambda: init_cache(cfg, num_blocks=1, block_size=1, num_slots=1,
                                              dtype=jnp.dtype(kv_dtype), state_dtype=jnp.dtype(state_dtype)))
    cache_spec = fitted_cache_specs(pools, sizes)
    state = sum(math.prod(a.shape) * a.dtype.itemsize // shard_factor(s, sizes)
                for a, s in ((pools.kda_state, cache_spec.kda_state), (pools.kda_conv, cache_spec.kda_conv)))
    scale_bytes = 4 if pools.fp8 else 0  # an fp8 cache's per-token f32 scale
    per_token = len(cfg.mla_layers) * (cfg.mla_cache_width * _dtype_bytes(kv_dtype) + scale_bytes) / mesh.dcp

    usable = int(hbm_bytes * memory_utilization) - workspace_bytes
    budget = usable - sum(weights.values())
    per_request = state + context_len * per_token
    max_requests = max(0, int(budget // per_request)) if per_request else 0
    left_at_batch = budget - batch * state
    kv_tokens = max(0, int(left_at_batch // per_token)) if per_token else 0
    return MemoryPlan(
        model_name=model_name, mesh=mesh, weight_dtype=weight_dtype, kv_dtype=kv_dtype, state_dtype=state_dtype,
        context_len=context_len, batch=batch, hbm_bytes=hbm_bytes, usable_bytes=usable, weights=weights,
        model_bytes=model_bytes, kda_state_per_request=int(state), mla_per_token=int(math.ceil(per_token)),
        cache_budget=int(budget), max_requests=max_requests, max_context_at_batch=kv_tokens // batch,
        kv_tokens_at_batch=kv_tokens, replicated=tuple(replicated))


def plans_table(plans: list[MemoryPlan]) -> str:
    """One row per plan: mesh, weights, budget, per-request and per-token cache, capacities (per device)."""
    head = ("model", "mesh", "dev", "weights/dev", "budget/dev", "KDA state/req", "MLA/token",
            "max req", "ctx", "max ctx @ batch")
    rows = [head]
    for p in plans:
        rows.append((p.model_name, p.mesh.label(), str(p.mesh.num_devices), _gib(p.weights_per_device),
                     _gib(p.cache_budget), f"{p.kda_state_per_request / MiB:,.1f} MiB",
                     f"{p.mla_per_token / 1024:,.2f} KiB", f"{p.max_requests_on_mesh:,}", f"{p.context_len:,}",
                     f"{p.max_context_at_batch:,} @ {p.batch}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
