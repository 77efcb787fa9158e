"""``Parallel``: every sublayer of the model inside ``jax.shard_map`` with per-shard shapes and explicit collectives.

``kimi_jax.model.forward(..., parallel=Parallel(mesh))`` calls these methods in place of the one-device layers.
XLA never partitions a Pallas kernel, so this is how the kernels run on a multi-device mesh; the reference ops
take the same path (one code path to test). Between sublayers the activations ``[T, D]`` are replicated and the
model's XLA glue (embedding, norms, AttnRes mixing, LM head) is partitioned by GSPMD from the placements.

Per sublayer (``TP = ("tensor", "dcp")``, the weights' tensor-parallel group; DCP ranks are TP ranks as in vLLM):
* KDA: heads split over TP. q/k/v/gate/beta projections are column shards of whole heads, the recurrent state
  pool ``[L, S, HV, K, V]`` is split over HV, the conv weight and conv state are split by channel in the rank-
  major order ``sharding.place`` lays ``kda.conv`` out in (rank r holds its heads' ``[q_r | k_r | v_r]``), the
  chunk / decode kernels see a model of ``H / tp`` heads, and o_proj is row-parallel: one psum over TP.
* MLA: heads split over TP (``q_b`` / ``kv_b`` / gate columns, o_proj rows, one psum). The low-rank ``q_a`` /
  ``kv_a`` are replicated, so every rank computes the latent to cache; pages are replicated over ``tensor`` and
  split over ``dcp``; with dcp > 1 the attention is ``sharding.dcp.dcp_attention`` (per-rank partials merged by
  log-sum-exp).
* Dense MLP and shared experts: gate/up columns, down rows, one psum over TP.
* MoE: router columns (experts) over TP, logits all-gathered for the top-k; the latent down-projection's columns
  all-gathered, the latent up-projection row-parallel (one psum); routed experts either split in FFN width over
  TP (one psum) or, on an expert group of more than one rank, dispatched by all-to-all
  (``sharding.moe_ep.ep_routed_experts``).
Every parameter's spec comes from ``sharding.rules`` (the same function that placed it), and a spec the mesh
cannot honour exactly (a head count the TP size does not divide) raises, naming the parameter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kimi_jax.config import ModelConfig
from kimi_jax.layers.ffn import MoEStack, glu_mlp, routed_experts
from kimi_jax.layers.ffn import dense_mlp as dense_mlp_layer
from kimi_jax.layers.kda import KDAStack, kda_layer
from kimi_jax.layers.common import rms_norm, stacked_linear
from kimi_jax.layers.mla import MLAStack, mla_attend, mla_output, mla_project, write_latent
from kimi_jax.step import StepInputs, TokenLayout, slot_mapping, token_layout
from pallas_kernels import router as router_ops
from pallas_kernels.rmsnorm import total
from sharding.dcp import dcp_attention
from sharding.mesh import MeshShape
from sharding.moe_ep import ep_routed_experts
from sharding.rules import EP_ALL, TP, cache_specs, fit_spec, param_spec, shard_factor

F32 = jnp.float32


def _param_path(path: tuple) -> str:
    """A flattened nnx state path -> the rules' parameter name below the sublayer (``q_proj``)."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path if getattr(k, "name", None) != "value")


class Parallel:
    """The shard_map sublayers of one mesh (see the module docstring).

    Args:
      mesh: a ``sharding.make_mesh`` mesh (one data-parallel replica: ``data`` must be 1; replicas are separate
        engines on sub-meshes, ``serve.engine.data_parallel``).
      expert_parallel: vLLM's ``--enable-expert-parallel``: routed experts split over the whole replica
        (``sharding.rules.EP_ALL``) instead of in FFN width over TP; must match how the parameters were placed.
      capacity_factor: expert-parallel dispatch buffer size (``sharding.moe_ep``); None = exact, no drops.
    """

    def __init__(self, mesh: Mesh, *, expert_parallel: bool = False, capacity_factor: float | None = None):
        self.mesh = mesh
        self.shape = MeshShape.of(mesh, expert_parallel=expert_parallel)
        if self.shape.data != 1:
            raise ValueError(f"Parallel runs one replica; the mesh has data={self.shape.data} (data-parallel "
                             "replicas are separate engines on sub-meshes)")
        self.sizes = self.shape.sizes()
        self.tp = self.shape.tensor_parallel
        self.dcp = self.shape.dcp
        self.expert_axes = EP_ALL if expert_parallel else ("expert",)
        self.ep = self.shape.expert_shards
        self.capacity_factor = capacity_factor

    # ---- helpers ----
    def _spec(self, path: str, shape: tuple[int, ...], rule: P | None = None) -> P:
        rule = param_spec(path, self.shape.expert_parallel) if rule is None else rule
        fitted = fit_spec(rule, tuple(shape), self.sizes)
        if shard_factor(fitted, self.sizes) != shard_factor(rule, self.sizes):
            raise ValueError(f"{path} of shape {tuple(shape)} cannot be split as {rule} on the mesh {self.sizes} "
                             f"({self.shape.label()}): an axis does not divide its dimension")
        return fitted

    def _split(self, prefix: str, module: nnx.Module):
        """(graphdef, treedef, leaves, specs) of a sublayer stack's parameters."""
        graphdef, state = nnx.split(module)
        flat, treedef = jax.tree_util.tree_flatten_with_path(state)
        leaves = [leaf for _, leaf in flat]
        specs = [self._spec(f"{prefix}.{_param_path(path)}", leaf.shape) for (path, _), leaf in zip(flat, leaves)]
        return graphdef, treedef, leaves, specs

    @staticmethod
    def _merge(graphdef, treedef, leaves) -> nnx.Module:
        return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))

    def _map(self, body, in_specs, out_specs):
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _tp_sum(self, out, dtype) -> jax.Array:
        """A row-parallel projection's partial output (or PartialSum) summed over TP, in ``dtype``."""
        y = total(out, F32)
        return (lax.psum(y, TP) if self.tp > 1 else y).astype(dtype)

    def _tp_rank(self) -> jax.Array:
        return lax.axis_index(TP)

    def _local(self, cfg: ModelConfig, **heads: int) -> ModelConfig:
        bad = {name: n for name, n in heads.items() if n % self.tp}
        if bad:
            raise ValueError(f"{bad} not divisible by the tensor-parallel size {self.tp} ({self.shape.label()})")
        return cfg.replace(**{name: n // self.tp for name, n in heads.items()})

    def replicated(self, fn, *args):
        """``fn(*args)`` on replicated operands, once per device (a Pallas kernel XLA must not partition)."""
        return self._map(fn, in_specs=P(), out_specs=P())(*args)

    # ---- sublayers (signatures as the one-device layers') ----
    def kda(self, p: KDAStack, j: int, x: jax.Array, state: jax.Array, conv: jax.Array, step: StepInputs,
            layout: TokenLayout, cfg: ModelConfig, *, impl: str | None = None):
        if getattr(p, "conv_tp", 1) != self.tp:
            raise ValueError(f"kda.conv is laid out for {p.conv_tp} tensor-parallel ranks, the mesh has {self.tp}: "
                             "place the model with sharding.place.shard_params for this mesh")
        local_cfg = self._local(cfg, kda_num_heads=cfg.kda_num_heads, kda_num_v_heads=cfg.kda_num_v_heads)
        graphdef, treedef, leaves, specs = self._split("kda", p)
        specs_cache = cache_specs()
        state_spec = self._spec("cache.kda_state", state.shape, specs_cache.kda_state)
        conv_spec = self._spec("cache.kda_conv", conv.shape, specs_cache.kda_conv)

        def body(leaves, x, state, conv, step):
            local = self._merge(graphdef, treedef, leaves)
            local.conv_tp = 1  # this shard's channels are its heads' [q | k | v]
            out, state, conv = kda_layer(local, j, x, state, conv, step, token_layout(step), local_cfg, impl=impl)
            return self._tp_sum(out, x.dtype), state, conv

        return self._map(body, in_specs=(specs, P(), state_spec, conv_spec, P()),
                         out_specs=(P(), state_spec, conv_spec))(leaves, x, state, conv, step)

    def mla(self, p: MLAStack, j: int, x: jax.Array, pages: jax.Array, scales: jax.Array | None, step: StepInputs,
            layout: TokenLayout, cfg: ModelConfig, *, impl: str | None = None, form: str = "absorbed",
            finite_pages: bool = True):
        local_cfg = self._local(cfg, mla_num_heads=cfg.mla_num_heads)
        graphdef, treedef, leaves, specs = self._split("mla", p)
        specs_cache = cache_specs()
        pages_spec = self._spec("cache.mla", pages.shape, specs_cache.mla)
        scales_spec = P() if scales is None else self._spec("cache.mla_scales", scales.shape, specs_cache.mla_scales)
        dcp = self.dcp

        def body(leaves, x, pages, scales, step):
            local = self._merge(graphdef, treedef, leaves)
            lay = token_layout(step)
            q, latent, gate = mla_project(local, j, x, local_cfg, impl=impl)
            slots = slot_mapping(step, lay, pages.shape[2])
            if dcp > 1:
                attn, pages, scales = dcp_attention(local, j, q, latent, pages, scales, slots, step, lay, local_cfg,
                                                    dcp=dcp, impl=impl, finite_pages=finite_pages)
            else:
                pages, scales = write_latent(pages, scales, latent, slots, j)
                attn = mla_attend(local, j, q, pages, scales, step.block_tables, step.context_lens + lay.q_lens,
                                  step, local_cfg, impl=impl, form=form, finite_pages=finite_pages, layer=j)
            return self._tp_sum(mla_output(local, j, attn, gate, x, local_cfg, impl=impl), x.dtype), pages, scales

        return self._map(body, in_specs=(specs, P(), pages_spec, scales_spec, P()),
                         out_specs=(P(), pages_spec, scales_spec))(leaves, x, pages, scales, step)

    def dense_mlp(self, p, j: int, x: jax.Array, cfg: ModelConfig, *, impl: str | None = None):
        graphdef, treedef, leaves, specs = self._split("dense_mlp", p)

        def body(leaves, x):
            out = dense_mlp_layer(self._merge(graphdef, treedef, leaves), j, x, cfg, impl=impl)
            return self._tp_sum(out, x.dtype)

        return self._map(body, in_specs=(specs, P()), out_specs=P())(leaves, x)

    def moe(self, p: MoEStack, j: int, x: jax.Array, cfg: ModelConfig, *, impl: str | None = None,
            stats: list | None = None):
        if cfg.num_experts % self.ep:
            raise ValueError(f"{cfg.num_experts} experts cannot be split over {self.ep} expert-parallel ranks")
        graphdef, treedef, leaves, specs = self._split("moe", p)
        tp, ep = self.tp, self.ep
        # an expert's FFN width is split over TP unless the experts are split over the whole replica
        width_axes = TP if (tp > 1 and not self.shape.expert_parallel) else ()

        def body(leaves, x):
            local = self._merge(graphdef, treedef, leaves)
            route = dict(k=cfg.num_experts_per_token, renormalize=cfg.moe_renormalize,
                         scaling=cfg.routed_scaling_factor, num_expert_group=cfg.num_expert_group,
                         topk_group=cfg.topk_group)
            if tp > 1:  # the router's expert columns are split over TP
                logits = jnp.einsum("td,de->te", x.astype(F32), local.router[j].astype(F32),
                                    precision=lax.Precision.HIGHEST)
                logits = lax.all_gather(logits, TP, axis=1, tiled=True)
                weights, idx = router_ops.select_experts(logits, local.router_bias[j], **route)
            else:
                weights, idx = router_ops.route(x, local.router[...], local.router_bias[...], layer=j, impl=impl,
                                                **route)
            z = x
            if cfg.latent_dim is not None:
                z = stacked_linear(x, local.latent_down, j, impl=impl)
                if tp > 1:
                    z = lax.all_gather(z, TP, axis=1, tiled=True)
            if ep > 1:
                y = ep_routed_experts(local, j, z, weights, idx, cfg, axes=self.expert_axes, ep=ep,
                                      partial_axes=width_axes, capacity_factor=self.capacity_factor, impl=impl)
            else:
                y = routed_experts(local, j, z, weights, idx, cfg, impl=impl)
                if width_axes:
                    y = lax.psum(y.astype(F32), width_axes).astype(z.dtype)
            if cfg.latent_dim is not None:
                if cfg.latent_norm:
                    y = rms_norm(y, local.latent_norm[j], cfg.rms_norm_eps)
                if tp > 1:  # row-parallel: this rank's slice of the latent width
                    width = y.shape[1] // tp
                    y = lax.dynamic_slice_in_dim(y, self._tp_rank() * width, width, axis=1)
                y = self._tp_sum(stacked_linear(y, local.latent_up, j, impl=impl), x.dtype)
            if cfg.num_shared_experts:
                shared = glu_mlp(x, local.shared_gate, local.shared_up, local.shared_down, j, cfg, impl)
                y = y + self._tp_sum(shared, y.dtype)
            return y, idx

        y, idx = self._map(body, in_specs=(specs, P()), out_specs=(P(), P()))(leaves, x)
        if stats is not None:
            stats.append(idx)
        return y


@functools.lru_cache(maxsize=None)
def _cached(mesh: Mesh, expert_parallel: bool, capacity_factor: float | None) -> Parallel:
    return Parallel(mesh, expert_parallel=expert_parallel, capacity_factor=capacity_factor)


def parallel_for(mesh: Mesh | None, *, expert_parallel: bool = False,
                 capacity_factor: float | None = None) -> Parallel | None:
    """The Parallel of ``mesh``, or None for no mesh or a one-device mesh (the plain layers)."""
    if mesh is None or (mesh.size == 1 and not expert_parallel):
        return None
    return _cached(mesh, expert_parallel, capacity_factor)
