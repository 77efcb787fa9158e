"""Partition rules: parameter path -> PartitionSpec over the stacked layouts, and the cache specs.

Parameters are stacked by layer kind (``kda.q_proj`` is ``[L, D, H*K]``), so every stacked spec starts with
``None``: the layer axis is never split (the forward indexes one layer at a time). ``TP = ("tensor", "dcp")``
is the tensor-parallel group (see ``sharding.mesh``):

* column-parallel (output features split): KDA q/k/v/gate projections, MLA ``q_b``/``kv_b``/gate, the
  dense MLP and shared-expert gate/up, the LatentMoE down-projection, the router's expert columns;
* row-parallel (input features split): every ``o_proj``, dense/shared ``down``, the LatentMoE up-projection;
* per-head vectors (``A_log``, ``dt_bias``, beta projection) follow their heads;
* routed experts: E over ``expert``, the expert FFN width F over TP (packed MXFP4 bytes and their scales
  split along the same rows or columns);
* vocabulary-parallel embedding and LM head;
* replicated: norms, AttnRes queries, low-rank ``q_a``/``kv_a``/``f_a``, the router bias.

Caches: MLA pages ``[L, blocks, block_size, R+K_rope]`` split over ``dcp`` along blocks and replicated over
``tensor`` (MLA has one latent "KV head"); KDA state ``[L, S, HV, K, V]`` split over heads on TP; the conv
state ``[L, S, W-1, C]`` split along its channels on TP (equal bytes per rank; see the package docstring for
what a head-aligned kernel split would need).

A rule's axes that do not divide the dimension are dropped from the end of that entry (:func:`fit_spec`),
so tiny models still place on 8 devices; the memory planner reports what it had to replicate.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np
from jax.sharding import PartitionSpec as P

from kimi_jax.step import HybridCache

TP = ("tensor", "dcp")
"""The tensor-parallel group of the weights: tensor x dcp ranks."""

_COLUMN = P(None, None, TP)  # [L, in, out]: out split
_ROW = P(None, TP, None)  # [L, in, out]: in split
_REPLICATED = P()

PARAM_RULES: tuple[tuple[str, P], ...] = (
    # embeddings
    (r"embed", P(TP, None)),  # [vocab, D]
    (r"lm_head", P(None, TP)),  # [D, vocab]
    # KDA
    (r"kda\.(q_proj|k_proj|v_proj|g_proj|f_b|g_b|b_proj)", _COLUMN),
    (r"kda\.o_proj", _ROW),
    (r"kda\.(A_log|dt_bias)", P(None, TP)),  # [L, HV], [L, HV*K]
    (r"kda\.conv", P(None, TP, None)),  # [L, C, W]
    (r"kda\.(f_a|g_a|o_norm)", _REPLICATED),
    # MLA
    (r"mla\.(q_b|q_proj|kv_b|g_proj)", _COLUMN),
    (r"mla\.o_proj", _ROW),
    (r"mla\.(q_a|q_a_norm|kv_a|kv_a_norm)", _REPLICATED),
    # dense MLP and the MoE's always-on parts
    (r"(dense_mlp|moe)\.(gate|up|shared_gate|shared_up|latent_down|router)", _COLUMN),
    (r"(dense_mlp|moe)\.(down|shared_down|latent_up)", _ROW),
    (r"moe\.(router_bias|latent_norm)", _REPLICATED),
    # routed experts: bf16 w1/w3 [L, E, Din, F], w2 [L, E, F, Din];
    # MXFP4 w1/w3 packed/scale [L, E, F, Din/2 | Din/32], w2 packed/scale [L, E, Din, F/2 | F/32] (pair-halves
    # and word-order bytes, ``_pairs`` / ``_words``, the same shapes: a TP shard of w2 then holds whole 64-column
    # pairs when F / TP % 64 == 0, and whole scale words when F / TP % 128 == 0)
    (r"moe\.(w1|w3)", P(None, "expert", None, TP)),
    (r"moe\.w2", P(None, "expert", TP, None)),
    (r"moe\.(w1|w3)_(packed|pairs|words|scale)", P(None, "expert", TP, None)),
    (r"moe\.w2_(packed|pairs|words|scale)", P(None, "expert", None, TP)),
    # the Mosaic-GPU decode layout: w1/w3 [L, E, Din/64, F, 32] + scales [L, E, Din/32, F];
    # w2 [L, E, F/64, Din, 32] + scales [L, E, F/32, Din]
    (r"moe\.(w1|w3)_mgpu", P(None, "expert", None, TP, None)),
    (r"moe\.(w1|w3)_mgpu_scale", P(None, "expert", None, TP)),
    (r"moe\.w2_mgpu", P(None, "expert", TP, None, None)),
    (r"moe\.w2_mgpu_scale", P(None, "expert", TP, None)),
    # norms and Attention Residuals
    (r"(norm|input_norm|post_attn_norm)", _REPLICATED),
    (r"attn_res\.\w+", _REPLICATED),
)

_COMPILED = tuple((re.compile(pattern), spec) for pattern, spec in PARAM_RULES)


EP_ALL = ("tensor", "dcp", "expert")
"""The expert-parallel group of routed experts under ``--enable-expert-parallel`` (vLLM's semantics: experts use
EP over the whole tensor-parallel group, and the ``expert`` axis if any, instead of splitting each expert's width)."""
_ROUTED = re.compile(r"moe\.w[123](_packed|_pairs|_words|_scale|_mgpu|_mgpu_scale)?")


def is_routed_expert(path: str) -> bool:
    """Whether ``path`` is a routed expert weight (``moe.w1``, ``moe.w2_packed``, ``moe.w3_mgpu_scale``, ...)."""
    return _ROUTED.fullmatch(path) is not None


def param_spec(path: str, expert_parallel: bool = False) -> P:
    """The PartitionSpec of a parameter path (``"kda.q_proj"``); the first fully matching rule wins.

    ``expert_parallel``: routed experts split E over :data:`EP_ALL` and keep their FFN width whole (the rule's
    ``expert`` entry becomes ``EP_ALL`` and its TP entries are dropped).

    Raises ValueError for a path no rule covers, so a new parameter is never replicated silently."""
    for pattern, spec in _COMPILED:
        if pattern.fullmatch(path):
            if expert_parallel and is_routed_expert(path):
                return P(*(EP_ALL if e == "expert" else None for e in spec))
            return spec
    raise ValueError(f"no partition rule for parameter {path!r}; add one to sharding.rules.PARAM_RULES")


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def fit_spec(spec: P, shape: tuple[int, ...], sizes: Mapping[str, int]) -> P:
    """``spec`` for an array of ``shape`` on a mesh of axis ``sizes``: trailing axes of an entry whose product
    does not divide its dimension are dropped (that dimension is then split less, or replicated). Size-1 axes
    are kept (they split nothing)."""
    if len(spec) > len(shape):
        raise ValueError(f"spec {spec} has more entries than the shape {shape}")
    fitted = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = _axes(entry)
        while axes and dim % math.prod(sizes[a] for a in axes):
            axes = axes[:-1]
        fitted.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while fitted and fitted[-1] is None:
        fitted.pop()
    return P(*fitted)


def shard_factor(spec: P, sizes: Mapping[str, int]) -> int:
    """How many ways an array with ``spec`` is split (its per-device size is total / this)."""
    return math.prod(sizes[a] for entry in spec for a in _axes(entry))


def cache_specs() -> HybridCache:
    """PartitionSpecs of the hybrid cache's pools, as a HybridCache of specs (``mla_scales`` follows ``mla``)."""
    return HybridCache(mla=P(None, "dcp", None, None),
                       kda_state=P(None, None, TP, None, None),
                       kda_conv=P(None, None, None, TP),
                       mla_scales=P(None, "dcp", None),
                       media=P(None, None))


def fitted_cache_specs(cache: HybridCache, sizes: Mapping[str, int]) -> HybridCache:
    """:func:`cache_specs` fitted to the pool shapes of ``cache`` (arrays or ``jax.ShapeDtypeStruct``)."""
    specs = cache_specs()
    fitted = {name: fit_spec(getattr(specs, name), pool.shape, sizes) for name, pool in cache.pools().items()}
    draft = None if cache.draft is None else fitted_cache_specs(cache.draft, sizes)
    return HybridCache(**fitted, media=None if cache.media is None else specs.media, draft=draft)


def conv_channel_order(cfg, tp: int) -> np.ndarray:
    """Channel ``c`` of the rank-major conv layout for ``tp`` ranks holds channel ``order[c]`` of ``[q | k | v]``.

    Identity for ``tp == 1``. Needs ``H * K`` and ``HV * V`` divisible by ``tp`` (whole heads per rank)."""
    hk, hvv = cfg.kda_num_heads * cfg.kda_head_dim, cfg.kda_num_v_heads * cfg.kda_v_head_dim
    if hk % tp or hvv % tp:
        raise ValueError(f"KDA conv channels (q/k {hk}, v {hvv}) cannot be split over {tp} tensor-parallel ranks")
    a, b = hk // tp, hvv // tp
    return np.concatenate([np.concatenate([np.arange(r * a, (r + 1) * a), hk + np.arange(r * a, (r + 1) * a),
                                           2 * hk + np.arange(r * b, (r + 1) * b)]) for r in range(tp)])
