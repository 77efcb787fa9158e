"""SpeculativeConfig: the ``--speculative-config`` JSON of ``vllm serve``, validated at start-up.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "dspark", "model": "tiny-dspark", "num_speculative_tokens": 7,
     "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
    {"method": "draft_model", "model": "path/to/small-kimi", "num_speculative_tokens": 4}

method                   "ngram" (prompt lookup on the host), "draft_model" (a small model of the same family
                         run autoregressively on the device) or "dspark" (a block drafter conditioned on the
                         target's hidden states: one forward per step)
model                    the drafter: a preset name or a checkpoint folder (draft_model, dspark); for dspark the
                         default is the drafter shipped beside the target, when there is one
num_speculative_tokens   k: drafts verified per step (1..7: a verification step feeds at most 8 tokens)
draft_sample_method      "greedy" (drafts are the drafter's argmax) or "probabilistic" (dspark: drafts are
                         sampled from the drafter's distribution at the request's temperature); both are lossless
rejection_sample_method  "probabilistic" (token-level: accept draft i with probability min(1, p/q)) or "block"
                         (block verification: never accepts fewer tokens in expectation); at temperature 0 both
                         reduce to greedy matching
prompt_lookup_min/max    n-gram lengths the n-gram drafter matches (the longest match wins)
disable_by_batch_size    speculation is off for a step with at least this many running requests (the batch then
                         saturates the device and verifying drafts costs more than it saves); 0 = never off
min_draft_confidence     dspark: stop a block's drafts where the running product of the confidence head's
                         acceptance estimates falls below this (0 = always k drafts)
min_acceptance_length    a request whose last verification steps emitted fewer tokens than this on average
                         (accepted drafts + the drawn token) stops drafting for a while (``draft_gate``); 0 =
                         never; default 1.5 for ngram (its drafts cost a verification step each and have no
                         confidence estimate), 0 for the others
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram", "draft_model", "dspark")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("probabilistic", "block")
NGRAM_MIN_ACCEPTANCE_LENGTH = 1.5
"""The n-gram default: a request pauses drafting when its verification steps accept under half a draft on average."""
MAX_SPECULATIVE_TOKENS = 7
"""A verification step feeds the last token and k drafts; the fused KDA verify kernel takes at most 8 tokens."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "probabilistic"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 32
    min_draft_confidence: float = 0.0
    min_acceptance_length: float | None = None  # None: the method's default (``acceptance_floor``)

    def __post_init__(self) -> None:
        _require(self.method in METHODS, "method", f"must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        _require(isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS, "num_speculative_tokens",
                 f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        _require(self.draft_sample_method in DRAFT_SAMPLE_METHODS, "draft_sample_method",
                 f"must be one of {DRAFT_SAMPLE_METHODS}, got {self.draft_sample_method!r}")
        _require(self.rejection_sample_method in REJECTION_SAMPLE_METHODS, "rejection_sample_method",
                 f"must be one of {REJECTION_SAMPLE_METHODS}, got {self.rejection_sample_method!r}")
        _require(isinstance(self.disable_by_batch_size, int) and self.disable_by_batch_size >= 0,
                 "disable_by_batch_size", f"must be an integer >= 0, got {self.disable_by_batch_size!r}")
        _require(0.0 <= self.min_draft_confidence < 1.0, "min_draft_confidence",
                 f"must be in [0, 1), got {self.min_draft_confidence!r}")
        floor = self.min_acceptance_length
        _require(floor is None or (isinstance(floor, (int, float)) and not isinstance(floor, bool)
                                   and 0.0 <= floor <= k + 1), "min_acceptance_length",
                 f"must be a number in [0, {k + 1}] (a verification step emits at most k + 1 tokens), got {floor!r}")
        if self.method == "ngram":
            _require(self.model is None, "model", "is not used by the ngram method (drafts come from the prompt)")
            _require(self.draft_sample_method == "greedy", "draft_sample_method",
                     "must be 'greedy' for ngram (its drafts are copied, not sampled)")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            _require(isinstance(lo, int) and lo >= 1, "prompt_lookup_min", f"must be an integer >= 1, got {lo!r}")
            _require(isinstance(hi, int) and hi >= lo, "prompt_lookup_max",
                     f"must be an integer >= prompt_lookup_min ({lo}), got {hi!r}")
        elif self.method == "draft_model":
            _require(self.model is not None, "model", "is required by the draft_model method")
            _require(self.draft_sample_method == "greedy", "draft_sample_method",
                     "must be 'greedy' for draft_model (the draft model drafts its argmax)")
        if self.method != "dspark":
            _require(self.min_draft_confidence == 0.0, "min_draft_confidence", "applies to the dspark method only")

    @property
    def on_device(self) -> bool:
        """Drafts come out of the step executable itself (draft_model, dspark) rather than from the host."""
        return self.method != "ngram"

    @property
    def acceptance_floor(self) -> float:
        """``min_acceptance_length`` with the method's default filled in (0: requests never pause drafting)."""
        if self.min_acceptance_length is not None:
            return float(self.min_acceptance_length)
        return NGRAM_MIN_ACCEPTANCE_LENGTH if self.method == "ngram" else 0.0

    def speculates(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running requests speculates (``disable_by_batch_size``)."""
        return not self.disable_by_batch_size or num_running < self.disable_by_batch_size

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> "SpeculativeConfig":
        """Parse ``--speculative-config``; unknown or inconsistent fields raise ValueError naming the field."""
        if isinstance(text, str):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        else:
            data = dict(text)
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"--speculative-config has unknown fields {unknown}; known: {sorted(fields)}")
        for name in ("method", "num_speculative_tokens"):
            _require(name in data, name, "is required")
        return cls(**data)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{field} {message}")
