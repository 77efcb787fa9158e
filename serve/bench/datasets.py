"""Synthetic prompt sets for `kimi-jax bench serve`: random and shared-prefix.

Prompts are built from a fixed list of common English words, each a single token in Kimi-style BPE vocabularies
(a leading space plus a short word), so a prompt of L words is close to L tokens on any server; the exact
counts are taken from the server's `usage`, not from these nominal lengths.
"""

from __future__ import annotations

import dataclasses
import random

WORDS = tuple(
    "the of and to in is was for on are with as at be by this from or have an they which one you had not but "
    "what all were when we there can your more if will about up out many then them so some her would make like "
    "him into time has two see way could people than first water been call who oil its now find long down day "
    "did get come made may part".split())


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request: prompt text, nominal prompt length (words), and the completion length to ask for."""
    prompt: str
    prompt_len: int
    output_len: int


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's --random-range-ratio)."""
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, max(low, high)))


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    rng: random.Random) -> list[BenchRequest]:
    """Independent prompts; a leading request number keeps any two from sharing a cacheable prefix."""
    requests = []
    for i in range(num_prompts):
        length = _length(rng, input_len, range_ratio)
        requests.append(BenchRequest(f"{i} " + _words(rng, length - 1), length,
                                     _length(rng, output_len, range_ratio)))
    return requests


def shared_prefix_requests(num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int, output_len: int,
                           range_ratio: float, rng: random.Random) -> list[BenchRequest]:
    """`num_groups` shared prefixes of `prefix_len` words, each followed by a distinct suffix (a prefix-cache
    workload, like sglang's generated-shared-prefix); requests of all groups are interleaved and shuffled."""
    prefixes = [f"group {g}: " + _words(rng, prefix_len) for g in range(num_groups)]
    requests = []
    for i in range(num_prompts):
        length = _length(rng, suffix_len, range_ratio)
        suffix = f" question {i}: " + _words(rng, length)
        requests.append(BenchRequest(prefixes[i % num_groups] + suffix, prefix_len + length + 4,
                                     _length(rng, output_len, range_ratio)))
    rng.shuffle(requests)
    return requests
