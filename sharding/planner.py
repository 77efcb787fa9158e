"""Memory planner: per-device bytes of a model on a mesh, and how many requests / tokens the rest holds.

    python -m sharding.planner --model k3 --gpus 8 --gpu-memory-gib 268 --context 120000
    python -m sharding.planner --model k3 --gpus 16 --gpu-memory-gib 134 --context 131072 --batch 4 --json

The CLI enumerates every layout of the GPUs (``--tensor-parallel-size`` t of them per replica, a DCP group
dividing t, with and without ``--enable-expert-parallel``, the rest as data-parallel replicas), and prints which
fit, the weights per device, and the cache capacity in tokens and in requests of ``--context`` tokens (KDA state
included) for the whole deployment, largest capacity first.

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
from sharding.layout import ParallelConfig, layout_problems
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

    @property
    def kv_tokens_on_mesh(self) -> int:
        """MLA cache capacity in tokens of all replicas after reserving ``batch`` KDA states per replica."""
        return self.kv_tokens_at_batch * self.mesh.data

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
                 (f"MLA cache capacity at batch {self.batch}",
                  f"{self.kv_tokens_at_batch:,} tokens per replica (each device holds 1/{m.dcp} of each), "
                  f"{self.kv_tokens_on_mesh:,} on the mesh")]
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


def layout_plans(cfg: ModelConfig, gpus: int, *, context_len: int, batch: int = 1, **plan_args) -> list[dict]:
    """Every layout of ``gpus`` devices (see the module docstring): one dict per layout with its ``ParallelConfig``
    (``layout``), its plan (``plan``, None when the model cannot be split so) and ``problems`` (why not)."""
    rows = []
    for t in [n for n in range(1, gpus + 1) if gpus % n == 0]:
        for d in [n for n in range(1, t + 1) if t % n == 0]:
            for ep in (False, True) if cfg.moe_layers else (False,):
                pc = ParallelConfig(tensor_parallel_size=t, decode_context_parallel_size=d,
                                    enable_expert_parallel=ep, data_parallel_size=gpus // t)
                problems = layout_problems(cfg, pc)
                shape = dataclasses.replace(pc.replica_shape(), data=pc.num_replicas)
                plan = None if problems else plan_memory(cfg, shape, context_len=context_len, batch=batch,
                                                         **plan_args)
                rows.append(dict(layout=pc, plan=plan, problems=problems))
    return sorted(rows, key=lambda r: (r["plan"] is None, not (r["plan"] and r["plan"].fits),
                                       -(r["plan"].kv_tokens_on_mesh if r["plan"] else 0)))


def layouts_table(rows: list[dict]) -> str:
    head = ("layout", "flags", "fits", "weights/dev", "budget/dev", "KDA state/req", "MLA/token/dev",
            "cache tokens", "requests @ ctx")
    table = [head]
    for r in rows:
        pc, plan = r["layout"], r["plan"]
        if plan is None:
            table.append((pc.label(), pc.flags(), "no: " + r["problems"][0], "", "", "", "", "", ""))
            continue
        table.append((pc.label(), pc.flags(), "yes" if plan.fits else "no: memory", _gib(plan.weights_per_device),
                      _gib(plan.cache_budget), f"{plan.kda_state_per_request / MiB:,.1f} MiB",
                      f"{plan.mla_per_token:,} B", f"{plan.kv_tokens_on_mesh:,}", f"{plan.max_requests_on_mesh:,}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def suggest_layouts(cfg: ModelConfig, num_devices: int, *, hbm_bytes: int | None = None, context_len: int = 4096,
                    batch: int = 1, weight_dtype: str = "bfloat16", kv_dtype: str = "bfloat16",
                    memory_utilization: float = 0.9, limit: int = 8) -> list[ParallelConfig]:
    """Layouts using all ``num_devices`` devices that split the model exactly (and fit ``batch`` requests of
    ``context_len`` tokens in ``hbm_bytes`` per device when given): the largest tensor-parallel group first, then
    fewer DCP ranks, then without expert parallelism (its DP ranks join the expert group)."""
    found = []
    for t in [n for n in range(num_devices, 0, -1) if num_devices % n == 0]:
        for d in [n for n in range(1, t + 1) if t % n == 0]:
            for ep in (False, True):
                pc = ParallelConfig(tensor_parallel_size=t, decode_context_parallel_size=d, enable_expert_parallel=ep,
                                    data_parallel_size=num_devices // t)
                if (ep and not cfg.moe_layers) or layout_problems(cfg, pc):
                    continue
                if hbm_bytes is not None:
                    plan = plan_memory(cfg, pc.replica_shape(), context_len=context_len, batch=batch,
                                       weight_dtype=weight_dtype, kv_dtype=kv_dtype, hbm_bytes=hbm_bytes,
                                       memory_utilization=memory_utilization)
                    if not plan.fits:
                        continue
                found.append(pc)
    return found[:limit]


def _suggestion(cfg: ModelConfig, num_devices: int, **memory) -> str:
    fits = suggest_layouts(cfg, num_devices, **memory)
    if not fits:
        return f" No layout of {num_devices} devices fits this model."
    return (f" Layouts that fit {num_devices} devices (sharding.planner): "
            + "; ".join(f"{pc.label()} ({pc.flags()})" for pc in fits) + ".")


def validate_layout(cfg: ModelConfig, pc: ParallelConfig, *, num_devices: int, hbm_bytes: int | None = None,
                    context_len: int | None = None, weight_dtype: str = "bfloat16", kv_dtype: str = "bfloat16",
                    memory_utilization: float = 0.9) -> MeshShape:
    """The replica mesh shape of ``pc``, or ValueError with the reason and the planner's suggested layouts.

    Checks: the dimensions every axis splits (heads, experts, FFN widths, latent width), the device count
    (``tensor x data <= num_devices``), and, with ``hbm_bytes``, that the weights and one request of
    ``context_len`` tokens fit each device (``sharding.planner.plan_memory``)."""
    memory = dict(hbm_bytes=hbm_bytes, context_len=context_len or 4096, weight_dtype=weight_dtype,
                  kv_dtype=kv_dtype, memory_utilization=memory_utilization)
    problems = layout_problems(cfg, pc)
    if problems:
        raise ValueError(f"{pc.flags()}: " + "; ".join(problems) + "." + _suggestion(cfg, num_devices, **memory))
    if pc.num_devices > num_devices:
        raise ValueError(f"{pc.flags()} needs {pc.num_devices} devices (tensor {pc.tensor_parallel_size} x data "
                         f"{pc.data_parallel_size}), only {num_devices} are visible."
                         + _suggestion(cfg, num_devices, **memory))
    shape = pc.replica_shape()
    if hbm_bytes is not None:
        plan = plan_memory(cfg, shape, context_len=memory["context_len"], batch=1, weight_dtype=weight_dtype,
                           kv_dtype=kv_dtype, hbm_bytes=hbm_bytes, memory_utilization=memory_utilization)
        if not plan.fits:
            raise ValueError(f"{pc.flags()}: the model does not fit {pc.label()} on devices of "
                             f"{hbm_bytes / GiB:.0f} GiB: weights {plan.weights_per_device / GiB:.1f} GiB per device, "
                             f"cache budget {plan.cache_budget / GiB:.1f} GiB for one request of "
                             f"{memory['context_len']:,} tokens." + _suggestion(cfg, num_devices, **memory))
    return shape


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os

    from kimi_jax.presets import PRESETS, get_preset

    parser = argparse.ArgumentParser(prog="python -m sharding.planner",
                                     description="Which layouts of a model fit a set of GPUs, and what they hold.")
    parser.add_argument("--model", default="k3", help=f"a preset ({', '.join(sorted(PRESETS))}) or a checkpoint "
                                                      "folder with config.json")
    parser.add_argument("--gpus", type=int, required=True, help="devices in the deployment")
    parser.add_argument("--gpu-memory-gib", type=float, default=H200_HBM_BYTES / GiB,
                        help="HBM per device in GiB (default: an H200's 140.4)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of HBM usable (vLLM's)")
    parser.add_argument("--workspace-gib", type=float, default=4.0, help="activations and compiler scratch per device")
    parser.add_argument("--context", type=int, default=131072, help="tokens per request (prompt + output)")
    parser.add_argument("--batch", type=int, default=1, help="concurrent requests whose KDA state is reserved")
    parser.add_argument("--weight-dtype", default="bfloat16", help="non-expert weights (MXFP4 experts stay packed)")
    parser.add_argument("--kv-dtype", default="bfloat16", help="MLA cache dtype (float8_e4m3fn: fp8 pages)")
    parser.add_argument("--state-dtype", default="float32", help="KDA recurrent state dtype")
    parser.add_argument("--only-fitting", action="store_true", help="list only the layouts that fit")
    parser.add_argument("--json", action="store_true", help="one JSON object per layout instead of a table")
    args = parser.parse_args(argv)
    if os.path.isdir(args.model):
        cfg = ModelConfig.from_json_file(os.path.join(args.model, "config.json"))
    else:
        cfg = get_preset(args.model)
    rows = layout_plans(cfg, args.gpus, context_len=args.context, batch=args.batch, model_name=args.model,
                        weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype, state_dtype=args.state_dtype,
                        hbm_bytes=int(args.gpu_memory_gib * GiB), memory_utilization=args.gpu_memory_utilization,
                        workspace_bytes=int(args.workspace_gib * GiB))
    if args.only_fitting:
        rows = [r for r in rows if r["plan"] is not None and r["plan"].fits]
    if args.json:
        for r in rows:
            plan = r["plan"]
            print(json.dumps(dict(
                layout=r["layout"].label(), flags=r["layout"].flags(), fits=bool(plan and plan.fits),
                problems=r["problems"], weights_per_device=plan and plan.weights_per_device,
                cache_budget_per_device=plan and plan.cache_budget,
                kda_state_per_request=plan and plan.kda_state_per_request,
                mla_bytes_per_token_per_device=plan and plan.mla_per_token,
                cache_tokens=plan and plan.kv_tokens_on_mesh, requests_at_context=plan and plan.max_requests_on_mesh)))
        return 0
    print(f"{args.model} on {args.gpus} x {args.gpu_memory_gib:g} GiB at {args.gpu_memory_utilization:g} utilisation; "
          f"requests of {args.context:,} tokens, KDA state reserved for {args.batch} per replica")
    print(layouts_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
