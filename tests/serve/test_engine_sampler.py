"""Sampler: greedy, temperature, top-k / top-p / min-p, penalties, bitmask, seeds, logprobs (statistics on CPU)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve.engine import Request, SamplingParams
from serve.engine.sampler import SamplingTensors, apply_penalties, sample

sample_jit = jax.jit(sample, static_argnames="num_top_logprobs")
# One shape for every call (each shape and optional-array variant compiles once): N rows, V vocab.
# N draws per distribution check: the total-variation noise is about sqrt(support / N) / 2 < 0.02.
N, V = 4096, 32


def tensors(**fields):
    """N rows sampling at temperature 1 with seeds 0..N-1 (no penalties, no mask); ``fields`` override."""
    base = SamplingTensors.from_requests([], V, num_rows=N)
    base = dataclasses.replace(base, temperature=np.ones(N, np.float32),
                               seed_key_data=np.stack([np.zeros(N), np.arange(N)], 1).astype(np.uint32))
    return dataclasses.replace(base, **{k: np.broadcast_to(np.asarray(v, getattr(base, k).dtype),
                                                           getattr(base, k).shape).copy()
                                        for k, v in fields.items()})


def padded_logits(rows):
    """[n, v] logits -> [N, V]: missing vocabulary entries are -inf, missing rows are 0."""
    rows = np.asarray(rows, np.float32)
    out = np.zeros((N, V), np.float32)
    out[:, rows.shape[1]:] = -np.inf
    out[:len(rows), :rows.shape[1]] = rows
    return jnp.asarray(out)


def draw(probs, **fields):
    out = sample_jit(padded_logits(np.tile(np.log(probs), (N, 1))), tensors(**fields))
    return np.bincount(np.asarray(out.token_ids), minlength=V)[:len(probs)] / N


def tv(p, q):
    return 0.5 * np.abs(np.asarray(p) - np.asarray(q)).sum()


def test_greedy_is_argmax_with_logprobs_and_top_logprobs(rng):
    logits = rng.normal(size=(N, V)).astype(np.float32) * 3
    out = sample_jit(jnp.asarray(logits), tensors(temperature=0.0), num_top_logprobs=V)
    ref_lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    best = logits.argmax(-1)
    np.testing.assert_array_equal(out.token_ids, best)
    np.testing.assert_allclose(out.logprobs, ref_lp[np.arange(N), best], rtol=1e-6, atol=1e-6)
    # ranked by the log-probabilities themselves: two logits 1 ulp apart may round to equal log-probs, and
    # then the lower token id comes first (as in lax.top_k)
    np.testing.assert_array_equal(out.top_token_ids[:, :4], np.argsort(-ref_lp, axis=-1, kind="stable")[:, :4])
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-ref_lp, axis=-1), rtol=1e-6, atol=1e-6)


def test_temperature_matches_softmax_distribution():
    probs = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    scaled = probs ** (1 / 0.7) / np.sum(probs ** (1 / 0.7))
    assert tv(draw(probs, temperature=0.7), scaled) < 0.03
    assert tv(draw(probs), probs) < 0.03


@pytest.mark.parametrize("fields,support", [
    (dict(top_k=2), [0, 1]),
    (dict(top_p=0.7), [0, 1, 2]),                  # cumulative mass before token 3 is 0.8 >= 0.7
    (dict(min_p=0.5), [0, 1]),                     # threshold 0.2
    (dict(min_p=0.3), [0, 1, 2]),                  # threshold 0.12
    (dict(top_k=3, top_p=0.5), [0]),               # top-p on the renormalised top-3: [0.5, 0.31, 0.19]
])
def test_truncation_masks_keep_the_right_support_and_renormalise(fields, support):
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    expected = np.zeros_like(probs)
    expected[support] = probs[support] / probs[support].sum()
    freq = draw(probs, **fields)
    assert set(np.flatnonzero(freq)) == set(support)
    assert tv(freq, expected) < 0.03


def penalties_reference(logits, prompt, output, presence, frequency, repetition):
    out = logits.copy()
    counts = np.bincount(np.asarray(output, int), minlength=len(logits))
    seen = (counts > 0) | np.isin(np.arange(len(logits)), prompt)
    out = np.where(seen, np.where(out > 0, out / repetition, out * repetition), out)
    return out - frequency * counts - presence * (counts > 0)


def test_penalties_match_vllm_semantics(rng):
    specs = [([1, 2, 2, 3], [3, 3, 4, 5, 5, 5], 0.5, 0.25, 1.3),
             ([7], [], 0.0, 0.0, 2.0),
             ([11], [0, 31, 31], -0.5, 1.0, 1.0),
             ([1], [2], 0.0, 0.0, 1.0)]                 # no penalties: row untouched
    requests = []
    for i, (prompt, output, pres, freq, rep) in enumerate(specs):
        r = Request(f"r{i}", prompt, SamplingParams(presence_penalty=pres, frequency_penalty=freq,
                                                    repetition_penalty=rep))
        for t in output:
            r.append_output_token(t)
        requests.append(r)
    params = SamplingTensors.from_requests(requests, V, num_rows=N)
    assert params.penalty_token_ids.shape == (N, 8)     # 5 distinct ids in row 0 -> next power of two
    logits = rng.normal(size=(N, V)).astype(np.float32) * 2
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), params))
    for i, (prompt, output, pres, freq, rep) in enumerate(specs):
        np.testing.assert_allclose(got[i], penalties_reference(logits[i], prompt, output, pres, freq, rep),
                                   rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[len(specs):], logits[len(specs):])
    out = sample_jit(jnp.asarray(logits), params, num_top_logprobs=V)
    ref_lp = np.asarray(jax.nn.log_softmax(got, axis=-1))
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-ref_lp, axis=-1), rtol=1e-5, atol=1e-5)


def test_seeded_rows_are_reproducible_and_independent_of_the_batch(rng):
    logits = rng.normal(size=(N, V)).astype(np.float32)
    params = tensors(step_index=3)
    first = np.asarray(sample_jit(jnp.asarray(logits), params).token_ids)
    perm = rng.permutation(N)
    shuffled = jax.tree.map(lambda a: a[perm], params)
    np.testing.assert_array_equal(sample_jit(jnp.asarray(logits[perm]), shuffled).token_ids, first[perm])
    others = rng.normal(size=(N, V)).astype(np.float32)   # same rows 0..9, different batch mates
    others[:10] = logits[:10]
    np.testing.assert_array_equal(sample_jit(jnp.asarray(others), params).token_ids[:10], first[:10])
    one_seed = tensors(seed_key_data=np.array([0, 7], np.uint32), step_index=np.arange(N))
    freq = np.bincount(np.asarray(sample_jit(jnp.zeros((N, V)), one_seed).token_ids), minlength=V) / N
    assert tv(freq, np.full(V, 1 / V)) < 0.06           # successive steps of one seed are fresh draws


def test_bitmask_is_respected_for_sampling_and_greedy(rng):
    allowed = rng.random((N, V)) < 0.2
    allowed[:, 0] = True
    bits = np.zeros(N, np.uint32)
    for t in range(V):
        bits |= allowed[:, t].astype(np.uint32) << np.uint32(t)
    logits = rng.normal(size=(N, V)).astype(np.float32)
    params = tensors(temperature=np.where(np.arange(N) % 2, 1.0, 0.0))
    params = dataclasses.replace(params, allowed_bitmask=bits.view(np.int32)[:, None])
    tokens = np.asarray(sample_jit(jnp.asarray(logits), params).token_ids)
    assert allowed[np.arange(N), tokens].all()
    greedy_rows = np.arange(0, N, 2)
    np.testing.assert_array_equal(tokens[greedy_rows], np.where(allowed, logits, -np.inf)[greedy_rows].argmax(-1))


class AllowTwo:
    def allowed_token_bitmask(self):
        return np.array([0b1100], np.int32)

    def advance(self, token_id):
        pass

    def is_terminated(self):
        return False


def test_from_requests_builds_padded_rows():
    reqs = [Request("a", [1, 2], SamplingParams(temperature=0.0, seed=5)),
            Request("b", [3], SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.1, seed=2**40 + 9,
                                             constraint_factory=AllowTwo))]
    reqs[1].append_output_token(4)
    params = SamplingTensors.from_requests([reqs[0], None, reqs[1]], V, num_rows=N)
    np.testing.assert_allclose(params.temperature[:4], [0.0, 0.0, 0.8, 0.0])
    np.testing.assert_array_equal(params.top_k[:4], [V, V, 3, V])
    np.testing.assert_allclose(params.top_p[:4], [1.0, 1.0, 0.9, 1.0])
    np.testing.assert_array_equal(params.step_index[:4], [0, 0, 1, 0])
    np.testing.assert_array_equal(params.seed_key_data[0], jax.random.key_data(jax.random.PRNGKey(5)))
    np.testing.assert_array_equal(params.seed_key_data[2], [2**8, 9])
    assert params.penalty_token_ids is None
    np.testing.assert_array_equal(params.allowed_bitmask[:4, 0], [-1, -1, 0b1100, -1])
    out = sample_jit(jnp.zeros((N, V)), params)
    assert int(out.token_ids[2]) in (2, 3) and int(out.token_ids[0]) == 0
    always = SamplingTensors.from_requests([reqs[0]], V, always_penalties=True, always_bitmask=True)
    assert always.penalty_token_ids.shape == (1, 1) and always.allowed_bitmask.shape == (1, 1)
