"""The Kimi hybrid model (Kimi-Linear and Kimi K3 text stacks) as one Flax nnx module and one forward.

``forward(model, cache, step)`` runs a packed ragged step (prefill chunks and decode tokens of many
sequences) over the paged hybrid cache and returns the final hidden states of ``step.logits_indices`` plus
the updated cache. Residual stream: plain pre-norm residuals (Kimi-Linear) or Block Attention Residuals (K3,
spec section 0.4 / 3), chosen by ``config.attn_res_block_size``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.config import ModelConfig
from kimi_jax.layers.common import F32, constant, normal, rms_norm
from kimi_jax.layers.ffn import (DenseMLPStack, MoEStack, dense_mlp, moe, router_counts, serving_byte_order,
                                 use_byte_order)
from kimi_jax.layers.kda import KDAStack, kda_layer
from kimi_jax.layers.mla import MLAStack, mla_layer
from kimi_jax.step import HybridCache, StepInputs, token_layout
from pallas_kernels.attnres import attnres_mix
from pallas_kernels.impl import resolve_impl
from pallas_kernels.rmsnorm import PartialSum, add_rms_norm, total

NORM_KERNEL_MAX_ROWS = 256
"""Steps of up to this many tokens run each residual add + RMSNorm as one op of ``impl`` (the Pallas kernel on
GPU: one launch instead of XLA's three); larger steps (prefill) keep XLA's fusion."""


class AttnResParams(nnx.Module):
    """Pseudo-queries and key norms of the two AttnRes sites per layer ([L, D]) and the output site ([D]), fp32."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        n, d = cfg.num_layers, cfg.hidden_size
        self.attn_query = normal(rngs, (n, d), d ** -0.5, F32)
        self.attn_norm = constant((n, d), 1.0)
        self.mlp_query = normal(rngs, (n, d), d ** -0.5, F32)
        self.mlp_norm = constant((n, d), 1.0)
        self.out_query = normal(rngs, (d,), d ** -0.5, F32)
        self.out_norm = constant((d,), 1.0)


class KimiModel(nnx.Module):
    """Embedding, stacked layers of each kind, final norm and LM head.

    embed [vocab, D]; lm_head [D, vocab] (absent when tied); norm [D]; input_norm, post_attn_norm [L, D];
    attn_res (K3 only); kda / mla / dense_mlp / moe stacks (present when the schedule uses them).
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.config = cfg
        d = cfg.hidden_size
        self.embed = normal(rngs, (cfg.vocab_size, d), 1.0, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = normal(rngs, (d, cfg.vocab_size), d ** -0.5, dtype)
        self.norm = constant((d,), 1.0)
        self.input_norm = constant((cfg.num_layers, d), 1.0)
        self.post_attn_norm = constant((cfg.num_layers, d), 1.0)
        if cfg.uses_attnres:
            self.attn_res = AttnResParams(cfg, rngs)
        if cfg.kda_layers:
            self.kda = KDAStack(cfg, dtype=dtype, rngs=rngs)
        if cfg.mla_layers:
            self.mla = MLAStack(cfg, dtype=dtype, rngs=rngs)
        if cfg.dense_layers:
            self.dense_mlp = DenseMLPStack(cfg, dtype=dtype, rngs=rngs)
        if cfg.moe_layers:
            self.moe = MoEStack(cfg, dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.embed.dtype


def _stack_index(layers: tuple[int, ...]) -> dict[int, int]:
    return {layer: j for j, layer in enumerate(layers)}


class _Mixer:
    """AttnRes depth mixing over ``blocks + [partial]`` (fp32 sources), by XLA's fusion of the reference under
    every ``impl``: the Pallas mix measured 0.51-0.90x of it on the H200 (BENCHMARKS.md, AttnRes)."""

    def __init__(self, eps: float):
        self.eps = eps

    def __call__(self, blocks: list[jax.Array], partial: jax.Array, query: jax.Array, norm: jax.Array) -> jax.Array:
        sources = jnp.stack(blocks + [partial])  # [L, T, D]
        mixed, _ = attnres_mix(query, sources, norm, eps=self.eps, impl="reference")
        return mixed


def forward(model: KimiModel, cache: HybridCache, step: StepInputs, *, impl: str | None = None,
            mla_form: str = "absorbed", finite_pages: bool = True, parallel=None, taps: tuple[int, ...] = (),
            aux: dict | None = None) -> tuple[jax.Array, HybridCache]:
    """One packed ragged step: -> (final-normed hidden states of ``step.logits_indices`` [M, D], new cache).

    ``impl`` picks the op implementations (None: backend default); ``mla_form`` the MLA attention form
    ("absorbed", "unabsorbed", or "auto" from the step's shapes: the same function; see kimi_jax.layers.mla);
    ``finite_pages``: the MLA pool holds no NaN (False when freed pages are NaN-poisoned, the engine's test mode;
    see ``mla_layer``). Pages of MLA layers beyond the model's own (a drafter's) and a draft model's pools
    (``cache.draft``) are carried through untouched.

    ``parallel``: None (one device, or GSPMD partitioning from the parameter placements with pure-XLA ops), or a
    ``sharding.Parallel`` whose ``kda`` / ``mla`` / ``dense_mlp`` / ``moe`` / ``replicated`` methods run each
    sublayer inside ``jax.shard_map`` with per-shard shapes and explicit collectives (tensor, expert and decode
    context parallelism; the only way the Pallas kernels run on a multi-device mesh). Embeddings, norms and
    AttnRes stay replicated XLA between the sublayers.

    ``aux``: a dict that receives ``"router_counts"``, int32 [L_moe, E]: the (token, choice) pairs each expert got
    in each MoE layer, real rows only (router load statistics); with ``taps`` also ``"taps"`` [len(taps), T, D]
    f32: every row's residual stream after each listed layer (0-indexed; for AttnRes models the running partial
    sum of the block, what a DSpark drafter conditions on)."""
    cfg = model.config
    layout = token_layout(step)
    router_stats = [] if aux is not None and cfg.moe_layers else None
    x = embed_tokens(model, step.token_ids, cache.media)
    kda_j, mla_j = _stack_index(cfg.kda_layers), _stack_index(cfg.mla_layers)
    dense_j, moe_j = _stack_index(cfg.dense_layers), _stack_index(cfg.moe_layers)
    state, conv, pages, scales = cache.kda_state, cache.kda_conv, cache.mla, cache.mla_scales
    mix = _Mixer(cfg.rms_norm_eps)
    dtype = x.dtype
    bad = [i for i in taps if not 0 <= i < cfg.num_layers]
    if bad:
        raise ValueError(f"taps {bad} are not layers of this {cfg.num_layers}-layer model")
    if taps and aux is None:
        raise ValueError("taps need an aux dict to return them in")
    tapped: dict[int, jax.Array] = {}

    def attention(i: int, h: jax.Array) -> jax.Array | PartialSum:
        nonlocal state, conv, pages, scales
        kda_fn = kda_layer if parallel is None else parallel.kda
        mla_fn = mla_layer if parallel is None else parallel.mla
        if cfg.layer_types[i] == "kda":
            out, state, conv = kda_fn(model.kda, kda_j[i], h, state, conv, step, layout, cfg, impl=impl)
            return out
        out, pages, scales = mla_fn(model.mla, mla_j[i], h, pages, scales, step, layout, cfg, impl=impl,
                                    form=mla_form, finite_pages=finite_pages)
        return out

    def ffn(i: int, h: jax.Array) -> jax.Array | PartialSum:
        if cfg.mlp_types[i] == "dense":
            dense_fn = dense_mlp if parallel is None else parallel.dense_mlp
            return dense_fn(model.dense_mlp, dense_j[i], h, cfg, impl=impl)
        moe_fn = moe if parallel is None else parallel.moe
        return moe_fn(model.moe, moe_j[i], h, cfg, impl=impl, stats=router_stats)

    if cfg.uses_attnres:
        ar = model.attn_res
        partial = x.astype(F32)
        blocks: list[jax.Array] = []
        for i in range(cfg.num_layers):
            h = partial if not blocks else mix(blocks, partial, ar.attn_query[i], ar.attn_norm[i])
            if i % cfg.attn_res_block_size == 0:
                blocks.append(partial)
                partial = jnp.zeros_like(partial)
            a = attention(i, rms_norm(h.astype(dtype), model.input_norm[i], cfg.rms_norm_eps))
            partial = partial + total(a, F32)
            h = mix(blocks, partial, ar.mlp_query[i], ar.mlp_norm[i])
            f = ffn(i, rms_norm(h.astype(dtype), model.post_attn_norm[i], cfg.rms_norm_eps))
            partial = partial + total(f, F32)
            if i in taps:
                tapped[i] = partial
        rows = step.logits_indices
        final = mix([b[rows] for b in blocks], partial[rows], ar.out_query, ar.out_norm)
        hidden = rms_norm(final.astype(dtype), model.norm, cfg.rms_norm_eps)
    else:  # each residual add and the norm after it in one op (one kernel at decode sizes, which also takes the
        # sublayers' unsummed partial products: PartialSum)
        norm_impl = impl if x.shape[0] <= NORM_KERNEL_MAX_ROWS else "reference"

        def add_norm(x, delta, weight, layer=None):  # the stacked norms' rows are read in place (no slice copy)
            fn = functools.partial(add_rms_norm, eps=cfg.rms_norm_eps, layer=layer, impl=norm_impl)
            if parallel is not None and resolve_impl(norm_impl) == "pallas":
                # a Pallas kernel on replicated rows runs per device inside shard_map, never under GSPMD
                return parallel.replicated(fn, x, delta, weight)
            return fn(x, delta, weight)

        x, h = add_norm(x, None, model.input_norm[...], 0)
        for i in range(cfg.num_layers):
            x, h = add_norm(x, attention(i, h), model.post_attn_norm[...], i)
            last = i + 1 == cfg.num_layers
            x, h = add_norm(x, ffn(i, h), *((model.norm[...], None) if last else (model.input_norm[...], i + 1)))
            if i in taps:
                tapped[i] = x.astype(F32)
        hidden = h[step.logits_indices]
    if router_stats is not None:
        aux["router_counts"] = router_counts(jnp.stack(router_stats), layout.valid, cfg.num_experts)
    if taps:
        aux["taps"] = jnp.stack([tapped[i] for i in taps])
    return hidden, HybridCache(mla=pages, kda_state=state, kda_conv=conv, mla_scales=scales, media=cache.media,
                               draft=cache.draft)


def embed_tokens(model: KimiModel, token_ids: jax.Array, media: jax.Array | None) -> jax.Array:
    """Input rows [T, D]: token embeddings, and for ids >= vocab_size (placeholders of vision tokens) row
    ``id - vocab_size`` of ``media [R, D]`` (the encoder's outputs)."""
    vocab = model.config.vocab_size
    x = model.embed[jnp.minimum(token_ids, vocab - 1)]
    if media is None:
        return x
    rows = jnp.clip(token_ids - vocab, 0, media.shape[0] - 1)
    return jnp.where((token_ids >= vocab)[:, None], media[rows].astype(x.dtype), x)


def compute_logits(model: KimiModel, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> fp32 logits [..., vocab]."""
    w = model.embed[...].T if model.config.tie_word_embeddings else model.lm_head[...]
    return jnp.einsum("...d,dv->...v", hidden.astype(w.dtype), w, preferred_element_type=F32)


def use_serving_byte_order(model: KimiModel, order: str, *, fast_kernels: bool, width_shards: int = 1) -> str:
    """Re-lay the routed MXFP4 experts in place into the byte order they are served in and return it.

    ``order``: "checkpoint" (unchanged), "pairs", "words", or "auto" (the word order when ``fast_kernels``, i.e.
    Pallas on a GPU, and every expert input width allows it; else pair halves; else the checkpoint order). A model
    without MXFP4 experts, or already in that order, is left as it is. ``width_shards``: tensor-parallel ranks each
    expert's FFN width is split over (see ``serving_byte_order``)."""
    stack = getattr(model, "moe", None)
    order = serving_byte_order(stack, order, fast_kernels, width_shards)
    if order != "checkpoint" and getattr(stack, f"w1_{order}", None) is None:
        use_byte_order(stack, order)
    return order
