"""Write a model's parameters as a hub-layout checkpoint (config.json + safetensors, optionally sharded)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from kimi_jax.model import KimiModel
from kimi_jax.weights.loader import param_leaves
from kimi_jax.weights.names import hub_names


def _conv_order(cfg, tp: int) -> np.ndarray:
    from sharding.rules import conv_channel_order

    return conv_channel_order(cfg, tp)


def hub_tensors(model: KimiModel):
    """Yield (hub name, numpy array) for every tensor of the checkpoint, in layer order."""
    params = param_leaves(model)
    host = {}
    conv_tp = getattr(getattr(model, "kda", None), "conv_tp", 1)
    for name, slot in hub_names(model.config, set(params)):
        if slot.path not in host:
            host[slot.path] = np.asarray(jax.device_get(params[slot.path].get_value()))
            if slot.path == "kda.conv" and conv_tp != 1:  # back from the tensor-parallel channel order
                host[slot.path] = host[slot.path][:, np.argsort(_conv_order(model.config, conv_tp))]
        value = host[slot.path][slot.index] if slot.index else host[slot.path]
        if slot.rows is not None:
            value = value[slot.rows]
        yield name, np.ascontiguousarray(slot.layout.to_hub(value))


def save_checkpoint(model: KimiModel, folder: str, *, max_shard_bytes: int = 4 << 30) -> None:
    """Write ``config.json`` and ``model*.safetensors`` (+ index when sharded) into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model.config.to_hub_dict(), f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in hub_tensors(model):
        if size + array.nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def write_random_checkpoint(config, folder: str, *, dtype="bfloat16", seed: int = 0,
                            max_shard_bytes: int = 4 << 30) -> None:
    """Random-initialise a model of ``config`` (a ModelConfig) and save it in hub layout."""
    model = KimiModel(config, dtype=jax.numpy.dtype(dtype), rngs=nnx.Rngs(seed))
    save_checkpoint(model, folder, max_shard_bytes=max_shard_bytes)
