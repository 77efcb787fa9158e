"""Vision tower + projector weights from safetensors, and back.

Two name families are read: the hub layout of Kimi-K2.5 / K3 checkpoints (``vision_tower.patch_embed.proj``,
``vision_tower.patch_embed.pos_emb``, ``vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}``,
``vision_tower.encoder.final_layernorm``, ``mm_projector.{pre_norm,proj.0,proj.2}``; wqkv's q and k rows in
interleaved rotary pairs), and transformers' own names (``model.vision_tower.layers.{i}.attn.{q,k,v}_proj``, q and
k in rotate-half order, ``model.mm_projector.{pre_norm,in_proj,out_proj}``), which are permuted back. The text
loader ignores both (``kimi_jax.weights.names.IGNORED``). Missing or mis-shaped tensors raise ValueError.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from kimi_jax.vision.config import VisionConfig
from kimi_jax.vision.tower import VisionModel
from kimi_jax.weights.loader import checkpoint_files

HUB_BLOCK = {"norm0.weight": "norm0_w", "norm0.bias": "norm0_b", "wqkv.weight": "wqkv", "wqkv.bias": "wqkv_b",
             "wo.weight": "wo", "wo.bias": "wo_b", "norm1.weight": "norm1_w", "norm1.bias": "norm1_b",
             "mlp.fc0.weight": "fc0", "mlp.fc0.bias": "fc0_b", "mlp.fc1.weight": "fc1", "mlp.fc1.bias": "fc1_b"}
HUB_TOP = {"vision_tower.patch_embed.proj.weight": "patch_w", "vision_tower.patch_embed.proj.bias": "patch_b",
           "vision_tower.patch_embed.pos_emb.weight": "pos_emb",
           "vision_tower.encoder.final_layernorm.weight": "final_w",
           "vision_tower.encoder.final_layernorm.bias": "final_b",
           "mm_projector.pre_norm.weight": "pre_w", "mm_projector.pre_norm.bias": "pre_b",
           "mm_projector.proj.0.weight": "proj0", "mm_projector.proj.0.bias": "proj0_b",
           "mm_projector.proj.2.weight": "proj2", "mm_projector.proj.2.bias": "proj2_b"}
HF_BLOCK = {"norm1": "norm0", "norm2": "norm1", "attn.proj": "wo", "mlp.fc1": "mlp.fc0", "mlp.fc2": "mlp.fc1"}
HF_TOP = {"model.vision_tower.patch_embed.proj": "vision_tower.patch_embed.proj",
          "model.vision_tower.final_layernorm": "vision_tower.encoder.final_layernorm",
          "model.mm_projector.pre_norm": "mm_projector.pre_norm", "model.mm_projector.in_proj": "mm_projector.proj.0",
          "model.mm_projector.out_proj": "mm_projector.proj.2"}


def has_vision(folder: str) -> bool:
    """Whether a checkpoint folder holds vision tower weights and a ``vision_config``."""
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return isinstance(json.load(f).get("vision_config"), dict)


def interleave_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Rotate-half row order (transformers) -> interleaved rotary pairs (the hub layout), per head."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hub_tensors(tensors: dict[str, np.ndarray], cfg: VisionConfig) -> dict[str, np.ndarray]:
    """Either family -> hub names (transformers' are renamed, q/k re-interleaved, fused into wqkv)."""
    if not any(k.startswith("model.vision_tower.layers.") for k in tensors):
        return {k: v for k, v in tensors.items() if k.startswith(("vision_tower.", "mm_projector."))}
    out = {}
    for src, dst in HF_TOP.items():
        for p in ("weight", "bias"):
            if f"{src}.{p}" in tensors:
                out[f"{dst}.{p}"] = tensors[f"{src}.{p}"]
    pos = "model.vision_tower.patch_embed.pos_emb.position_embeddings"
    if pos in tensors:
        out["vision_tower.patch_embed.pos_emb.weight"] = tensors[pos]
    for i in range(cfg.num_layers):
        src, dst = f"model.vision_tower.layers.{i}.", f"vision_tower.encoder.blocks.{i}."
        for p in ("weight", "bias"):
            for a, b in HF_BLOCK.items():
                if f"{src}{a}.{p}" in tensors:
                    out[f"{dst}{b}.{p}"] = tensors[f"{src}{a}.{p}"]
            parts = [tensors.get(f"{src}attn.{n}_proj.{p}") for n in "qkv"]
            if all(x is not None for x in parts):
                q, k, v = parts
                out[f"{dst}wqkv.{p}"] = np.concatenate([interleave_rows(q, cfg.num_heads),
                                                        interleave_rows(k, cfg.num_heads), v])
    return out


def _as_param(hub_name: str, value: np.ndarray) -> np.ndarray:
    """A hub tensor in our layout: linear [out, in] -> [in, out]; the conv [D, 3, P, P] -> [3*P*P, D]."""
    if hub_name.endswith("patch_embed.proj.weight"):
        return value.reshape(value.shape[0], -1).T
    if value.ndim == 2 and "pos_emb" not in hub_name:
        return value.T
    return value


def load_vision(folder: str, *, dtype=jnp.float32, max_patches: int | None = None) -> VisionModel:
    """A VisionModel from a checkpoint folder (config.json with ``vision_config`` + safetensors)."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = VisionConfig.from_hf(json.load(f), **({"max_patches": max_patches} if max_patches else {}))
    raw = {}
    for path in checkpoint_files(folder):
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                if "vision_tower." in name or "mm_projector." in name:
                    raw[name] = f.get_tensor(name)
    tensors = _hub_tensors(raw, cfg)
    model = VisionModel(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    wanted = dict(HUB_TOP)
    wanted.update({f"vision_tower.encoder.blocks.{i}.{k}": (v, i) for i in range(cfg.num_layers)
                   for k, v in HUB_BLOCK.items()})
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise ValueError(f"vision weights in {folder!r} lack {len(missing)} tensors, e.g. {missing[:3]}")
    stacked: dict[str, list] = {}
    for name, target in wanted.items():
        value = _as_param(name, tensors[name])
        attr, layer = (target, None) if isinstance(target, str) else target
        expect = getattr(model, attr)[...].shape[(0 if layer is None else 1):]
        if value.shape != tuple(expect):
            raise ValueError(f"vision tensor {name}: shape {value.shape} (as [in, out]), expected {tuple(expect)}")
        if layer is None:
            getattr(model, attr)[...] = jnp.asarray(value, dtype)
        else:
            stacked.setdefault(attr, [None] * cfg.num_layers)[layer] = value
    for attr, values in stacked.items():
        getattr(model, attr)[...] = jnp.asarray(np.stack(values), dtype)
    return model


def vision_tensors(model: VisionModel, dtype=np.float32) -> dict[str, np.ndarray]:
    """Hub-layout tensors of a VisionModel in ``dtype`` (the inverse of ``load_vision``)."""
    cfg = model.config
    out = {}

    def hub(name: str, value: np.ndarray) -> np.ndarray:
        if name.endswith("patch_embed.proj.weight"):
            return value.T.reshape(cfg.hidden_size, 3, cfg.patch_size, cfg.patch_size)
        return value.T if value.ndim == 2 and "pos_emb" not in name else value

    for name, attr in HUB_TOP.items():
        out[name] = hub(name, np.asarray(getattr(model, attr)[...], np.float32))
    for k, attr in HUB_BLOCK.items():
        stack = np.asarray(getattr(model, attr)[...], np.float32)
        for i in range(cfg.num_layers):
            out[f"vision_tower.encoder.blocks.{i}.{k}"] = hub(k, stack[i])
    return {k: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}


def save_vision(model: VisionModel, folder: str, filename: str = "vision.safetensors", dtype=np.float32) -> None:
    """Write the tower's tensors (``dtype``, e.g. ``ml_dtypes.bfloat16``) beside a text checkpoint and add its
    ``vision_config`` to config.json."""
    save_file(vision_tensors(model, dtype), os.path.join(folder, filename))
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(model.config.to_hf())
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
