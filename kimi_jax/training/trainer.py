"""AdamW training of a KimiModel: warmup + cosine schedule, global-norm clipping, fp32 master parameters, and
optionally router load balancing by the bias rule of :mod:`kimi_jax.training.balance`.

The learning rate is a host-side function of the step passed to the jitted update, so the schedule can be
fixed after the first steps (``train_tiny --time-budget``) without recompiling: steps before the end of the
warmup do not depend on the total.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kimi_jax.model import KimiModel
from kimi_jax.training.balance import bias_update
from kimi_jax.training.objective import make_loss, param_dtypes, split_params

# Parameters without weight decay: norms, gate/decay constants, conv taps, router bias, AttnRes queries, embedding.
NO_DECAY = {"norm", "input_norm", "post_attn_norm", "attn_norm", "mlp_norm", "out_norm", "o_norm", "q_a_norm",
            "kv_a_norm", "latent_norm", "A_log", "dt_bias", "conv", "router_bias", "attn_query", "mlp_query",
            "out_query", "embed"}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine decay to ``peak * min_ratio`` at ``total``."""

    peak: float
    warmup: int
    total: int
    min_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.peak * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def init_for_training(model: KimiModel) -> None:
    """Training-time init on top of the module's: AttnRes pseudo-queries at zero (uniform depth mixing, as in
    the AttnRes paper) and a zero router bias (selection = plain top-k of the sigmoid scores)."""
    if model.config.uses_attnres:
        ar = model.attn_res
        for name in ("attn_query", "mlp_query", "out_query"):
            var = getattr(ar, name)
            var.value = jnp.zeros_like(var.value)
    if hasattr(model, "moe"):
        model.moe.router_bias.value = jnp.zeros_like(model.moe.router_bias.value)


def _name(path) -> str:
    """Parameter name of a pytree path into a State (its last dict key)."""
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]


def _weights(batch: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """Target weights ``[B, T]`` f32 of ``batch [B, T + 1]``: ``weights``, or all 1."""
    shape = (batch.shape[0], batch.shape[1] - 1)
    if weights is None:
        return np.ones(shape, np.float32)
    if weights.shape != shape:
        raise ValueError(f"weights: expected shape {shape} for a batch of shape {batch.shape}, got {weights.shape}")
    return np.asarray(weights, np.float32)


def decay_mask(params):
    """True for the parameters AdamW decays (matrices), False for those in :data:`NO_DECAY`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _name(path) not in NO_DECAY, params)


class Trainer:
    """Holds ``(graphdef, params, opt_state)`` and the two jitted functions: value_and_grad of the loss (also
    used for evaluation, so evaluation needs no second compile) and the AdamW update, which also moves the router
    bias by ``balance_rate`` per step towards even expert load (0: the bias stays as it is)."""

    def __init__(self, model: KimiModel, *, layout: str = "packed", compute_dtype=jnp.float32,
                 weight_decay: float = 0.1, clip: float = 1.0, b1: float = 0.9, b2: float = 0.95,
                 balance_rate: float = 0.0):
        if balance_rate < 0:
            raise ValueError(f"balance_rate: must be >= 0, got {balance_rate}")
        self.config = model.config
        self.graphdef, params = split_params(model)
        self.params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                                   else x, params)
        dtypes = None if jnp.dtype(compute_dtype) == jnp.float32 else param_dtypes(self.config, compute_dtype)
        loss = make_loss(self.graphdef, self.config, layout=layout, compute_dtypes=dtypes)
        self.grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
        self.optimizer = optax.chain(optax.clip_by_global_norm(clip), optax.scale_by_adam(b1=b1, b2=b2),
                                     optax.add_decayed_weights(weight_decay, mask=decay_mask(self.params)))
        self.opt_state = self.optimizer.init(self.params)

        def update(params, opt_state, grads, lr, load):
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
            if balance_rate:
                params = jax.tree_util.tree_map_with_path(
                    lambda path, p: bias_update(p, load, balance_rate) if _name(path) == "router_bias" else p, params)
            return params, opt_state, optax.global_norm(grads)

        self._update = jax.jit(update, donate_argnums=(0, 1))

    def step(self, batch: np.ndarray, lr: float, weights: np.ndarray | None = None
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One AdamW step on ``batch [B, T + 1]`` (targets weighted by ``weights [B, T]``, default all 1); returns
        (loss before the step, gradient global norm, router load int32 [L_moe, E] of the batch)."""
        (loss, load), grads = self.grad_fn(self.params, jnp.asarray(batch), _weights(batch, weights))
        self.params, self.opt_state, grad_norm = self._update(self.params, self.opt_state, grads,
                                                              jnp.float32(lr), load)
        return loss, grad_norm, load

    def measure(self, batches: list[np.ndarray], weights: list[np.ndarray] | None = None, params=None
                ) -> tuple[float, np.ndarray]:
        """(mean loss in nats per weighted target, summed router load [L_moe, E]) over ``batches`` with their
        ``weights`` (default all 1), with the current or the given params."""
        params = self.params if params is None else params
        weights = [None] * len(batches) if weights is None else weights
        total, count, load = 0.0, 0.0, None
        for batch, w in zip(batches, weights, strict=True):
            w = _weights(batch, w)
            (loss, batch_load), _ = self.grad_fn(params, jnp.asarray(batch), w)
            mass = float(np.sum(w))
            total, count = total + float(loss) * mass, count + mass
            load = np.asarray(batch_load) if load is None else load + np.asarray(batch_load)
        return total / max(count, 1.0), load

    def evaluate(self, batches: list[np.ndarray], params=None) -> float:
        """Mean loss (nats/token) over batches, with the current or the given params."""
        return self.measure(batches, params=params)[0]

    def model(self) -> KimiModel:
        """The current parameters as a (fp32) KimiModel."""
        return nnx.merge(self.graphdef, *self.params)
