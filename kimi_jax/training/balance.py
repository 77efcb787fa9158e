"""Router load balancing without an auxiliary loss, and expert-load statistics.

The router's ``router_bias`` (the checkpoint's ``e_score_correction_bias``) only selects experts; it gets no
gradient. After each step, :func:`bias_update` moves each expert's bias by ``rate`` towards even load: up for
experts that got fewer than the mean (token, choice) pairs of their layer in that batch, down for those that got
more (the sign rule of DeepSeek-V3's auxiliary-loss-free balancing, which K3's bias is trained with). Serving
reads the bias as trained; nothing changes at inference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def bias_update(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """``bias [L, E]`` f32 after one balancing step on the batch's ``load [L, E]`` (pairs per expert)."""
    load = load.astype(jnp.float32)
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - load)


def load_summary(load: np.ndarray) -> dict:
    """Per-layer balance figures of ``load [L, E]``: the busiest and idlest expert against the layer's mean, and
    the coefficient of variation (std / mean) of the per-expert load; plus their worst values over layers."""
    load = np.asarray(load, np.float64)
    if load.ndim != 2 or load.size == 0:
        raise ValueError(f"load: expected [layers, experts] counts, got shape {load.shape}")
    mean = np.maximum(load.mean(axis=1), 1e-9)
    layers = {"max_over_mean": (load.max(axis=1) / mean).tolist(), "min_over_mean": (load.min(axis=1) / mean).tolist(),
              "cv": (load.std(axis=1) / mean).tolist()}
    return {"per_layer": layers, "worst_max_over_mean": max(layers["max_over_mean"]),
            "worst_min_over_mean": min(layers["min_over_mean"]), "mean_cv": float(np.mean(layers["cv"])),
            "pairs": int(load.sum())}
