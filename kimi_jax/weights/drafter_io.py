"""DSpark drafter checkpoints: ``config.json`` (a ``DSparkConfig``) + ``model.safetensors`` in torch layout.

Tensor names (linear weights are torch ``[out, in]``):

    fc.weight [D, n_taps*D]          fc_norm.weight [D]        mask_embedding [D]
    block_position_embedding [B, D]  norm.weight [D]
    layers.{l}.input_layernorm.weight, layers.{l}.post_attention_layernorm.weight [D]
    layers.{l}.self_attn.*           the target's MLA names (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
                                     kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, g_proj, o_proj)
    layers.{l}.mlp.{gate,up,down}_proj.weight
    markov_head.embedding.weight [vocab, r]   markov_head.proj.weight [vocab, r]
    confidence_head.weight [1, D]             confidence_head.bias [1]

Missing, extra or mis-shaped tensors raise ValueError naming them. The drafter is small, so it is read whole.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from kimi_jax.drafter import DSparkConfig, DSparkDrafter
from kimi_jax.model import KimiModel
from kimi_jax.weights.names import _DENSE, _MLA, LINEAR, ROW, SAME, Layout

_TOP = {
    "fc.weight": ("fc", (0,), LINEAR), "fc_norm.weight": ("fc_norm", (), SAME),
    "mask_embedding": ("mask_embed", (), SAME), "block_position_embedding": ("block_pos", (), SAME),
    "norm.weight": ("norm", (), SAME), "markov_head.embedding.weight": ("markov_a", (), SAME),
    "markov_head.proj.weight": ("markov_b", (), LINEAR), "confidence_head.weight": ("confidence", (), ROW),
    "confidence_head.bias": ("confidence_bias", (), SAME),
}


def _table(drafter: DSparkDrafter) -> dict[str, tuple[str, tuple[int, ...], Layout]]:
    params = _params(drafter)
    table = dict(_TOP)
    for layer in range(drafter.config.num_layers):
        pre = f"layers.{layer}."
        table[pre + "input_layernorm.weight"] = ("input_norm", (layer,), SAME)
        table[pre + "post_attention_layernorm.weight"] = ("post_attn_norm", (layer,), SAME)
        for sub, (path, layout) in _MLA.items():
            if f"mla.{path}" in params:
                table[pre + "self_attn." + sub] = (f"mla.{path}", (layer,), layout)
        for sub, (path, layout) in _DENSE.items():
            table[pre + "mlp." + sub] = (f"mlp.{path}", (layer,), layout)
    return table


def _params(drafter: DSparkDrafter) -> dict[str, nnx.Param]:
    out = {}
    for path, value in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        out[".".join(str(p) for p in path)] = value
    return out


def save_drafter(drafter: DSparkDrafter, folder: str) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(drafter.config.to_dict(), f, indent=2)
    params = _params(drafter)
    tensors = {}
    for name, (path, index, layout) in _table(drafter).items():
        value = np.asarray(jax.device_get(params[path].get_value()))
        tensors[name] = np.ascontiguousarray(layout.to_hub(value[index] if index else value))
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def load_drafter(folder: str, target: KimiModel, *, dtype=None) -> DSparkDrafter:
    """Read a drafter for ``target`` (its config must match the target's widths and layer count)."""
    cfg = DSparkConfig.from_folder(folder)
    dtype = jnp.dtype(dtype or target.dtype)
    drafter = nnx.eval_shape(lambda: DSparkDrafter(cfg, target.config, dtype=dtype, rngs=nnx.Rngs(0)))
    table = _table(drafter)
    params = _params(drafter)
    host = {path: np.zeros(p.get_value().shape, p.get_value().dtype) for path, p in params.items()}
    seen = set()
    path = os.path.join(folder, "model.safetensors")
    with safe_open(path, framework="numpy") as f:
        names = set(f.keys())
        extra = sorted(names - set(table))
        if extra:
            raise ValueError(f"{path}: unexpected drafter tensors {extra[:5]}")
        missing = sorted(set(table) - names)
        if missing:
            raise ValueError(f"{path}: missing drafter tensors {missing[:5]}")
        for name, (param, index, layout) in table.items():
            target_shape = host[param][index].shape if index else host[param].shape
            value = layout.to_param(f.get_tensor(name), target_shape)
            if tuple(value.shape) != tuple(target_shape):
                raise ValueError(f"{path}: tensor {name!r} has shape {tuple(value.shape)}, expected "
                                 f"{tuple(target_shape)}")
            if index:
                host[param][index] = value
            else:
                host[param][...] = value
            seen.add(param)
    for name, p in params.items():
        p.set_value(jnp.asarray(host[name], p.get_value().dtype))
    return drafter
