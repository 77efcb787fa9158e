"""Verification of drafted tokens on the device, exact in distribution (spec sections 7.3 and 7.4).

A verification row feeds a sequence's last token and its ``m <= k`` drafts ``x_1 .. x_m``; the target's
processed distributions (temperature, min-p, top-k, top-p: ``sampler.filtered_probs``) at those ``m + 1``
positions are ``P_1 .. P_{m+1}``, the drafter's are ``Q_1 .. Q_m`` (one-hot for copied or greedy drafts).

* token-level ("probabilistic"): accept ``x_i`` while ``U_i <= P_i(x_i) / Q_i(x_i)``; at the first rejection draw
  from ``normalize(max(0, P_i - Q_i))``, else draw the bonus token from ``P_{m+1}``;
* block verification ("block", Sun et al. 2024, Alg. 2): running acceptance mass ``p_i = min(1, p_{i-1} P_i(x_i)
  / Q_i(x_i))``, ``h_i = Z_i / (Z_i + 1 - p_i)`` with ``Z_i = sum_x max(0, p_i P_{i+1}(x) - Q_{i+1}(x))``
  (``h_m = p_m``); accept the longest prefix ``tau`` with ``U_tau <= h_tau`` and draw the next token from
  ``normalize(max(0, p_tau P_{tau+1} - Q_{tau+1}))`` (``P_{m+1}`` when ``tau = m``);
* rows at temperature 0 match greedily: accept while ``x_i`` is the target's argmax, then emit the argmax.

Randomness per row is ``fold_in(key(seed), step_index)`` (``step_index`` = the request's output tokens so far):
the acceptance uniforms use it folded with a purpose, the final draw the key itself (as ``sampler.sample``), so a
request draws the same numbers whatever its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_ACCEPT = 1


def row_keys(seed_key_data: jax.Array, step_index: jax.Array) -> jax.Array:
    """seed_key_data [N, 2] u32, step_index [N] -> typed keys [N]."""
    base = jax.random.wrap_key_data(seed_key_data, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(base, step_index)


def categorical(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per row from probs [N, V] (rows need not be normalised) -> [N] int32."""
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, probs.shape[-1:], jnp.float32))(keys)
    return jnp.argmax(jnp.log(probs) + gumbel, axis=-1).astype(jnp.int32)


def _purpose(keys: jax.Array, purpose: int) -> jax.Array:
    return jax.vmap(lambda key: jax.random.fold_in(key, purpose))(keys)


def verify(target: jax.Array, drafts: jax.Array, num_drafts: jax.Array, draft_probs: jax.Array | None,
           greedy: jax.Array, keys: jax.Array, *, method: str) -> tuple[jax.Array, jax.Array]:
    """Accept a prefix of each row's drafts and draw the token after it.

    target [N, k+1, V] f32: the target's processed distributions at the fed positions; drafts [N, k] int32;
    num_drafts [N] (<= k; positions past it are ignored); draft_probs [N, k, V] f32 or None (drafts are one-hot);
    greedy [N] bool: temperature-0 rows; keys [N] typed; method "probabilistic" | "block".
    -> (num_accepted [N] int32, tokens [N, k+1] int32: the accepted drafts then the drawn token at index
    ``num_accepted``, zeros after it).
    """
    n, tq, vocab = target.shape
    k = tq - 1
    pos = jnp.arange(k)
    live = pos[None, :] < num_drafts[:, None]  # [N, k]
    q = jax.nn.one_hot(drafts, vocab, dtype=target.dtype) if draft_probs is None else draft_probs
    q = jnp.where(live[..., None], q, 0.0)
    p_x = jnp.take_along_axis(target[:, :k], drafts[..., None], axis=-1)[..., 0]  # P_i(x_i)
    q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ratio = jnp.where(q_x > 0, p_x / jnp.where(q_x > 0, q_x, 1.0), 0.0)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,), jnp.float32))(_purpose(keys, _ACCEPT))
    rows = jnp.arange(n)

    if method == "probabilistic":
        ok = (u <= ratio) & live
        accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
        mass = jnp.ones(n, target.dtype)
    elif method == "block":
        running, masses = jnp.ones(n, target.dtype), []
        for i in range(k):  # p_i = min(1, p_{i-1} r_i): not associative, and k <= 7
            running = jnp.minimum(1.0, running * ratio[:, i])
            masses.append(running)
        mass_i = jnp.stack(masses, axis=1)  # [N, k]: p_1 .. p_k
        nxt = target[:, 1:]  # P_{i+1} for i = 1..k
        q_next = jnp.concatenate([q[:, 1:], jnp.zeros_like(q[:, :1])], axis=1)  # Q_{i+1}, zero past the drafts
        z = jnp.sum(jnp.maximum(0.0, mass_i[..., None] * nxt - q_next), axis=-1)
        h = jnp.where(pos[None] + 1 < num_drafts[:, None], z / jnp.maximum(z + 1.0 - mass_i, 1e-30), mass_i)
        hit = (u <= h) & live
        accepted = jnp.max(jnp.where(hit, pos[None] + 1, 0), axis=1).astype(jnp.int32)
        mass = jnp.where(accepted > 0, mass_i[rows, jnp.maximum(accepted - 1, 0)], 1.0)
    else:
        raise ValueError(f"rejection_sample_method must be 'probabilistic' or 'block', got {method!r}")

    greedy_ok = (drafts == jnp.argmax(target[:, :k], axis=-1)) & live
    greedy_accepted = jnp.sum(jnp.cumprod(greedy_ok, axis=1), axis=1).astype(jnp.int32)
    accepted = jnp.where(greedy, greedy_accepted, accepted)

    p_next = target[rows, accepted]  # [N, V]: P_{tau+1}
    q_next = jnp.where((accepted < num_drafts)[:, None], q[rows, jnp.minimum(accepted, k - 1)], 0.0)
    residual = jnp.maximum(0.0, jnp.where(greedy, 1.0, mass)[:, None] * p_next - q_next)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_next)
    # The final draw uses the row key itself (the acceptance uniforms use a key folded from it): for a row without
    # drafts this is exactly the Gumbel-max draw ``sampler.sample`` makes, so whether a request's token comes from
    # a verification step or a decode step does not change it.
    drawn = jnp.where(greedy, jnp.argmax(p_next, axis=-1).astype(jnp.int32), categorical(keys, residual))
    tokens = jnp.where(jnp.arange(tq)[None] < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), 0)
    tokens = tokens.at[rows, accepted].set(drawn)
    return accepted, tokens.astype(jnp.int32)
