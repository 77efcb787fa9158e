"""SamplingParams: per-request generation settings (vLLM's offline-API shape) and the TokenConstraint protocol."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Protocol

import numpy as np

MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for; the sampler computes this many for every row."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (argmax), like vLLM."""


class TokenConstraint(Protocol):
    """A grammar state that restricts the next token (implemented by the server with llguidance)."""

    def allowed_token_bitmask(self) -> np.ndarray:
        """int32 [ceil(vocab/32)]: bit i%32 of word i//32 set = token i allowed."""

    def advance(self, token_id: int) -> None:
        """Consume the sampled token."""

    def is_terminated(self) -> bool:
        """True once the grammar accepts no more tokens (the request then stops)."""


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request. ``validate()`` raises ValueError naming the offending field.

    ``top_k`` 0 (or -1, vLLM's spelling) is off; ``max_tokens`` None means up to ``max_model_len``;
    ``logprobs`` None returns none, 0 only the sampled token's, k also the top k (k <= MAX_LOGPROBS);
    ``seed`` None draws a random seed when the request is created. ``stop`` may be given as one string.
    ``speculative`` False keeps the request out of speculative decoding (its outputs are the same either way: only
    its speed changes); requests with a grammar constraint, penalties or logprobs are never speculated.
    ``thinking_token_budget`` (the prompt ends inside a thinking section): once that many output tokens passed
    without ``thinking_end_token_ids[0]`` (the model closing the section itself), the engine appends
    ``thinking_end_token_ids`` as if they had been sampled (logprob 0), so a model that would think until
    ``max_tokens`` still answers. None: no budget. ``thinking_close_len`` (with a budget): the first that many
    of ``thinking_end_token_ids`` close the section (K3: ``<|close|>think<|sep|>``, before the response opener);
    when the model samples the first of them itself, the engine appends the rest, so a section the model starts
    to close always closes well formed (a small model may follow ``<|close|>`` with the wrong channel name and end
    the turn with no answer). 0 appends nothing.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    constraint_factory: Callable[[], TokenConstraint] | None = None
    speculative: bool = True
    thinking_token_budget: int | None = None
    thinking_end_token_ids: list[int] = dataclasses.field(default_factory=list)
    thinking_close_len: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def can_speculate(self) -> bool:
        """Whether drafts may be verified for this request (see the class docstring)."""
        return (self.speculative and self.constraint_factory is None and not self.uses_penalties
                and self.logprobs is None)

    def validate(self) -> "SamplingParams":
        """Check every field; returns self so calls can chain."""
        _require(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _require(_is_finite(self.temperature) and self.temperature >= 0.0, "temperature",
                 f"must be a finite number >= 0, got {self.temperature!r}")
        _require(_is_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
                 f"must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k",
                 f"must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        _require(_is_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
                 f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_finite(value) and -2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value!r}")
        _require(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0.0, "repetition_penalty",
                 f"must be > 0, got {self.repetition_penalty!r}")
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
                 f"must be None or an integer >= 1, got {self.max_tokens!r}")
        _require(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
                 f"must be a list of non-empty strings, got {self.stop!r}")
        _require(isinstance(self.stop_token_ids, list)
                 and all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 f"must be a list of integers >= 0, got {self.stop_token_ids!r}")
        _require(self.seed is None or _is_int(self.seed), "seed", f"must be None or an integer, got {self.seed!r}")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                 "logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _require(self.constraint_factory is None or callable(self.constraint_factory), "constraint_factory",
                 "must be None or a callable returning a TokenConstraint")
        _require(isinstance(self.speculative, bool), "speculative", f"must be a bool, got {self.speculative!r}")
        _require(self.thinking_token_budget is None or (_is_int(self.thinking_token_budget)
                                                         and self.thinking_token_budget >= 1),
                 "thinking_token_budget", f"must be None or an integer >= 1, got {self.thinking_token_budget!r}")
        _require(isinstance(self.thinking_end_token_ids, list)
                 and all(_is_int(t) and t >= 0 for t in self.thinking_end_token_ids), "thinking_end_token_ids",
                 f"must be a list of integers >= 0, got {self.thinking_end_token_ids!r}")
        _require(self.thinking_token_budget is None or bool(self.thinking_end_token_ids), "thinking_end_token_ids",
                 "must name the tokens that close a thinking section when thinking_token_budget is set")
        _require(_is_int(self.thinking_close_len) and 0 <= self.thinking_close_len <= len(self.thinking_end_token_ids),
                 "thinking_close_len", f"must be an integer in [0, len(thinking_end_token_ids)], got "
                 f"{self.thinking_close_len!r}")
        return self


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {message}")
