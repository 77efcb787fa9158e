"""Parallelism flags as ``vllm serve`` spells them -> replica meshes, start-up validation, and multi-host start.

    pc = ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=8)
    layout_problems(cfg, pc)               # dimensions the axes do not divide (empty: none)
    meshes = replica_meshes(pc)            # one mesh per data-parallel replica
    # start-up validation with memory and suggested layouts: sharding.planner.validate_layout

Flag semantics (mirroring vLLM):
* ``--tensor-parallel-size t``: the devices of one replica. Weights split over all t (KDA/MLA heads, FFN width,
  vocabulary).
* ``--decode-context-parallel-size d`` (a divisor of t): d of those t ranks also split the MLA latent pages
  along the sequence; the mesh is ``tensor = t / d, dcp = d`` (DCP ranks are TP ranks, as in vLLM). KDA state
  stays split over heads on all t.
* ``--enable-expert-parallel``: routed experts are split over the replica's t ranks (E / t experts each, whole
  FFN width) and tokens reach them by all-to-all, instead of every rank holding a 1/t slice of every expert.
* ``--data-parallel-size n``: n independent replicas (engines on disjoint sub-meshes of t devices) behind one
  front that balances requests (``serve.engine.data_parallel``). With ``--enable-expert-parallel`` vLLM joins the
  DP ranks into one expert group; here that becomes one replica whose ``expert`` axis has n ranks: experts over
  all t x n devices, attention and caches replicated over the n (one engine, no data-parallel attention).
* Multi-host: ``--num-hosts``, ``--host-rank``, ``--coordinator-address`` for ``jax.distributed.initialize``
  (or JAX's own environment discovery when they are left out on a cluster it recognises).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from kimi_jax.config import ModelConfig
from sharding.mesh import MeshShape, make_mesh
from sharding.rules import fit_spec, param_spec, shard_factor

SUBLAYERS = ("kda", "mla", "dense_mlp", "moe")
"""Parameter prefixes that run inside ``jax.shard_map`` (``sharding.Parallel``): their specs must split exactly."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The parallelism flags of ``kimi-jax serve`` / ``kimi_jax.LLM`` / ``kimi_jax.load`` (vLLM's names)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    decode_context_parallel_size: int = 1
    num_hosts: int | None = None
    host_rank: int | None = None
    coordinator_address: str | None = None

    def __post_init__(self) -> None:
        for flag in ("tensor_parallel_size", "data_parallel_size", "decode_context_parallel_size"):
            value = getattr(self, flag)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {value!r}")
        t, d = self.tensor_parallel_size, self.decode_context_parallel_size
        if t % d:
            raise ValueError(f"--decode-context-parallel-size {d} must divide --tensor-parallel-size {t} (DCP ranks "
                             "are tensor-parallel ranks)")

    @property
    def joins_data_ranks(self) -> bool:
        """Expert parallelism over DP ranks: one replica with an ``expert`` axis of ``data_parallel_size``."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def num_replicas(self) -> int:
        return 1 if self.joins_data_ranks else self.data_parallel_size

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def replica_shape(self) -> MeshShape:
        """The mesh of one replica."""
        d = self.decode_context_parallel_size
        return MeshShape(tensor=self.tensor_parallel_size // d, dcp=d,
                         expert=self.data_parallel_size if self.joins_data_ranks else 1,
                         expert_parallel=self.enable_expert_parallel)

    def label(self) -> str:
        """``TP4 x DCP2``, ``2 x TP4`` for two replicas of TP4."""
        replicas = f"{self.num_replicas} x " if self.num_replicas > 1 else ""
        return replicas + self.replica_shape().label()

    def flags(self) -> str:
        """The command-line flags that give this layout."""
        parts = [f"--tensor-parallel-size {self.tensor_parallel_size}"]
        if self.decode_context_parallel_size > 1:
            parts.append(f"--decode-context-parallel-size {self.decode_context_parallel_size}")
        if self.data_parallel_size > 1:
            parts.append(f"--data-parallel-size {self.data_parallel_size}")
        if self.enable_expert_parallel:
            parts.append("--enable-expert-parallel")
        return " ".join(parts)

    @classmethod
    def of(cls, args) -> "ParallelConfig":
        """From an argparse namespace carrying the serve flags."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})


def _divides(problems: list[str], flag: str, value: int, what: str, size: int) -> None:
    if size > 1 and value % size:
        problems.append(f"{what}={value} is not divisible by {flag} {size}")


def layout_problems(cfg: ModelConfig, pc: ParallelConfig) -> list[str]:
    """Why the model cannot be split as ``pc`` asks (empty when it can): dimensions the axes must divide."""
    problems: list[str] = []
    shape = pc.replica_shape()
    tp, flag = shape.tensor_parallel, "--tensor-parallel-size"
    if cfg.kda_layers:
        _divides(problems, flag, cfg.kda_num_heads, "kda_num_heads", tp)
        _divides(problems, flag, cfg.kda_num_v_heads, "kda_num_v_heads", tp)
    if cfg.mla_layers:
        _divides(problems, flag, cfg.mla_num_heads, "mla_num_heads", tp)
    if cfg.dense_layers:
        _divides(problems, flag, cfg.intermediate_size, "intermediate_size", tp)
    if cfg.moe_layers:
        _divides(problems, flag, cfg.num_experts, "num_experts (router columns)", tp)
        if cfg.num_shared_experts:
            _divides(problems, flag, cfg.num_shared_experts * cfg.moe_intermediate_size, "shared expert width", tp)
        if cfg.latent_dim is not None:
            _divides(problems, flag, cfg.latent_dim, "latent_dim", tp)
        ep = shape.expert_shards
        _divides(problems, "--enable-expert-parallel over" if pc.enable_expert_parallel else "the expert axis",
                 cfg.num_experts, "num_experts", ep)
        if not pc.enable_expert_parallel:
            f = cfg.moe_intermediate_size
            _divides(problems, flag, f // 32 if cfg.experts_mxfp4 else f,
                     "moe_intermediate_size / 32 (MXFP4 scale columns)" if cfg.experts_mxfp4 else
                     "moe_intermediate_size", tp)
    if not problems:  # catch-all: every sublayer parameter must split exactly as its rule asks
        bad = [path for path, (rule, fitted) in _fitted_rules(cfg, shape).items()
               if path.split(".")[0] in SUBLAYERS and shard_factor(fitted, shape.sizes()) < shard_factor(
                   rule, shape.sizes())]
        if bad:
            problems.append(f"parameters {bad} cannot be split exactly on {shape.label()}")
    return problems


def _fitted_rules(cfg: ModelConfig, shape: MeshShape) -> dict[str, tuple]:
    """Parameter path -> (its rule, the rule fitted to its shape on ``shape``), from the abstract model."""
    import jax.numpy as jnp
    from flax import nnx

    from kimi_jax.model import KimiModel
    from kimi_jax.weights.loader import param_leaves

    model = nnx.eval_shape(lambda: KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    out = {}
    for path, var in param_leaves(model).items():
        rule = param_spec(path, shape.expert_parallel)
        out[path] = (rule, fit_spec(rule, tuple(var.shape), shape.sizes()))
    return out


def replica_meshes(pc: ParallelConfig, devices=None) -> list[Mesh]:
    """One mesh per data-parallel replica over consecutive devices (``jax.devices()`` by default)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = pc.replica_shape()
    n = shape.replica_devices
    if n * pc.num_replicas > len(devices):
        raise ValueError(f"{pc.flags()} needs {n * pc.num_replicas} devices, only {len(devices)} are visible")
    return [make_mesh(shape, devices=devices[i * n:(i + 1) * n]) for i in range(pc.num_replicas)]


def device_memory_bytes() -> int | None:
    """HBM of the first device (its allocator limit), or None where the backend reports none (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def init_distributed(pc: ParallelConfig) -> None:
    """Start ``jax.distributed`` for a multi-host layout (before any other JAX call); no-op for one host.

    ``num_hosts`` / ``host_rank`` / ``coordinator_address`` go to ``jax.distributed.initialize``; with
    ``num_hosts`` left out (None) nothing is started unless JAX's cluster discovery is wanted, which is asked for by
    ``num_hosts = 0``. On CPU the cross-process collectives use gloo."""
    if pc.num_hosts is None or pc.num_hosts == 1:
        return
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # affects the CPU client only
    if pc.num_hosts == 0:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=pc.coordinator_address, num_processes=pc.num_hosts,
                                   process_id=pc.host_rank)


def is_leader() -> bool:
    """This process runs the scheduler and the HTTP server (process 0)."""
    return jax.process_index() == 0

