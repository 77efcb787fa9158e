"""One table from hub checkpoint tensor names to our parameter paths, with the layout transform each needs.

A hub name is normalised first (``language_model.`` prefix dropped; ``language_model.layers.`` ->
``model.layers.``), then matched as model-level (``model.norm.weight``) or per-layer
(``model.layers.{i}.<suffix>``, looked up in the table of layer ``i``'s attention or FFN kind).

Each :class:`Slot` says where a tensor lands: the parameter path (``kda.q_proj``), the index prefix inside the
stacked parameter (``(j,)`` for layer j of the stack, ``(j, e)`` for expert e) and a ``Layout`` that converts
between the hub array and our slice (torch ``[out, in]`` -> ``[in, out]``, conv taps, A_log padding, ...).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from kimi_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Layout:
    """to_param(hub_array, target_shape) -> param slice; to_hub(param slice) -> hub array."""

    name: str
    to_param: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]
    to_hub: Callable[[np.ndarray], np.ndarray]


def _same(a, shape):
    return a.reshape(shape) if a.size == int(np.prod(shape)) else a


def _transpose(a, shape):
    return a.T if a.ndim == 2 else a


def _a_log(a, shape):
    """A_log stored [H], [head_dim] zero-padded (K3), or [1, 1, H, 1] (Kimi-Linear) -> [H]."""
    flat = a.reshape(-1)
    (h,) = shape
    if flat.size > h:
        if np.any(flat[h:] != 0):
            raise ValueError(f"A_log has {flat.size} entries for {h} heads and the padding is not zero")
        flat = flat[:h]
    return flat


def _conv(a, shape):
    """Conv taps [C, 1, W] or [C, W] -> [C, W]."""
    return a.reshape(a.shape[0], -1)


def _row_vector(a, shape):
    """AttnRes pseudo-query [1, D] -> [D]."""
    return a.reshape(-1)


SAME = Layout("same", _same, lambda p: p)
LINEAR = Layout("linear", _transpose, lambda p: p.T)
A_LOG = Layout("A_log", _a_log, lambda p: p.reshape(1, 1, -1, 1))
CONV = Layout("conv", _conv, lambda p: p[:, None, :])
ROW = Layout("row", _row_vector, lambda p: p[None, :])


@dataclasses.dataclass(frozen=True)
class Slot:
    """Destination of one hub tensor: ``param[index][rows]`` gets ``layout.to_param(tensor)``."""

    path: str
    index: tuple[int, ...]
    layout: Layout
    rows: slice | None = None  # sub-range of the slice's first axis (the packed q/k/v conv)


_MODEL_LEVEL = {
    "model.embed_tokens.weight": ("embed", SAME),
    "lm_head.weight": ("lm_head", LINEAR),
    "model.norm.weight": ("norm", SAME),
    "model.output_attn_res_norm.weight": ("attn_res.out_norm", SAME),
    "model.output_attn_res_proj.weight": ("attn_res.out_query", ROW),
}
_COMMON_LAYER = {
    "input_layernorm.weight": ("input_norm", SAME),
    "post_attention_layernorm.weight": ("post_attn_norm", SAME),
    "self_attention_res_norm.weight": ("attn_res.attn_norm", SAME),
    "self_attention_res_proj.weight": ("attn_res.attn_query", ROW),
    "mlp_res_norm.weight": ("attn_res.mlp_norm", SAME),
    "mlp_res_proj.weight": ("attn_res.mlp_query", ROW),
}
_KDA = {
    "q_proj.weight": ("q_proj", LINEAR), "k_proj.weight": ("k_proj", LINEAR), "v_proj.weight": ("v_proj", LINEAR),
    "f_a_proj.weight": ("f_a", LINEAR), "f_b_proj.weight": ("f_b", LINEAR), "b_proj.weight": ("b_proj", LINEAR),
    "g_proj.weight": ("g_proj", LINEAR), "g_a_proj.weight": ("g_a", LINEAR), "g_b_proj.weight": ("g_b", LINEAR),
    "A_log": ("A_log", A_LOG), "dt_bias": ("dt_bias", SAME), "o_norm.weight": ("o_norm", SAME),
    "o_proj.weight": ("o_proj", LINEAR),
}
_KDA_CONV = {"q_conv1d.weight": 0, "k_conv1d.weight": 1, "v_conv1d.weight": 2}
_MLA = {
    "q_proj.weight": ("q_proj", LINEAR), "q_a_proj.weight": ("q_a", LINEAR),
    "q_a_layernorm.weight": ("q_a_norm", SAME), "q_b_proj.weight": ("q_b", LINEAR),
    "kv_a_proj_with_mqa.weight": ("kv_a", LINEAR), "kv_a_layernorm.weight": ("kv_a_norm", SAME),
    "kv_b_proj.weight": ("kv_b", LINEAR), "g_proj.weight": ("g_proj", LINEAR), "o_proj.weight": ("o_proj", LINEAR),
}
_DENSE = {"gate_proj.weight": ("gate", LINEAR), "up_proj.weight": ("up", LINEAR), "down_proj.weight": ("down", LINEAR)}
_MOE = {
    "gate.weight": ("router", LINEAR), "gate.e_score_correction_bias": ("router_bias", SAME),
    "routed_expert_down_proj.weight": ("latent_down", LINEAR), "routed_expert_up_proj.weight": ("latent_up", LINEAR),
    "routed_expert_norm.weight": ("latent_norm", SAME),
    "shared_experts.gate_proj.weight": ("shared_gate", LINEAR), "shared_experts.up_proj.weight": ("shared_up", LINEAR),
    "shared_experts.down_proj.weight": ("shared_down", LINEAR),
}
_EXPERT = re.compile(r"experts\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
IGNORED = re.compile(r"(rotary_emb\.inv_freq|^vision_tower\.|^mm_projector\.|^multi_modal_projector\.)")


def normalize_name(name: str) -> str:
    if name.startswith("language_model.layers."):
        return "model." + name[len("language_model."):]
    if name.startswith("language_model."):
        return name[len("language_model."):]
    return name


def kda_conv_rows(cfg: ModelConfig, part: int) -> slice:
    hk, hvv = cfg.kda_num_heads * cfg.kda_head_dim, cfg.kda_num_v_heads * cfg.kda_v_head_dim
    return (slice(0, hk), slice(hk, 2 * hk), slice(2 * hk, 2 * hk + hvv))[part]


def slot_for(name: str, cfg: ModelConfig) -> Slot | None:
    """Where hub tensor ``name`` goes, or None when it is ignored (rotary tables, vision tower)."""
    name = normalize_name(name)
    if IGNORED.search(name):
        return None
    if name in _MODEL_LEVEL:
        path, layout = _MODEL_LEVEL[name]
        return Slot(path, (), layout)
    m = _LAYER.match(name)
    if not m:
        raise ValueError(f"unexpected checkpoint tensor {name!r}")
    i, rest = int(m.group(1)), m.group(2)
    if i >= cfg.num_layers:
        raise ValueError(f"checkpoint tensor {name!r} is for layer {i} but the config has {cfg.num_layers} layers")
    if rest in _COMMON_LAYER:
        path, layout = _COMMON_LAYER[rest]
        return Slot(path, (i,), layout)
    if rest.startswith("self_attn."):
        sub = rest[len("self_attn."):]
        if cfg.layer_types[i] == "kda":
            j = cfg.kda_layers.index(i)
            if sub in _KDA_CONV:
                return Slot("kda.conv", (j,), CONV, kda_conv_rows(cfg, _KDA_CONV[sub]))
            table, stack = _KDA, "kda"
        else:
            j, table, stack = cfg.mla_layers.index(i), _MLA, "mla"
        if sub in table:
            path, layout = table[sub]
            return Slot(f"{stack}.{path}", (j,), layout)
        raise ValueError(f"unexpected checkpoint tensor {name!r} for a {cfg.layer_types[i].upper()} layer")
    for ffn_prefix in ("mlp.", "block_sparse_moe."):
        if rest.startswith(ffn_prefix):
            sub = rest[len(ffn_prefix):]
            if cfg.mlp_types[i] == "dense":
                if sub in _DENSE:
                    path, layout = _DENSE[sub]
                    return Slot(f"dense_mlp.{path}", (cfg.dense_layers.index(i),), layout)
            else:
                j = cfg.moe_layers.index(i)
                if sub in _MOE:
                    path, layout = _MOE[sub]
                    return Slot(f"moe.{path}", (j,), layout)
                em = _EXPERT.match(sub)
                if em:
                    e, w, kind = int(em.group(1)), em.group(2), em.group(3)
                    if e >= cfg.num_experts:
                        raise ValueError(f"checkpoint tensor {name!r}: expert {e} >= num_experts={cfg.num_experts}")
                    if kind == "weight":
                        return Slot(f"moe.{w}", (j, e), LINEAR)
                    return Slot(f"moe.{w}_{'packed' if kind == 'weight_packed' else 'scale'}", (j, e), SAME)
            raise ValueError(f"unexpected checkpoint tensor {name!r} for a {cfg.mlp_types[i]} FFN layer")
    raise ValueError(f"unexpected checkpoint tensor {name!r}")


def hub_names(cfg: ModelConfig, param_paths: set[str]) -> list[tuple[str, Slot]]:
    """Every hub tensor name our model with these parameter paths reads, with its slot (the writer's table)."""
    out: list[tuple[str, Slot]] = []
    for name, (path, layout) in _MODEL_LEVEL.items():
        if path in param_paths:
            out.append((name, Slot(path, (), layout)))
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for sub, (path, layout) in _COMMON_LAYER.items():
            if path in param_paths:
                out.append((pre + sub, Slot(path, (i,), layout)))
        if cfg.layer_types[i] == "kda":
            j = cfg.kda_layers.index(i)
            for sub, part in _KDA_CONV.items():
                out.append((pre + "self_attn." + sub, Slot("kda.conv", (j,), CONV, kda_conv_rows(cfg, part))))
            table, stack = _KDA, "kda"
        else:
            j, table, stack = cfg.mla_layers.index(i), _MLA, "mla"
        for sub, (path, layout) in table.items():
            if f"{stack}.{path}" in param_paths:
                out.append((pre + "self_attn." + sub, Slot(f"{stack}.{path}", (j,), layout)))
        if cfg.mlp_types[i] == "dense":
            j = cfg.dense_layers.index(i)
            for sub, (path, layout) in _DENSE.items():
                out.append((pre + "mlp." + sub, Slot(f"dense_mlp.{path}", (j,), layout)))
            continue
        j = cfg.moe_layers.index(i)
        for sub, (path, layout) in _MOE.items():
            if f"moe.{path}" in param_paths:
                out.append((pre + "block_sparse_moe." + sub, Slot(f"moe.{path}", (j,), layout)))
        for e in range(cfg.num_experts):
            for w in ("w1", "w2", "w3"):
                base = f"{pre}block_sparse_moe.experts.{e}.{w}."
                if cfg.experts_mxfp4:
                    out.append((base + "weight_packed", Slot(f"moe.{w}_packed", (j, e), SAME)))
                    out.append((base + "weight_scale", Slot(f"moe.{w}_scale", (j, e), SAME)))
                else:
                    out.append((base + "weight", Slot(f"moe.{w}", (j, e), LINEAR)))
    return out
