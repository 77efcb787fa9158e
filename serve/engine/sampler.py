"""On-device sampling: one jit-friendly function over per-row parameter arrays (shapes never depend on values).

Order per row (vLLM's): allowed-token bitmask -> repetition / frequency / presence penalties -> logprobs
(log_softmax of these logits: the model's distribution under the grammar and penalties, before temperature)
-> greedy argmax, or temperature -> min-p -> top-k -> top-p -> Gumbel-max sample.
Randomness: row i uses ``fold_in(key(seed_i), step_index_i)`` with ``step_index`` = output tokens so far, so
a request draws the same tokens whatever batch it is in, and Gumbel noise is drawn in vocabulary order so
ties in the sort cannot change it.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from serve.engine.outputs import SampledTokens, SpecTokens
from serve.engine.request import Request

jax.tree_util.register_dataclass(SampledTokens, data_fields=["token_ids", "logprobs", "top_token_ids",
                                                             "top_logprobs", "spec", "finite"], meta_fields=[])
jax.tree_util.register_dataclass(SpecTokens, data_fields=["num_accepted", "emitted", "drafts", "num_drafts"],
                                 meta_fields=[])


@partial(jax.tree_util.register_dataclass,
         data_fields=["temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "seed_key_data", "step_index", "penalty_token_ids",
                      "penalty_output_counts", "penalty_in_prompt", "allowed_bitmask"],
         meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters (numpy on the host, jax arrays inside the step). Padding rows are greedy.

    temperature         [N] f32     0 = greedy
    top_k               [N] i32     V when off
    top_p, min_p        [N] f32     1.0 / 0.0 when off
    presence_penalty, frequency_penalty, repetition_penalty   [N] f32
    seed_key_data       [N, 2] u32  raw threefry key of the row's seed: [seed >> 32, seed & 0xffffffff]
                                    (equals ``jax.random.key_data(jax.random.PRNGKey(seed))`` for 32-bit seeds)
    step_index          [N] i32     output tokens the request has so far (folded into its key)
    penalty_token_ids   [N, M] i32  distinct tokens of prompt + output of rows with penalties, V = padding
    penalty_output_counts [N, M] i32  times each of them occurs in the output
    penalty_in_prompt   [N, M] bool whether it occurs in the prompt (repetition penalty covers both)
    allowed_bitmask     [N, ceil(V/32)] i32  bit i%32 of word i//32 = token i allowed
    The three penalty arrays are None when no row uses penalties, ``allowed_bitmask`` when no row has a
    constraint: those variants compile separately, so a runner that wants one compilation passes them always.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    seed_key_data: np.ndarray
    step_index: np.ndarray
    penalty_token_ids: np.ndarray | None
    penalty_output_counts: np.ndarray | None
    penalty_in_prompt: np.ndarray | None
    allowed_bitmask: np.ndarray | None

    @classmethod
    def from_requests(cls, requests: Sequence[Request | None], vocab_size: int, *, num_rows: int | None = None,
                      penalty_width: int | None = None, always_penalties: bool = False,
                      always_bitmask: bool = False) -> "SamplingTensors":
        """Build the padded host arrays; ``None`` entries and rows past ``len(requests)`` are padding.

        ``penalty_width`` (M) defaults to the next power of two >= the largest number of distinct tokens of a
        penalised row; ``always_penalties`` / ``always_bitmask`` keep those arrays even when unused.
        """
        num_rows = len(requests) if num_rows is None else num_rows
        if num_rows < len(requests):
            raise ValueError(f"num_rows={num_rows} < {len(requests)} requests")
        temperature, top_p, min_p = (np.full(num_rows, v, np.float32) for v in (0.0, 1.0, 0.0))
        presence, frequency, repetition = (np.full(num_rows, v, np.float32) for v in (0.0, 0.0, 1.0))
        top_k = np.full(num_rows, vocab_size, np.int32)
        key_data = np.zeros((num_rows, 2), np.uint32)
        step_index = np.zeros(num_rows, np.int32)
        rows = cls(temperature, top_k, top_p, min_p, presence, frequency, repetition, key_data, step_index,
                   None, None, None, None)
        rows.fill_rows(requests, vocab_size)
        penalised: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        masks: dict[int, np.ndarray] = {}
        for i, request in enumerate(requests):
            if request is None:
                continue
            if request.sampling_params.uses_penalties:
                penalised[i] = _penalty_entries(request.prompt_token_ids, request.output_token_ids)
            if request.constraint is not None:
                masks[i] = np.asarray(request.constraint.allowed_token_bitmask(), np.int32)

        pen_ids = pen_counts = pen_prompt = None
        if penalised or always_penalties:
            widest = max((len(ids) for ids, _, _ in penalised.values()), default=1)
            width = penalty_width or 1 << max(widest - 1, 0).bit_length()
            if width < widest:
                raise ValueError(f"penalty_width={width} < {widest} distinct tokens of a penalised request")
            pen_ids = np.full((num_rows, width), vocab_size, np.int32)
            pen_counts = np.zeros((num_rows, width), np.int32)
            pen_prompt = np.zeros((num_rows, width), bool)
            for i, (ids, counts, in_prompt) in penalised.items():
                pen_ids[i, :len(ids)], pen_counts[i, :len(ids)], pen_prompt[i, :len(ids)] = ids, counts, in_prompt
        bitmask = None
        if masks or always_bitmask:
            bitmask = np.full((num_rows, -(-vocab_size // 32)), -1, np.int32)
            for i, mask in masks.items():
                bitmask[i] = mask
        return dataclasses.replace(rows, penalty_token_ids=pen_ids, penalty_output_counts=pen_counts,
                                   penalty_in_prompt=pen_prompt, allowed_bitmask=bitmask)

    def fill_rows(self, requests: Sequence[Request | None], vocab_size: int) -> None:
        """Write each request's per-row parameters (every field but the optional arrays) into row i of these
        arrays, in place; ``None`` entries stay as they are (padding)."""
        for i, request in enumerate(requests):
            if request is None:
                continue
            p = request.sampling_params
            self.temperature[i] = 0.0 if p.is_greedy else p.temperature
            self.top_k[i] = p.top_k if 0 < p.top_k < vocab_size else vocab_size
            self.top_p[i], self.min_p[i] = p.top_p, p.min_p
            self.presence_penalty[i] = p.presence_penalty
            self.frequency_penalty[i] = p.frequency_penalty
            self.repetition_penalty[i] = p.repetition_penalty
            self.seed_key_data[i] = (request.seed >> 32) & 0xFFFFFFFF, request.seed & 0xFFFFFFFF
            self.step_index[i] = request.num_output_tokens


def _penalty_entries(prompt: Sequence[int], output: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct ids of prompt + output, their output counts and prompt membership."""
    prompt_ids = np.unique(np.asarray(prompt, np.int64))
    out_ids, out_counts = np.unique(np.asarray(output, np.int64), return_counts=True)
    ids = np.union1d(prompt_ids, out_ids)
    counts = np.zeros(len(ids), np.int32)
    counts[np.searchsorted(ids, out_ids)] = out_counts
    return ids.astype(np.int32), counts, np.isin(ids, prompt_ids)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Set disallowed tokens to -inf. logits [N, V] f32, bitmask [N, ceil(V/32)] i32."""
    vocab = jnp.arange(logits.shape[-1])
    words = bitmask[:, vocab // 32]
    allowed = (jnp.right_shift(words, (vocab % 32).astype(jnp.int32)) & 1) == 1
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, params: SamplingTensors) -> jax.Array:
    """vLLM's penalties on the listed tokens of each row: repetition (prompt or output: positive logits divided,
    negative multiplied), then ``- frequency * count - presence * (count > 0)`` over output tokens."""
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = params.penalty_token_ids
    counts = params.penalty_output_counts
    picked = logits.at[rows, ids].get(mode="fill", fill_value=0.0)
    rep = params.repetition_penalty[:, None]
    seen = params.penalty_in_prompt | (counts > 0)
    picked = jnp.where(seen, jnp.where(picked > 0, picked / rep, picked * rep), picked)
    picked = (picked - params.frequency_penalty[:, None] * counts
              - params.presence_penalty[:, None] * (counts > 0))
    return logits.at[rows, ids].set(picked, mode="drop")


def sample(logits: jax.Array, params: SamplingTensors, *, num_top_logprobs: int = 0) -> SampledTokens:
    """Sample one token per row. logits [N, V]; ``num_top_logprobs`` (static) = k of the top-k logprobs.

    Returns SampledTokens(token_ids [N] i32, logprobs [N] f32, top_token_ids [N, k] i32, top_logprobs [N, k] f32).
    """
    logits = logits.astype(jnp.float32)
    num_rows, vocab = logits.shape
    if params.allowed_bitmask is not None:
        logits = apply_bitmask(logits, params.allowed_bitmask)
    if params.penalty_token_ids is not None:
        logits = apply_penalties(logits, params)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    temperature = params.temperature[:, None]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep = probs >= params.min_p[:, None] * probs[:, :1]
    keep &= jnp.arange(vocab)[None, :] < params.top_k[:, None]
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    keep &= (jnp.cumsum(kept, axis=-1) - kept) < params.top_p[:, None]

    base = jax.random.wrap_key_data(params.seed_key_data, impl="threefry2x32")
    keys = jax.vmap(jax.random.fold_in)(base, params.step_index)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
    noisy = jnp.where(keep, sorted_logits + jnp.take_along_axis(gumbel, order, axis=-1), -jnp.inf)
    choice = jnp.argmax(noisy, axis=-1)
    drawn = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(params.temperature > 0, drawn, greedy)

    token_logprobs = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_top_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top_logprobs)
    else:
        top_logprobs = jnp.zeros((num_rows, 0), jnp.float32)
        top_ids = jnp.zeros((num_rows, 0), jnp.int32)
    return SampledTokens(tokens, token_logprobs, top_ids.astype(jnp.int32), top_logprobs)


def filtered_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   min_p: jax.Array) -> jax.Array:
    """The distribution ``sample`` draws from, in vocabulary order: softmax(logits / T) restricted by min-p,
    top-k and top-p (in that order) and renormalised. logits [R, V] f32 (bitmask and penalties already applied);
    the per-row parameters [R]. Rows with temperature 0 get their argmax one-hot."""
    num_rows, vocab = logits.shape
    t = temperature[:, None]
    scaled = logits / jnp.where(t > 0, t, 1.0)
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    keep = probs >= min_p[:, None] * probs[:, :1]
    keep &= jnp.arange(vocab)[None, :] < top_k[:, None]
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    keep &= (jnp.cumsum(kept, axis=-1) - kept) < top_p[:, None]
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    rows = jnp.arange(num_rows)[:, None]
    out = jnp.zeros_like(kept).at[rows, order].set(kept)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=out.dtype)
    return jnp.where(t > 0, out, greedy)
