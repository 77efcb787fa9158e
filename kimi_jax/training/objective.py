"""Next-token cross-entropy of a KimiModel through the serving forward (``kimi_jax.model.forward``).

A batch ``[B, T + 1]`` is run as fresh sequences (empty cache, context 0) with ``logits_indices`` = every row,
with the pure-jnp reference ops (the Pallas kernels define no VJP). Two equivalent layouts:

* ``"packed"``: one packed step of B sequences of T tokens (``step.dense_step``), exactly what the engine runs.
* ``"vmap"``: one single-sequence step per row, ``jax.vmap``-ed over B. The reference chunked KDA scans the
  chunks of a packed step one after the other (B*T/64 + B + 1 iterations per layer); per row the scan is
  T/64 + 2 iterations of B-wide work, which suits a GPU. ``lax.ragged_dot`` (routed experts) batches only
  when every operand has the batch axis, so the expert weights are broadcast to B copies (their gradient is
  the sum over the copies).

Mixed precision: trainable parameters are fp32 masters; ``compute_dtypes`` (a State of ShapeDtypeStructs
from :func:`param_dtypes`) casts them per step, so bf16 matmuls keep the model's fp32 islands.

The loss is a weighted mean over targets (chat fine-tuning trains on assistant tokens only) and comes with the
router load of the batch, the (token, choice) pairs per expert and MoE layer, for load balancing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.config import ModelConfig
from kimi_jax.model import KimiModel, compute_logits, forward
from kimi_jax.step import StepInputs, dense_step, init_cache

BLOCK_SIZE = 16
LAYOUTS = ("packed", "vmap")
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def is_expert_weight(path, _value) -> bool:
    """nnx filter: the bf16/fp32 routed-expert stacks ``moe.w1/w2/w3``."""
    return len(path) >= 2 and path[-2] == "moe" and path[-1] in EXPERT_WEIGHTS


def split_params(model: KimiModel):
    """``(graphdef, (experts, rest))``: the model's state split into routed-expert weights and the rest."""
    graphdef, experts, rest = nnx.split(model, is_expert_weight, ...)
    return graphdef, (experts, rest)


def param_dtypes(cfg: ModelConfig, dtype) -> tuple:
    """Per-parameter dtypes of a ``dtype`` model (fp32 islands stay fp32), shaped like :func:`split_params`."""
    abstract = nnx.eval_shape(lambda: KimiModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return split_params(abstract)[1]


def cast_params(params, dtypes):
    return jax.tree.map(lambda x, s: x.astype(s.dtype), params, dtypes)


def _step_fields(num_seqs: int, seq_len: int) -> dict[str, np.ndarray]:
    fields = dense_step(num_seqs, seq_len, block_size=BLOCK_SIZE)
    fields["logits_indices"] = np.arange(num_seqs * seq_len, dtype=np.int32)
    return fields


def _logits_and_load(graphdef, cfg: ModelConfig, params, tokens: jax.Array, num_seqs: int, seq_len: int,
                     impl: str) -> tuple[jax.Array, jax.Array]:
    """tokens [num_seqs * seq_len] as num_seqs fresh sequences -> (fp32 logits [num_seqs * seq_len, vocab],
    router load int32 [L_moe, E])."""
    model = nnx.merge(graphdef, *params)
    pages = -(-seq_len // BLOCK_SIZE)
    cache = init_cache(cfg, num_blocks=1 + num_seqs * pages, block_size=BLOCK_SIZE, num_slots=1 + num_seqs,
                       dtype=model.dtype)
    fields = {k: jnp.asarray(v) for k, v in _step_fields(num_seqs, seq_len).items()}
    aux: dict = {}
    hidden, _ = forward(model, cache, StepInputs(token_ids=tokens, **fields), impl=impl, aux=aux)
    load = aux.get("router_counts", jnp.zeros((0, cfg.num_experts), jnp.int32))
    return compute_logits(model, hidden), load


def sequence_logits(graphdef, cfg: ModelConfig, params, tokens: jax.Array, *, impl: str = "reference"
                    ) -> jax.Array:
    """tokens [B, T] as B fresh sequences in one packed step -> fp32 logits [B, T, vocab]."""
    b, t = tokens.shape
    return _logits_and_load(graphdef, cfg, params, tokens.reshape(-1), b, t, impl)[0].reshape(b, t, -1)


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean next-token loss in nats: logits [..., vocab] fp32, targets [...] int; with ``weights [...]`` the
    weighted mean (0 when every weight is 0)."""
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nats = jax.nn.logsumexp(logits, axis=-1) - picked
    if weights is None:
        return jnp.mean(nats)
    weights = weights.astype(jnp.float32)
    return jnp.sum(nats * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def make_loss(graphdef, cfg: ModelConfig, *, layout: str = "packed", compute_dtypes=None,
              impl: str = "reference") -> Callable[..., tuple[jax.Array, jax.Array]]:
    """``loss(params, batch [B, T + 1] int32, weights [B, T] | None) -> (mean nats/target, router load int32
    [L_moe, E])`` for params shaped like :func:`split_params`; ``weights`` weighs target ``batch[:, 1:]``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

    def loss(params, batch, weights=None):
        if compute_dtypes is not None:
            params = cast_params(params, compute_dtypes)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        b, t = inputs.shape
        if layout == "packed":
            logits, load = _logits_and_load(graphdef, cfg, params, inputs.reshape(-1), b, t, impl)
            return cross_entropy(logits.reshape(b, t, -1), targets, weights), load
        experts, rest = params
        copies = jax.tree.map(lambda x: jnp.broadcast_to(x, (b,) + x.shape), experts)
        per_row = lambda e, row: _logits_and_load(graphdef, cfg, (e, rest), row, 1, t, impl)  # noqa: E731
        logits, load = jax.vmap(per_row)(copies, inputs)
        return cross_entropy(logits, targets, weights), jnp.sum(load, axis=0)

    return loss
