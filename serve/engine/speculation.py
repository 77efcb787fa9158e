"""Speculative decoding inside the step executable: verification of drafts and a device drafter's next drafts.

A verification step (``StepInputs.verify_len = Tq = 1 + k``) feeds each sequence's last token and its drafts;
the target's logits at all ``Tq`` rows go through the sequence's bitmask and penalties (neutral for speculating
requests), are turned into the sampler's distributions and verified (``rejection.verify``). A device drafter then
runs in the same executable, so the host only reads tokens. DSpark: every step (verification or not) caches the
context latents of the rows it fed, and each sampled sequence gets the next block of drafts after its new token.
A draft model: it runs over the step's own inputs on its own pools (``cache.draft``: the same block and slot ids,
so checkpoints, copies and verification's per-position states cover it exactly as the target's), then drafts k
tokens one by one after the new token from a copy of its state after the accepted prefix, which is discarded.

Chained verification: every step leaves a carry row per sequence on the device (``next_carry``: its new token,
its context and live slot after the tokens that stay, the output tokens it gained, the device drafter's drafts). A
verification step scheduled while the one before still runs feeds ``-1 - r`` as a row's first token, and
``chain_verification`` builds that row from carry row r, exactly as the host would have after reading it: so
verification steps are launched ahead like decode steps, and the host never waits between them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from kimi_jax.drafter import block_hidden, block_step, confidence, fuse_taps, markov_bias, write_context
from kimi_jax.layers.common import rms_norm
from kimi_jax.model import KimiModel, compute_logits, forward
from kimi_jax.step import HybridCache, StepInputs, token_layout
from serve.engine import rejection
from serve.engine.outputs import SampledTokens, SpecTokens
from serve.engine.sampler import SamplingTensors, apply_bitmask, apply_penalties, filtered_probs

_DRAFT_SAMPLE = 3

# carry columns (``next_carry``): token, context after the step, live slot after it, output tokens gained, drafts
CARRY_TOKEN, CARRY_CONTEXT, CARRY_SLOT, CARRY_EMITTED, CARRY_NUM_DRAFTS, CARRY_DRAFTS = range(6)


def carry_width(plan: "SpecPlan | None") -> int:
    """Columns of the carry: the token alone without speculation, else the chaining columns and k drafts."""
    return 1 if plan is None else CARRY_DRAFTS + plan.num_tokens


@dataclasses.dataclass(frozen=True)
class SpecPlan:
    """The static part of a speculative engine's step executables.

    method "ngram" | "draft_model" | "dspark"; num_tokens k; rejection / draft_sampling as in SpeculativeConfig;
    min_confidence: dspark's confidence cut; taps: target layers the drafter reads; page_offset: its first page
    layer in the MLA pool; drafter_graphdef / drafter_treedef: how to rebuild the drafter (dspark) or the draft
    model from its flat parameters."""

    method: str
    num_tokens: int
    rejection: str = "probabilistic"
    draft_sampling: str = "greedy"
    min_confidence: float = 0.0
    taps: tuple[int, ...] = ()
    page_offset: int = 0
    drafter_graphdef: object = None
    drafter_treedef: object = None

    @property
    def has_drafter(self) -> bool:
        """A DSpark drafter (it reads the target's taps)."""
        return self.method == "dspark"

    @property
    def has_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def on_device(self) -> bool:
        """Drafts come out of the step executable (``SpeculativeConfig.on_device``), not from the host."""
        return self.has_drafter or self.has_draft_model


def verify_rows(logits: jax.Array, step: StepInputs, sampling: SamplingTensors, prev_draft_probs: jax.Array | None,
                draft_rows: jax.Array, plan: SpecPlan, *, greedy_only: bool) -> tuple[SampledTokens, SpecTokens]:
    """logits [N*Tq, V] f32 of a verification step -> (the drawn token per sequence, with its ``finite`` flag over
    the rows it fed, SpecTokens).

    Drafts are the fed tokens after each sequence's first; ``num_drafts`` = valid checkpoint positions - 1.
    ``prev_draft_probs [R, k, V]`` (probabilistic drafting) holds the drafter's distributions of the step before,
    row ``draft_rows[n]`` for sequence n; None: the drafts are one-hot (copied or greedy). ``greedy_only``
    (static): every row is at temperature 0, so the distributions are not built."""
    n, tq = step.num_seqs, step.verify_len
    vocab = logits.shape[-1]
    fed = step.token_ids.reshape(n, tq)
    drafts = fed[:, 1:]
    num_drafts = jnp.sum(step.checkpoint_positions >= 0, axis=1).astype(jnp.int32) - 1
    num_drafts = jnp.maximum(num_drafts, 0)
    keys = rejection.row_keys(sampling.seed_key_data, sampling.step_index)
    if greedy_only:
        target = logits.reshape(n, tq, vocab)
        greedy = jnp.ones(n, bool)
        q = None
    else:
        per_row = jax.tree.map(lambda a: jnp.repeat(a, tq, axis=0) if a is not None else None, sampling)
        processed = apply_penalties(apply_bitmask(logits, per_row.allowed_bitmask), per_row)
        target = filtered_probs(processed, per_row.temperature, per_row.top_k, per_row.top_p,
                                per_row.min_p).reshape(n, tq, vocab)
        greedy = sampling.temperature <= 0
        q = None if prev_draft_probs is None else prev_draft_probs[jnp.maximum(draft_rows, 0)]
    accepted, emitted = rejection.verify(target, drafts, num_drafts, q, greedy, keys, method=plan.rejection)
    rows = jnp.arange(n)
    token = emitted[rows, accepted]
    if greedy_only:
        logprob = jnp.zeros(n, jnp.float32)
    else:
        logprob = jax.nn.log_softmax(processed.reshape(n, tq, vocab)[rows, accepted], axis=-1)[rows, token]
    empty = jnp.zeros((n, 0))
    # a row is judged on the logits of the positions it fed (its last token and its drafts), not on padding
    fed_rows = jnp.arange(tq)[None, :] <= num_drafts[:, None]
    finite = jnp.all(jnp.all(jnp.isfinite(logits), axis=-1).reshape(n, tq) | ~fed_rows, axis=1)
    sampled = SampledTokens(token, logprob, empty.astype(jnp.int32), empty.astype(jnp.float32), finite=finite)
    k = plan.num_tokens
    return sampled, SpecTokens(accepted, emitted, jnp.zeros((n, k), jnp.int32), jnp.zeros(n, jnp.int32))


def cache_context(plan: SpecPlan, drafter_params: list, cache: HybridCache, step: StepInputs, taps: jax.Array, *,
                  impl: str | None) -> HybridCache:
    """Cache the context latents of every row this step fed in the DSpark drafter's page layers (taps
    [n_taps, T, D]: the target's tapped residuals of those rows): what its later blocks attend to. Steps that do
    not draft (their bucket never speculates) still run it, so the drafter's context has no holes when the batch
    shrinks and speculation resumes."""
    drafter = nnx.merge(plan.drafter_graphdef, jax.tree.unflatten(plan.drafter_treedef, drafter_params))
    fused = fuse_taps(drafter, taps, impl=impl)
    pages, scales = write_context(drafter, cache.mla, cache.mla_scales, fused, step, token_layout(step),
                                  plan.page_offset, impl=impl)
    return dataclasses.replace(cache, mla=pages, mla_scales=scales)


def draft_next(plan: SpecPlan, model: KimiModel, drafter_params: list, cache: HybridCache, step: StepInputs,
               taps: jax.Array, first_tokens: jax.Array, positions: jax.Array, sampling: SamplingTensors,
               step_index: jax.Array, *, impl: str | None, finite_pages: bool
               ) -> tuple[HybridCache, jax.Array, jax.Array, jax.Array | None]:
    """Cache this step's context latents (``cache_context``) and draft the next block of each sequence (DSpark).

    taps [n_taps, T, D]: the target's tapped residuals of every fed row; first_tokens [N]: each sequence's new
    token, at ``positions [N]``; step_index [N]: output tokens the request will have before the drafts (keys the
    draft sampling). -> (cache, drafts [N, k], num_drafts [N], the drafter's distributions [N, k, V] when drafts
    are sampled, else None)."""
    cache = cache_context(plan, drafter_params, cache, step, taps, impl=impl)
    drafter = nnx.merge(plan.drafter_graphdef, jax.tree.unflatten(plan.drafter_treedef, drafter_params))
    k = plan.num_tokens
    block = block_step(first_tokens, positions, step.block_tables, 1 + k)
    hidden, pages, scales = block_hidden(drafter, model.embed[...], cache.mla, cache.mla_scales, block,
                                         plan.page_offset, impl=impl, finite_pages=finite_pages)
    n = first_tokens.shape[0]
    normed = rms_norm(hidden, drafter.norm[...], model.config.rms_norm_eps)
    base = compute_logits(model, normed).reshape(n, 1 + k, -1)
    conf = confidence(drafter, hidden).reshape(n, 1 + k)[:, 1:]
    keys = rejection.row_keys(sampling.seed_key_data, step_index)
    sample = plan.draft_sampling == "probabilistic"
    temperature = sampling.temperature[:, None]
    previous, drafts, probs = first_tokens, [], []
    for i in range(k):
        logits = base[:, 1 + i] + markov_bias(drafter, previous)
        if sample:
            q = jax.nn.softmax(logits / jnp.where(temperature > 0, temperature, 1.0), axis=-1)
            q = jnp.where(temperature > 0, q, jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1]))
            token = rejection.categorical(jax.vmap(lambda key: jax.random.fold_in(key, _DRAFT_SAMPLE + i))(keys), q)
            probs.append(q)
        else:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(token)
        previous = token
    if plan.min_confidence > 0:
        num = jnp.sum(jnp.cumprod(conf, axis=1) >= plan.min_confidence, axis=1)  # a prefix: the product falls
    else:
        num = jnp.full(n, k)
    cache = dataclasses.replace(cache, mla=pages, mla_scales=scales)
    return cache, jnp.stack(drafts, 1), num.astype(jnp.int32), jnp.stack(probs, 1) if sample else None


def draft_model_next(plan: SpecPlan, draft_params: list, cache: HybridCache, step: StepInputs, first_tokens: jax.Array,
                     positions: jax.Array, accepted: jax.Array | None, *, impl: str | None, finite_pages: bool,
                     drafting: bool = True) -> tuple[HybridCache, jax.Array]:
    """Advance the draft model over this step's inputs and draft the next k tokens of each sequence (greedy).

    The committed pass feeds the draft model exactly what the target was fed, on ``cache.draft``: its state then
    follows the target's (a verification step writes the state after every fed row to the checkpoint slots, and
    the host keeps the accepted one as for the target). Drafting starts from a copy of the state after the
    accepted prefix (``checkpoint_slots[n, accepted[n]]`` in a verification step, else the live slot) and feeds
    ``first_tokens [N]`` (the new tokens, at ``positions [N]``) and then its own drafts; that copy is dropped,
    and its page writes lie past the committed tokens, where the next step's writes replace them.
    ``drafting`` False (static; a bucket that never speculates): the committed pass only, and no drafts.
    -> (cache, drafts [N, k] int32)."""
    draft = nnx.merge(plan.drafter_graphdef, jax.tree.unflatten(plan.drafter_treedef, draft_params))
    _, committed = forward(draft, cache.draft, step, impl=impl, mla_form="auto", finite_pages=finite_pages)
    n = step.num_seqs
    if not drafting:
        return dataclasses.replace(cache, draft=committed), jnp.zeros((n, plan.num_tokens), jnp.int32)
    rows = jnp.arange(n)
    source = step.state_slots if accepted is None else step.checkpoint_slots[rows, accepted]
    pad = lambda a: jnp.concatenate([jnp.zeros_like(a[:, :1]), a[:, source]], axis=1)  # noqa: E731 - slot 0 spare
    scratch = dataclasses.replace(committed, kda_state=pad(committed.kda_state), kda_conv=pad(committed.kda_conv))
    real = (step.cu_seqlens[1:] > step.cu_seqlens[:-1]).astype(jnp.int32)  # padded sequences stay empty
    cu_seqlens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(real, dtype=jnp.int32)])
    tokens, drafts = first_tokens, []
    for i in range(plan.num_tokens):
        one = StepInputs(token_ids=tokens, cu_seqlens=cu_seqlens,
                         context_lens=(positions + i).astype(jnp.int32), block_tables=step.block_tables,
                         state_slots=1 + rows.astype(jnp.int32), logits_indices=rows.astype(jnp.int32),
                         checkpoint_positions=jnp.full((n, 1), -1, jnp.int32),
                         checkpoint_slots=jnp.zeros((n, 1), jnp.int32), decode_only=True)
        hidden, scratch = forward(draft, scratch, one, impl=impl, mla_form="auto", finite_pages=finite_pages)
        tokens = jnp.argmax(compute_logits(draft, hidden), axis=-1).astype(jnp.int32)
        drafts.append(tokens)
    pools = dataclasses.replace(committed, mla=scratch.mla, mla_scales=scratch.mla_scales)
    return dataclasses.replace(cache, draft=pools), jnp.stack(drafts, 1)


def chain_verification(step: StepInputs, sampling: SamplingTensors, draft_limits: jax.Array, carry: jax.Array
                       ) -> tuple[StepInputs, SamplingTensors]:
    """Fill a verification step's chained rows from the carry of the step before (see the module docstring).

    Row n is chained when its first fed token is ``-1 - r``: it feeds carry row r's token
    and then m drafts, m = min(the drafter's count, k, draft_limits[n] - context - 2) clipped at 0 (the drafts that
    max_tokens and max_model_len leave room for, as the scheduler counts them), from carry r's context and live
    slot, with checkpoint positions for those 1 + m rows (its checkpoint slots are the host's, 1 + k of them), and
    its sampling step index advanced by the tokens that step emitted. Other rows are unchanged. carry [S, W]."""
    n, tq = step.num_seqs, step.verify_len
    k = tq - 1
    fed = step.token_ids.reshape(n, tq)
    chained = fed[:, 0] < 0
    prev = carry[jnp.clip(-1 - fed[:, 0], 0, carry.shape[0] - 1)]
    context = jnp.where(chained, prev[:, CARRY_CONTEXT], step.context_lens)
    room = draft_limits - context - 2
    m = jnp.clip(jnp.minimum(jnp.minimum(prev[:, CARRY_NUM_DRAFTS], k), room), 0, k)
    t = jnp.arange(tq)[None, :]
    kept = t <= m[:, None]
    chain_fed = jnp.where(kept, jnp.concatenate([prev[:, CARRY_TOKEN:CARRY_TOKEN + 1],
                                                 prev[:, CARRY_DRAFTS:CARRY_DRAFTS + k]], axis=1), 0)
    positions = jnp.where(kept, context[:, None] + 1 + t, -1)
    step = dataclasses.replace(
        step, token_ids=jnp.where(chained[:, None], chain_fed, fed).reshape(n * tq), context_lens=context,
        state_slots=jnp.where(chained, prev[:, CARRY_SLOT], step.state_slots),
        checkpoint_positions=jnp.where(chained[:, None], positions, step.checkpoint_positions))
    step_index = sampling.step_index + jnp.where(chained, prev[:, CARRY_EMITTED], 0)
    return step, dataclasses.replace(sampling, step_index=step_index)


def next_carry(carry: jax.Array, step: StepInputs, token_ids: jax.Array, spec: SpecTokens | None) -> jax.Array:
    """The carry the next step reads (``chain_verification``): row n of this step's sequences holds its new token,
    its context after the fed tokens that stay (all of a plain step's; the last token and the accepted drafts of a
    verification row), its live slot then (a verification row's checkpoint slot after its last accepted token), the
    output tokens it gained and the drafts it drew for the next step (zeros without drafting); other rows are 0."""
    n = step.num_seqs
    if carry.shape[1] == 1:
        return jnp.zeros_like(carry).at[:n, CARRY_TOKEN].set(token_ids)
    if step.verify_len:
        accepted = spec.num_accepted
        context = step.context_lens + accepted + 1
        slot = step.checkpoint_slots[jnp.arange(n), accepted]
        emitted = accepted + 1
    else:
        context = step.context_lens + step.cu_seqlens[1:] - step.cu_seqlens[:-1]
        slot, emitted = step.state_slots, jnp.ones(n, jnp.int32)
    k = carry.shape[1] - CARRY_DRAFTS
    drafts = jnp.zeros((n, k), jnp.int32) if spec is None else spec.drafts
    num_drafts = jnp.zeros(n, jnp.int32) if spec is None else spec.num_drafts
    row = jnp.concatenate([jnp.stack([token_ids, context, slot, emitted, num_drafts], axis=1), drafts], axis=1)
    return jnp.zeros_like(carry).at[:n].set(row.astype(carry.dtype))
