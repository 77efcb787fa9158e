"""Request: one sequence being served, its progress through the caches and its stop state."""

from __future__ import annotations

import enum
import secrets
import time
from typing import Sequence

import numpy as np

from serve.engine.draft_gate import DraftGate
from serve.engine.media import cache_key_ids
from serve.engine.outputs import RequestMetrics
from serve.engine.sampling_params import SamplingParams, TokenConstraint


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a failed engine step or non-finite logits (``Request.error`` says which)

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    """A prompt, its sampling parameters and everything the scheduler and cache manager track for it.

    Cache state: ``num_computed_tokens`` tokens of ``all_token_ids`` have their MLA latents in the pages of
    ``block_table`` (page j holds positions j*block_size ...) and are folded into the KDA state in
    ``state_slot`` (0 = none held). ``page_hashes[j]`` is the chained hash of full page j of ``all_token_ids``
    (filled lazily by the cache manager). ``planned_checkpoints`` are the one-off checkpoint positions (prompt
    end, Marconi junction) chosen when the request was last admitted.

    Sampling: ``seed`` is concrete (drawn at random when neither ``seed`` nor ``sampling_params.seed`` is
    given); the sample for output token i uses ``fold_in(key(seed), i)``, so a request draws the same tokens
    whatever batch it lands in and after preemption. ``parent`` (for n > 1 siblings) names a request whose
    prompt prefill this one waits for, so that it starts from the parent's prompt-end checkpoint.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                 eos_token_ids: Sequence[int] = (), arrival_time: float | None = None, seed: int | None = None,
                 parent: "Request | None" = None, media: Sequence = ()):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        self.request_id = request_id
        self.prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if seed is None:
            seed = sampling_params.seed if sampling_params.seed is not None else secrets.randbits(64)
        self.seed = int(seed) % (1 << 64)
        self.parent = parent
        factory = sampling_params.constraint_factory
        self.constraint: TokenConstraint | None = factory() if factory is not None else None

        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.error: str | None = None  # why it ended with FINISHED_ERROR (meant for the client)
        self.output_token_ids: list[int] = []
        wants_logprobs = sampling_params.logprobs is not None
        self.output_logprobs: list[dict[int, float]] | None = [] if wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None
        self._all_token_ids = list(self.prompt_token_ids)
        self._token_bytes = bytearray()  # all_token_ids as int32 bytes, filled on first use (token_bytes)
        self.media = tuple(media)
        self.media_leases: dict = {}
        self._cache_ids = cache_key_ids(self.prompt_token_ids, self.media) if self.media else self._all_token_ids

        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.state_slot = 0
        self.page_hashes: list[bytes] = []
        self.planned_checkpoints: list[int] = []
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.draft_token_ids: list[int] = []  # proposals for the next step (speculative decoding)
        self.draft_gate: DraftGate | None = None  # set by the scheduler when speculation may pause for it
        self.think_tokens_left: int | None = sampling_params.thinking_token_budget  # None: no thinking budget

    # ---- read-only views ----
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output ids (a live list: do not mutate)."""
        return self._all_token_ids

    def token_bytes(self) -> bytearray:
        """``all_token_ids`` as int32 bytes (n-gram lookup searches them every step), extended by the tokens
        appended since the last call rather than rebuilt: converting a 32K-token list costs about 1 ms."""
        have = len(self._token_bytes) // 4
        if have < len(self._all_token_ids):
            self._token_bytes += np.asarray(self._all_token_ids[have:], np.int32).tobytes()
        return self._token_bytes

    @property
    def cache_token_ids(self) -> list[int]:
        """Token ids as the prefix cache keys them (a live list: do not mutate)."""
        return self._cache_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    @property
    def metrics(self) -> RequestMetrics:
        return RequestMetrics(arrival_time=self.arrival_time, first_token_time=self.first_token_time,
                              finished_time=self.finished_time, num_cached_tokens=self.num_cached_tokens)

    # ---- mutators ----
    def append_output_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        """Record a sampled token (and, when the request asked for logprobs, its logprob entry)."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if self._cache_ids is not self._all_token_ids:
            self._cache_ids.append(token_id)
        if self.output_logprobs is not None and logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]
        if self.constraint is not None:
            self.constraint.advance(token_id)

    def next_token_is_last(self, max_model_len: int) -> bool:
        """The next sampled token ends the request whatever its value (the length limits of ``check_stop``)."""
        max_tokens = self.sampling_params.max_tokens
        return ((max_tokens is not None and self.num_output_tokens + 1 >= max_tokens)
                or self.num_tokens + 1 >= max_model_len)

    def close_thinking_if_due(self, max_model_len: int) -> bool:
        """After a sampled token was appended (and did not stop the request): count it against the thinking
        budget; once the budget is spent, append ``thinking_end_token_ids`` (as many as ``max_tokens`` and
        ``max_model_len`` leave room for) with logprob 0. When the sampled token opens the closer itself
        (``thinking_end_token_ids[0]``), the budget is off and the rest of the closer
        (``thinking_end_token_ids[1:thinking_close_len]``) is appended the same way, so the section always ends
        well formed. True if tokens were appended: they are not computed yet, so the next step feeds them as a
        chunk and any drafts made before them are void."""
        if self.think_tokens_left is None:
            return False
        params = self.sampling_params
        end = params.thinking_end_token_ids
        if self.output_token_ids[-1] == end[0]:  # the model closes the section itself
            self.think_tokens_left = None
            rest = end[1:params.thinking_close_len]
            return bool(rest) and self._append_forced(rest, max_model_len)
        self.think_tokens_left -= 1
        if self.think_tokens_left > 0:
            return False
        self.think_tokens_left = None
        return self._append_forced(end, max_model_len)

    def _append_forced(self, tokens: list[int], max_model_len: int) -> bool:
        """Append ``tokens`` as if sampled (logprob 0), as many as the length limits leave room for."""
        room = max_model_len - self.num_tokens
        if self.sampling_params.max_tokens is not None:
            room = min(room, self.sampling_params.max_tokens - self.num_output_tokens)
        forced = tokens[:max(room, 0)]
        for token in forced:
            self.append_output_token(token, {token: 0.0})
        self.draft_token_ids = []
        return bool(forced)

    def check_stop(self, max_model_len: int) -> bool:
        """After a token was appended: set a finished status if a stop condition holds; True if it stopped.

        Order: EOS (unless ignore_eos), stop_token_ids (stop_reason = the id), a terminated constraint,
        max_tokens, then the max_model_len limit on prompt + output. Stop strings are the output
        processor's job (it calls ``Scheduler.finish_request``).
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif last in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
        elif self.constraint is not None and self.constraint.is_terminated():
            self.status = RequestStatus.FINISHED_STOPPED
        elif params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
        elif self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        return True

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, slot={self.state_slot}, blocks={len(self.block_table)})")
