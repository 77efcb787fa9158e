"""What the engine hands back: per-request outputs (shared interface) and one step's sampled tokens."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request; text and ids are cumulative (everything generated so far).

    ``finish_reason`` is None while running, else "stop" | "length" | "abort" | "error"; ``stop_reason`` is the
    stop string or stop token id that ended it (None for EOS, length, abort or error).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()``) and the prompt tokens served from the prefix cache."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclasses.dataclass
class RequestOutput:
    """``error``: set (with every completion's finish_reason "error") when the engine failed the request: a step
    that raised, non-finite logits, or output processing that raised; the message is meant for the client."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None


@dataclasses.dataclass
class SpecTokens:
    """What a speculative step adds, one row per scheduled sequence (device arrays, or numpy on the host).

    num_accepted  [N]          int32  drafts the target accepted (0 outside verification steps)
    emitted       [N, Tq]      int32  verification steps: the accepted drafts, then the token drawn after them
                                      (at index num_accepted); else [N, 1], the sampled token
    drafts        [N, k]       int32  a device drafter's proposals for the next step (zeros without one)
    num_drafts    [N]          int32  how many of them to verify (a confidence cut may keep fewer than k)
    """

    num_accepted: np.ndarray
    emitted: np.ndarray
    drafts: np.ndarray
    num_drafts: np.ndarray


@dataclasses.dataclass
class SampledTokens:
    """The sampler's result for one step, one row per scheduled sequence (device arrays, or numpy on the host).

    token_ids     [N]     int32  sampled token of each row (verification steps: the token drawn after the
                                 accepted drafts)
    logprobs      [N]     f32    log-probability of that token
    top_token_ids [N, k]  int32  the k most likely tokens, most likely first (k = 0 when not requested)
    top_logprobs  [N, k]  f32    their log-probabilities
    spec          SpecTokens of a speculative engine's step, else None
    finite        [N]     bool   every logit the row's token came from was finite (False: the request fails;
                                 None: not checked)
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_token_ids: np.ndarray
    top_logprobs: np.ndarray
    spec: SpecTokens | None = None
    finite: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Gauges and counters for /metrics (the shared AsyncEngine interface). Token counts are totals."""

    num_running: int
    num_waiting: int
    cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    router_expert_tokens: tuple[int, ...] = ()
    """Routed (token, choice) pairs each expert received since start, summed over MoE layers (router load)."""
    router_imbalance: float = 0.0
    """Mean over MoE layers of (busiest expert's pairs) / (mean pairs per expert); 1 = perfectly balanced."""
    num_replicas: int = 1
    spec_decode: "SpecDecodeStats | None" = None
    compiles_after_warm_up: int = 0
    """XLA compilations since the engine finished compiling its step shapes at start-up (0 while serving)."""
    executables_pending: int = 0
    """Step executables a progressive warm-up has not finished compiling (0 once none is left; each is taken into
    use at the next step)."""


@dataclasses.dataclass
class SpecDecodeStats:
    """Speculative-decoding counters in vLLM's names (totals since start).

    num_drafts           verification rows with at least one draft
    num_draft_tokens     drafts proposed to the target
    num_accepted_tokens  drafts the target accepted
    accepted_per_pos     [k] how often the draft at each position was accepted
    num_paused_steps     (ours) request steps without drafts because the request's ``DraftGate`` paused it
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    num_paused_steps: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification row: 1 + accepted drafts on average (1.0 = no gain)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
