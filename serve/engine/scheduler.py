"""Scheduler: continuous batching with chunked prefill over the hybrid cache (plain Python, no JAX).

One engine iteration is ``out = schedule()`` -> the runner executes ``out`` -> ``update_from_output(out,
sampled)``. While a step is in flight, ``schedule_ahead()`` may queue the next one (asynchronous scheduling:
the host prepares step n+1 while the device runs step n): in the steady decode state, when every running
request is sampled by the in-flight step and nothing waits, each request's next token is fed straight from
the device (a placeholder token id ``-1 - row`` of the in-flight step's sampled rows). A request that stops
in step n while queued in step n+1 drains: it is reported finished at once and keeps its pages and slot until
step n+1 has run (its live state then covers every token, and becomes its final checkpoint). Policy:
* token budget ``max_num_batched_tokens`` per step: every running request that is decoding gets its one
  token first (in admission order), then partially prefilled running requests and finally newly admitted
  ones take what is left, first come first served. The budget adapts: a lone request may use all of it.
* admission (FCFS, never skipping the head except n > 1 siblings waiting for their parent's prompt) needs a
  free live slot, the prefix hit's entries and pages for its first chunk, and ``max_num_seqs``; nothing is
  admitted in a step that had to preempt.
* preemption by recompute: when a running request needs pages that are not there, the newest running
  request gives back everything (its state is kept as a checkpoint when prefix caching is on) and goes back
  to the front of the waiting queue.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

PENDING_TOKEN = -1
"""Placeholder ids are ``PENDING_TOKEN - row``: the token sampled for ``row`` by the step before."""

import numpy as np

from serve.engine.cache_manager import CacheConfig, CacheManager
from serve.engine.outputs import SampledTokens
from serve.engine.request import Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"SchedulerConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"SchedulerConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({self.max_num_seqs}) so every running request can decode")


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One sequence of a step. Positions are token counts from the start of the request.

    request               the Request (read its sampling params, seed, output ids; do not mutate)
    token_ids             [T_i] int   tokens fed this step, at positions context_len .. context_len + T_i - 1
                                     (a prefill chunk, or the single last sampled token when decoding; in a
                                     step scheduled ahead, ``-1 - r``: the token row r of the previous step
                                     samples on the device)
    context_len           int         tokens of this request already in its pages and live state before the
                                     step; 0 = start from the zero state (the live slot must not be read)
    block_table           [ceil((context_len + T_i) / block_size)] int   MLA pages, page j holds positions
                                     j*block_size .. j*block_size + block_size - 1 (pad with block 0); the
                                     request's own list, not a copy: read it before update_from_output()
    state_slot            int >= 1    live KDA slot: initial state (unless context_len == 0), final state out
    checkpoint_positions  [P_i] int   ascending, each in (context_len, context_len + T_i], P_i <= P: export the
                                     KDA recurrent + conv state after that many tokens (pad with -1)
    checkpoint_slots      [P_i] int   destination slot of each export
    is_sampled            bool        the chunk ends at the request's last known token: the token sampled from
                                     its last row's logits is the request's next output token (rows of
                                     non-final prefill chunks are sampled by the runner and ignored)
    """

    request: Request
    token_ids: list[int]
    context_len: int
    block_table: list[int]
    state_slot: int
    checkpoint_positions: list[int]
    checkpoint_slots: list[int]
    is_sampled: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner needs for one step. Execute in this order:

    1. (test mode) fill ``freed_blocks`` / ``freed_slots`` with NaN: they are free, nobody may read them;
    2. ``block_copies`` (src_block, dst_block): copy a whole MLA page in every MLA layer, and
       ``slot_copies`` (src_slot, dst_slot): copy the KDA recurrent + conv state in every KDA layer.
       All sources are read before any destination is written (sources and destinations are disjoint);
    3. the forward over ``sequences`` packed in list order (cu_seqlens = [0, cumsum(num_tokens)]), writing
       latents of every fed token into its page and checkpoints into their slots, then sampling one token per
       sequence from the logits of its last row.
    ``sampling_rows`` lists the sequences whose sampled token counts (``is_sampled``).
    """

    sequences: list[ScheduledSequence]
    block_copies: list[tuple[int, int]]
    slot_copies: list[tuple[int, int]]
    freed_blocks: list[int]
    freed_slots: list[int]
    preempted_request_ids: list[str]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def sampling_rows(self) -> list[int]:
        return [i for i, s in enumerate(self.sequences) if s.is_sampled]


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """Gauges and counters for /metrics. ``cache_usage`` is the fuller of the two pools (referenced entries)."""

    num_running: int
    num_waiting: int
    cache_usage: float
    block_usage: float
    slot_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_checkpoints: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig):
        pages = -(-(config.max_model_len - 1) // cache_config.block_size)
        if pages > cache_config.num_blocks - 1:
            raise ValueError(f"the page pool ({cache_config.num_blocks - 1} usable pages of "
                             f"{cache_config.block_size}) cannot hold one request of max_model_len="
                             f"{config.max_model_len} ({pages} pages)")
        self.config = config
        self.cache = CacheManager(cache_config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._in_flight: deque[SchedulerOutput] = deque()
        self._draining: dict[str, Request] = {}

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        request.sampling_params.validate()
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt of {request.num_prompt_tokens} tokens leaves no room to generate with "
                             f"max_model_len={self.config.max_model_len}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """End a request now (waiting, running, or in the middle of a step). None if it is unknown or done."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: str | int | None = None
                       ) -> Request | None:
        """End a request with a finished ``status`` (the output processor uses this for stop strings)."""
        assert status.is_finished, status
        request = self.requests.get(request_id)
        if request is None:
            return None
        was_waiting = request.status == RequestStatus.WAITING
        if was_waiting:
            self.waiting.remove(request)
        request.status = status
        request.stop_reason = stop_reason
        # Aborted requests keep nothing, nor does a request ending while a step is in flight (that step may still
        # write its live slot); otherwise the live state becomes a checkpoint.
        self._retire(request, retain_state=not was_waiting and status != RequestStatus.FINISHED_ABORTED
                     and not self._in_flight)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        cache = self.cache
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            cache_usage=max(cache.pages.usage, cache.slots.usage), block_usage=cache.pages.usage,
            slot_usage=cache.slots.usage, prefix_cache_queries=cache.stats.queries,
            prefix_cache_hits=cache.stats.hits, num_checkpoints=cache.checkpoint_count(),
            num_preemptions=self.num_preemptions, prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens)

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        if self._in_flight:
            raise RuntimeError("schedule() called while a step is in flight (update_from_output() first)")
        budget = self.config.max_num_batched_tokens
        chunks: dict[str, tuple[int, list[int]]] = {}
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decoding + prefilling:
            if budget == 0:
                break
            start = request.num_computed_tokens
            positions, n = self.cache.checkpoint_positions(request, start, min(request.num_tokens - start, budget))
            chunks[request.request_id] = (n, positions)
            budget -= n

        scheduled: list[tuple[Request, int, list[int]]] = []
        preempted: list[str] = []
        for request in list(self.running):
            if request.request_id not in chunks or request.status != RequestStatus.RUNNING:
                continue
            n, positions = chunks[request.request_id]
            while not self.cache.pages.can_allocate(self.cache.pages.num_new_pages(request, n)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                self.cache.pages.allocate(request, n)
                scheduled.append((request, n, positions))

        if not preempted:
            budget = self._admit(budget, scheduled)

        sequences = [self._sequence(request, n, positions) for request, n, positions in scheduled]
        block_copies, slot_copies = self.cache.take_copies()
        freed_blocks, freed_slots = self.cache.take_freed()
        out = SchedulerOutput(sequences, block_copies, slot_copies, freed_blocks, freed_slots, preempted)
        self._in_flight.append(out)
        return out

    def schedule_ahead(self) -> SchedulerOutput | None:
        """With exactly one step in flight: the next decode step of every running request, fed with the tokens
        that step samples on the device. None (call ``schedule()`` after ``update_from_output()``) unless every
        running request is sampled by the step in flight, none has penalties or a grammar constraint (their
        host state needs the token), nothing waits, no checkpoint falls on the new position and the pages fit.
        Requests whose in-flight token is certainly their last (max_tokens, max_model_len) are left out."""
        if len(self._in_flight) != 1 or self.waiting:
            return None
        rows = {seq.request.request_id: i for i, seq in enumerate(self._in_flight[0].sequences) if seq.is_sampled}
        plan: list[tuple[Request, int, int]] = []
        for request in self.running:
            row = rows.get(request.request_id)
            if row is None or request.constraint is not None or request.sampling_params.uses_penalties:
                return None
            if request.next_token_is_last(self.config.max_model_len):  # its in-flight token ends it
                continue
            position = request.num_tokens  # where the in-flight token goes
            if self.cache.checkpoint_positions(request, position, 1)[0]:
                return None
            plan.append((request, row, position))
        grow = [position + 1 - request.num_computed_tokens for request, _, position in plan]
        need = sum(self.cache.pages.num_new_pages(request, n) for (request, _, _), n in zip(plan, grow))
        if not plan or not self.cache.pages.can_allocate(need):
            return None
        sequences = []
        for (request, row, position), n in zip(plan, grow):
            self.cache.pages.allocate(request, n)
            sequences.append(ScheduledSequence(
                request=request, token_ids=[PENDING_TOKEN - row], context_len=position,
                block_table=request.block_table, state_slot=request.state_slot, checkpoint_positions=[],
                checkpoint_slots=[], is_sampled=True))
        block_copies, slot_copies = self.cache.take_copies()
        freed_blocks, freed_slots = self.cache.take_freed()
        out = SchedulerOutput(sequences, block_copies, slot_copies, freed_blocks, freed_slots, [])
        self._in_flight.append(out)
        return out

    def update_from_output(self, output: SchedulerOutput, sampled: SampledTokens) -> list[Request]:
        """Advance every scheduled request by its step; append sampled tokens and apply stop conditions.

        ``sampled`` holds one row per sequence of ``output`` (host numpy arrays). Returns the requests that
        got a token or finished, in sequence order; finished ones have released their pages and slot.
        """
        if not self._in_flight or output is not self._in_flight[0]:
            raise RuntimeError("update_from_output() must get the oldest scheduled step's output")
        self._in_flight.popleft()
        queued = {seq.request.request_id for seq in self._in_flight[0].sequences} if self._in_flight else set()
        changed = []
        tokens = np.asarray(sampled.token_ids).tolist()
        for row, seq in enumerate(output.sequences):
            request = seq.request
            if self._draining.pop(request.request_id, None) is not None:
                # it stopped last step; this step fed its final token: keep the complete state
                request.num_computed_tokens += seq.num_tokens
                self.cache.on_step_done(request, [])
                self.cache.free_request(request, retain_state=True)
                continue
            if request.status != RequestStatus.RUNNING:
                self.cache.slots.free_checkpoints(seq.checkpoint_slots)
                continue
            request.num_computed_tokens += seq.num_tokens
            self.cache.on_step_done(request, list(zip(seq.checkpoint_positions, seq.checkpoint_slots)))
            if not seq.is_sampled:
                continue
            token = tokens[row]
            if request.num_output_tokens == 0:
                self.num_prompt_tokens += request.num_prompt_tokens
            request.append_output_token(token, self._logprob_entry(request, sampled, row, token))
            self.num_generation_tokens += 1
            if request.check_stop(self.config.max_model_len):
                if request.request_id in queued:
                    self._drain(request)
                else:
                    self._retire(request, retain_state=True)
            changed.append(request)
        self.cache.release_step_pins()
        return changed

    # ---- internals ----
    def _admit(self, budget: int, scheduled: list[tuple[Request, int, list[int]]]) -> int:
        """Admit waiting requests FCFS while budget, max_num_seqs and memory allow; returns the budget left."""
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if self._waits_for_parent(request):
                skipped.append(request)
                continue
            hit = self.cache.find_prefix(request)
            self.cache.plan_checkpoints(request, hit)
            positions, n = self.cache.checkpoint_positions(
                request, hit.num_tokens, min(request.num_tokens - hit.num_tokens, budget))
            if not self.cache.can_admit(request, hit, n):
                self.waiting.appendleft(request)
                break
            self.cache.admit(request, hit, n)
            if request.num_preemptions == 0 and request.num_output_tokens == 0:
                request.num_cached_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, n, positions))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _waits_for_parent(self, request: Request) -> bool:
        """n > 1 siblings start once the parent's prompt-end checkpoint exists (or the parent is gone)."""
        parent = request.parent
        return (self.cache.enable_prefix_caching and parent is not None and not parent.is_finished
                and parent.num_computed_tokens < parent.num_prompt_tokens - 1)

    def _sequence(self, request: Request, n: int, positions: list[int]) -> ScheduledSequence:
        start = request.num_computed_tokens
        slots = []
        for _ in positions:
            slot = self.cache.slots.allocate_checkpoint()
            if slot is None:
                break
            slots.append(slot)
        return ScheduledSequence(
            request=request, token_ids=request.all_token_ids[start:start + n], context_len=start,
            block_table=request.block_table, state_slot=request.state_slot,
            checkpoint_positions=positions[:len(slots)], checkpoint_slots=slots,
            is_sampled=start + n == request.num_tokens)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.free_request(request, retain_state=True)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _drain(self, request: Request) -> None:
        """Finished, but a queued step still feeds it: release its resources when that step is done."""
        self.running.remove(request)
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]
        self._draining[request.request_id] = request

    def _retire(self, request: Request, *, retain_state: bool) -> None:
        if request in self.running:
            self.running.remove(request)
        self.cache.free_request(request, retain_state=retain_state)
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]

    @staticmethod
    def _logprob_entry(request: Request, sampled: SampledTokens, row: int, token: int) -> dict[int, float] | None:
        k = request.sampling_params.logprobs
        if k is None:
            return None
        entry = {token: float(sampled.logprobs[row])}
        top_ids = np.asarray(sampled.top_token_ids[row, :k])
        top_lps = np.asarray(sampled.top_logprobs[row, :k])
        for tid, lp in zip(top_ids.tolist(), top_lps.tolist()):
            entry.setdefault(int(tid), float(lp))
        return entry
