"""Joint training of a vision tower + projector and the language model it feeds (AdamW, fp32 masters).

The loss runs the serving forward per row (``jax.vmap``, as ``objective.make_loss(layout="vmap")``) with the
row's projected image tokens as the cache's media pool (``HybridCache.media``): placeholder ids ``vocab + j``
read row j. Masked next-token cross-entropy over the assistant's turn.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from kimi_jax.model import KimiModel, compute_logits, forward
from kimi_jax.step import StepInputs, init_cache
from kimi_jax.training.objective import BLOCK_SIZE, _step_fields, cast_params, param_dtypes, split_params
from kimi_jax.training.trainer import decay_mask
from kimi_jax.training.vision_data import VisionBatch
from kimi_jax.vision.tower import VisionModel, encode_images


def _row_logits(graphdef, cfg, params, tokens: jax.Array, media: jax.Array) -> jax.Array:
    """tokens [T] as one fresh sequence, media [R, D] -> fp32 logits [T, vocab]."""
    model = nnx.merge(graphdef, *params)
    t = tokens.shape[0]
    cache = init_cache(cfg, num_blocks=1 + -(-t // BLOCK_SIZE), block_size=BLOCK_SIZE, num_slots=2, dtype=model.dtype)
    cache = dataclasses.replace(cache, media=media.astype(model.dtype))
    fields = {k: jnp.asarray(v) for k, v in _step_fields(1, t).items()}
    hidden, _ = forward(model, cache, StepInputs(token_ids=tokens, **fields), impl="reference")
    return compute_logits(model, hidden)


class VisionTrainer:
    """``(lm params, vision params)`` with one jitted value_and_grad and one jitted AdamW update."""

    def __init__(self, lm: KimiModel, vision: VisionModel, *, compute_dtype=jnp.float32, weight_decay: float = 0.05,
                 clip: float = 1.0, lm_lr_scale: float = 1.0):
        self.config = lm.config
        self.graphdef, lm_params = split_params(lm)
        self.vision_graphdef, vision_params = nnx.split(vision)
        f32 = lambda x: jnp.asarray(x, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
        self.params = jax.tree.map(f32, (lm_params, vision_params))
        lm_dtypes = None if jnp.dtype(compute_dtype) == jnp.float32 else param_dtypes(self.config, compute_dtype)
        cfg, graphdef, vgraph = self.config, self.graphdef, self.vision_graphdef

        def loss(params, batch: VisionBatch):
            lm_p, vision_p = params
            if lm_dtypes is not None:
                lm_p = cast_params(lm_p, lm_dtypes)
                vision_p = jax.tree.map(lambda x: x.astype(compute_dtype), vision_p)
            experts, rest = lm_p

            def nll_sum(tokens, targets, mask, media):  # rows [B, T] with media [B, R, D] -> summed masked nll
                copies = jax.tree.map(lambda x: jnp.broadcast_to(x, tokens.shape[:1] + x.shape), experts)
                logits = jax.vmap(lambda e, row, m: _row_logits(graphdef, cfg, (e, rest), row, m))(
                    copies, tokens, media)
                picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
                return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - picked) * mask)

            media = encode_images(nnx.merge(vgraph, vision_p), batch.images)  # [B, L/4, D]
            total = nll_sum(batch.tokens, batch.targets, batch.mask, media)
            if batch.text_tokens.shape[0]:  # rehearsal rows: no image, so a one-row media pool nobody reads
                blank = jnp.zeros((batch.text_tokens.shape[0], 1, media.shape[-1]), media.dtype)
                total += nll_sum(batch.text_tokens, batch.text_targets, batch.text_mask, blank)
            return total / jnp.maximum(jnp.sum(batch.mask) + jnp.sum(batch.text_mask), 1.0)

        self.grad_fn = jax.jit(jax.value_and_grad(loss))
        lm_mask = decay_mask(self.params[0])
        vision_mask = jax.tree.map(lambda x: x.ndim >= 2, self.params[1])
        self.optimizer = optax.chain(optax.clip_by_global_norm(clip), optax.scale_by_adam(b1=0.9, b2=0.95),
                                     optax.add_decayed_weights(weight_decay, mask=(lm_mask, vision_mask)))
        self.opt_state = self.optimizer.init(self.params)

        def update(params, opt_state, grads, lr):
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            scales = (lm_lr_scale, 1.0)  # the language model moves slower than the new tower
            return tuple(jax.tree.map(lambda p, u: p - lr * s * u, part, up)
                         for part, up, s in zip(params, updates, scales)), opt_state

        self._update = jax.jit(update, donate_argnums=(0, 1))

    def step(self, batch: VisionBatch, lr: float) -> jax.Array:
        """One AdamW step; returns the loss before it."""
        loss, grads = self.grad_fn(self.params, jax.tree.map(jnp.asarray, batch))
        self.params, self.opt_state = self._update(self.params, self.opt_state, grads, jnp.float32(lr))
        return loss

    def models(self) -> tuple[KimiModel, VisionModel]:
        """The current fp32 parameters as modules."""
        (experts, rest), vision = self.params
        return nnx.merge(self.graphdef, experts, rest), nnx.merge(self.vision_graphdef, vision)
