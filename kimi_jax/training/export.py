"""Export a trained model with bf16/fp32 routed experts as a hub checkpoint with MXFP4 routed experts, and load
such a checkpoint back as a trainable model (fine-tuning starts from the MXFP4 grid values of the experts).

Routed-expert stacks are stored ``[L, E, in, out]`` in the model; MXFP4 keeps the checkpoint layout
``packed [L, E, out, in/2]`` + E8M0 ``scales [L, E, out, in/32]`` (``MoEStack.w*_packed / w*_scale``), so each
stack is transposed and quantised with :func:`pallas_kernels.mxfp4.quant.quantize` (round to nearest, ties to even,
one power-of-two scale per 32 inputs). Every other parameter is cast to the export dtype (fp32 islands stay fp32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.model import KimiModel
from kimi_jax.training.objective import EXPERT_WEIGHTS
from kimi_jax.weights.writer import save_checkpoint
from pallas_kernels.mxfp4 import quant as mxfp4


def _flat(model: KimiModel) -> dict[tuple, jax.Array]:
    return {path: var.value for path, var in nnx.to_flat_state(nnx.state(model))}


def quantize_experts(w: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """Routed-expert stack ``[..., in, out]`` -> MXFP4 ``(packed [..., out, in/2], scales [..., out, in/32])``."""
    return mxfp4.quantize(np.swapaxes(np.asarray(jax.device_get(w), np.float32), -1, -2))


def dequantize_experts(packed: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Inverse layout of :func:`quantize_experts`: ``[..., out, in/2]`` + scales -> ``[..., in, out]``."""
    return jnp.swapaxes(mxfp4.dequantize(packed, scales, dtype=dtype), -1, -2)


def mxfp4_model(model: KimiModel, *, dtype=jnp.bfloat16) -> KimiModel:
    """A copy of ``model`` (``experts_mxfp4=False``) with MXFP4 routed experts and ``dtype`` parameters."""
    cfg = model.config
    if cfg.experts_mxfp4:
        raise ValueError("model already has MXFP4 routed experts")
    target = KimiModel(cfg.replace(experts_mxfp4=True), dtype=dtype, rngs=nnx.Rngs(0))
    source = _flat(model)
    values = {}
    for path, old in _flat(target).items():
        name = path[-1]
        if path[-2:-1] == ("moe",) and name.endswith(("_packed", "_scale")):
            weight, part = name.rsplit("_", 1)
            if weight not in EXPERT_WEIGHTS:
                raise ValueError(f"unexpected MXFP4 parameter {path}")
            packed, scales = quantize_experts(source[path[:-1] + (weight,)])
            values[path] = jnp.asarray(packed if part == "packed" else scales)
        else:
            values[path] = jnp.asarray(source[path], old.dtype)
        if values[path].shape != old.shape:
            raise ValueError(f"export shape mismatch at {path}: {values[path].shape} vs {old.shape}")
    nnx.update(target, nnx.from_flat_state(values))
    return target


def fake_quantized_experts(model: KimiModel) -> KimiModel:
    """``model`` with each routed-expert weight replaced by its MXFP4 round trip (same dtype and layout)."""
    values = {}
    for path, value in _flat(model).items():
        if path[-2:-1] == ("moe",) and path[-1] in EXPERT_WEIGHTS:
            values[path] = dequantize_experts(*quantize_experts(value), dtype=value.dtype)
    out = nnx.clone(model)
    nnx.update(out, nnx.from_flat_state(values))
    return out


def export_checkpoint(model: KimiModel, folder: str, *, dtype=jnp.bfloat16) -> KimiModel:
    """Write ``config.json`` + ``model.safetensors`` of the MXFP4 export of ``model``; returns the exported model."""
    exported = mxfp4_model(model, dtype=dtype)
    save_checkpoint(exported, folder)
    return exported


def dequantized_model(model: KimiModel, *, dtype=jnp.float32) -> KimiModel:
    """A trainable copy of a served model: MXFP4 routed experts decoded to ``dtype`` stacks ``[L, E, in, out]``
    (``experts_mxfp4=False``), every other parameter cast to ``dtype`` (fp32 islands stay fp32)."""
    cfg = model.config
    if not cfg.experts_mxfp4:
        return model
    target = KimiModel(cfg.replace(experts_mxfp4=False), dtype=dtype, rngs=nnx.Rngs(0))
    source = _flat(model)
    values = {}
    for path, old in _flat(target).items():
        if path[-2:-1] == ("moe",) and path[-1] in EXPERT_WEIGHTS:
            base = path[:-1] + (f"{path[-1]}_packed",)
            values[path] = dequantize_experts(source[base], source[path[:-1] + (f"{path[-1]}_scale",)], dtype)
        else:
            values[path] = jnp.asarray(source[path], old.dtype)
    nnx.update(target, nnx.from_flat_state(values))
    return target


def trainable_model(folder: str) -> KimiModel:
    """The hub checkpoint ``folder`` (MXFP4 routed experts) as an fp32 model with dequantised fp32 experts
    (``experts_mxfp4=False``): the inverse of :func:`mxfp4_model`, up to the bf16 rounding of the export."""
    import os

    from kimi_jax.config import ModelConfig
    from kimi_jax.weights.loader import load_into

    cfg = ModelConfig.from_json_file(os.path.join(folder, "config.json"))
    if not cfg.experts_mxfp4:
        raise ValueError(f"{folder}: expected MXFP4 routed experts (config experts_mxfp4 true)")
    stored = load_into(nnx.eval_shape(lambda: KimiModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))), folder)
    return dequantized_model(stored, dtype=jnp.float32)
