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
* speculative decoding (``SpeculativeConfig``): when every running request is decoding and nothing waits for
  admission, the step verifies drafts: each sequence feeds its last token and up to k drafts (1 + k tokens of
  budget per running request) and gets one fresh KDA slot per fed token for the state after it. Afterwards the
  slot after the last accepted token becomes the live slot and the others are freed, so a rejected draft never
  reaches the state the request continues from (and no state is copied). Drafts stop where max_tokens or
  max_model_len would end the request anyway, and a request whose slots or pages do not fit verifies none. With a
  device drafter the next verification step is scheduled while one runs (``schedule_ahead``): its rows are
  chained, built on the device from the running step's accepted count, drawn token and new drafts; the host
  learns those counts when it applies the step, and a request that stopped in it drains through the next. A
  request whose verification steps keep rejecting its drafts pauses drafting (``DraftGate``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

PENDING_TOKEN = -1
"""Placeholder ids are ``PENDING_TOKEN - row``: the token sampled for ``row`` by the step before."""
NON_FINITE_MESSAGE = ("The model produced non-finite logits (NaN or infinity) for this request, so it was stopped; "
                      "other requests were not affected.")

import numpy as np

from serve.engine import ngram
from serve.engine.cache_manager import CacheConfig, CacheManager
from serve.engine.draft_gate import DraftGate
from serve.engine.outputs import SampledTokens, SpecDecodeStats
from serve.engine.request import Request, RequestStatus
from serve.engine.spec_config import SpeculativeConfig


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
    num_drafts            int         verification steps: token_ids = [last token] + num_drafts drafts, and
                                     checkpoint_positions / slots name the state after each fed token
    draft_limit           int         a chained verification row (scheduled ahead: token_ids = [-1 - r] alone):
                                     its last token, drafts, context, live slot and checkpoint positions come
                                     from row r of the step before on the device
                                     (``speculation.chain_verification``), which verifies no draft at or past
                                     this length cap; context_len and state_slot are then the values before
                                     that step, num_drafts is k and checkpoint_slots holds 1 + k slots
    """

    request: Request
    token_ids: list[int]
    context_len: int
    block_table: list[int]
    state_slot: int
    checkpoint_positions: list[int]
    checkpoint_slots: list[int]
    is_sampled: bool
    num_drafts: int = 0
    draft_limit: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def scheduled_ahead(self) -> bool:
        """Its first token is the one the step before samples on the device."""
        return self.token_ids[0] < 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner needs for one step. Execute in this order:

    1. (test mode) fill ``freed_blocks`` / ``freed_slots`` with NaN: they are free, nobody may read them;
    2. ``scrub_blocks`` / ``scrub_slots``: overwrite these pages / slots with entry 0 (scratch, finite): they
       held a failed request, whose last step may have written NaN there; then
       ``block_copies`` (src_block, dst_block): copy a whole MLA page in every MLA layer, and
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
    verify_len: int = 0  # 1 + k in a verification step (every sequence then owns that many rows), else 0
    scrub_blocks: list[int] = dataclasses.field(default_factory=list)
    scrub_slots: list[int] = dataclasses.field(default_factory=list)

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
    spec_decode: SpecDecodeStats | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig,
                 speculative: SpeculativeConfig | None = None, *, draft_lookahead: int = 0):
        """``draft_lookahead``: positions past a sampled token a device drafter writes (its draft block), given
        pages when the request speculates."""
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
        self._scrub: tuple[list[int], list[int]] = ([], [])  # pages, slots of failed requests to overwrite
        self.speculative = speculative
        self.draft_lookahead = draft_lookahead
        self.spec_stats = SpecDecodeStats(accepted_per_pos=[0] * speculative.num_speculative_tokens) \
            if speculative else None
        # The ngram method's drafts, request -> up to k token ids: prompt lookup (a bench may substitute an oracle)
        self.host_drafter = self._ngram_lookup

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        request.sampling_params.validate()
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt of {request.num_prompt_tokens} tokens leaves no room to generate with "
                             f"max_model_len={self.config.max_model_len}")
        request.status = RequestStatus.WAITING
        if self.speculative is not None and self.speculative.acceptance_floor:
            request.draft_gate = DraftGate(self.speculative.acceptance_floor)
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
        # Aborted and failed requests keep nothing, nor does a request ending while a step is in flight (that step
        # may still write its live slot); otherwise the live state becomes a checkpoint.
        self._retire(request, retain_state=not was_waiting and not self._in_flight
                     and status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR))
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
            generation_tokens=self.num_generation_tokens, spec_decode=self.spec_stats)

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        if self._in_flight:
            raise RuntimeError("schedule() called while a step is in flight (update_from_output() first)")
        budget = self.config.max_num_batched_tokens
        chunks: dict[str, tuple[int, list[int]]] = {}
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        if self._verifies(decoding, prefilling):
            out = self._schedule_verify(decoding)
            if out is not None:
                self._in_flight.append(out)
                return out
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
                self._reserve_lookahead(request, n)

        if not preempted:
            budget = self._admit(budget, scheduled)

        sequences = [self._sequence(request, n, positions) for request, n, positions in scheduled]
        block_copies, slot_copies = self.cache.take_copies()
        freed_blocks, freed_slots = self.cache.take_freed()
        out = SchedulerOutput(sequences, block_copies, slot_copies, freed_blocks, freed_slots, preempted,
                              **self._take_scrubs())
        self._in_flight.append(out)
        return out

    def schedule_ahead(self) -> SchedulerOutput | None:
        """With exactly one step in flight: the next decode step of every running request, fed with the tokens
        that step samples on the device. None (call ``schedule()`` after ``update_from_output()``) unless every
        running request is sampled by the step in flight, none has penalties or a grammar constraint (their
        host state needs the token) or spends its thinking budget with that token, nothing waits, no checkpoint
        falls on the new position and the pages fit.
        Requests whose in-flight token is certainly their last (max_tokens, max_model_len) are left out.
        Speculating: the next verification step, chained to the one in flight (``_schedule_verify_ahead``)."""
        if len(self._in_flight) != 1 or self.waiting:
            return None
        if self._speculating():
            return self._schedule_verify_ahead()
        if self._in_flight[0].verify_len:  # how many tokens it emits is known only after it (drafting paused since)
            return None
        rows = {seq.request.request_id: i for i, seq in enumerate(self._in_flight[0].sequences) if seq.is_sampled}
        plan: list[tuple[Request, int, int]] = []
        for request in self.running:
            row = rows.get(request.request_id)
            if row is None or request.constraint is not None or request.sampling_params.uses_penalties:
                return None
            if request.think_tokens_left == 1:  # its in-flight token spends the thinking budget: tokens follow
                return None
            if request.num_tokens > request.num_computed_tokens + self._in_flight[0].sequences[row].num_tokens:
                return None  # the engine appended tokens (the thinking closer) after those in flight: feed them first
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
        out = SchedulerOutput(sequences, block_copies, slot_copies, freed_blocks, freed_slots, [],
                              **self._take_scrubs())
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
        spec = sampled.spec
        finite = [True] * len(tokens) if sampled.finite is None else np.asarray(sampled.finite).tolist()
        for row, seq in enumerate(output.sequences):
            request = seq.request
            if not finite[row]:
                if self._fail_sequence(seq, NON_FINITE_MESSAGE):
                    changed.append(request)
                continue
            if output.verify_len:
                if self._apply_verified(seq, row, sampled, queued):
                    changed.append(request)
                continue
            if request.request_id in self._draining:
                # it stopped last step; this step fed its final token: keep the complete state
                request.num_computed_tokens += seq.num_tokens
                self.cache.on_step_done(request, [])
                self._drain_done(request, retain_state=True)
                continue
            if request.status != RequestStatus.RUNNING:
                self.cache.slots.free_checkpoints(seq.checkpoint_slots)
                continue
            request.num_computed_tokens += seq.num_tokens
            self.cache.on_step_done(request, list(zip(seq.checkpoint_positions, seq.checkpoint_slots)))
            if not seq.is_sampled or request.num_tokens > request.num_computed_tokens:
                # (the second: a step launched ahead, after which the step before appended tokens of the engine's,
                # the thinking closer: they take this sample's place and are fed next)
                continue
            token = tokens[row]
            if request.num_output_tokens == 0:
                self.num_prompt_tokens += request.num_prompt_tokens
            request.append_output_token(token, self._logprob_entry(request, sampled, row, token))
            self.num_generation_tokens += 1
            if self._stops(request):
                if request.request_id in queued:
                    self._drain(request)
                else:
                    self._retire(request, retain_state=True)
            elif (self.speculative is not None and self.speculative.on_device
                  and request.num_tokens == request.num_computed_tokens + 1):  # a step past the batch bound: none
                request.draft_token_ids = ([] if spec is None else
                                           np.asarray(spec.drafts[row, :int(spec.num_drafts[row])]).tolist())
                self._gate_step(request)
            changed.append(request)
        self.cache.release_step_pins()
        if self.speculative is not None and self.speculative.method == "ngram":
            self._propose_host_drafts()
        return changed

    # ---- failures ----
    def in_flight(self, output: SchedulerOutput) -> bool:
        """Whether ``output`` is a step scheduled and not yet applied or failed."""
        return any(o is output for o in self._in_flight)

    def fail_step(self, output: SchedulerOutput, message: str) -> list[Request]:
        """A scheduled step failed (its launch or its result raised): fail every request it holds (``message`` is
        their error, meant for the client), release their pages, live slots and the step's checkpoint or
        verification slots, and forget the step. ``output`` may be any step in flight (a step launched ahead
        fails while the one before it runs). Returns the requests that ended here, in sequence order."""
        if not self.in_flight(output):
            raise RuntimeError("fail_step() must get a step in flight")
        self._in_flight = deque(o for o in self._in_flight if o is not output)
        scrub_blocks, scrub_slots = self._scrub
        scrub_blocks += output.scrub_blocks  # the failed launch may never have run them
        scrub_slots += output.scrub_slots
        failed = [seq.request for seq in output.sequences if self._fail_sequence(seq, message)]
        if not self._in_flight:
            self.cache.release_step_pins()
        return failed

    def fail_running(self, message: str) -> list[Request]:
        """Fail every running (and draining) request: the device state they hold was lost. Waiting requests keep
        their place (they hold no cache state and restart from their tokens)."""
        failed = list(self.running)
        for request in failed:
            self._fail(request, message)
        for request in list(self._draining.values()):
            self._drain_done(request, retain_state=False)
        self._in_flight.clear()
        self.cache.release_step_pins()
        return failed

    def _fail_sequence(self, seq: ScheduledSequence, message: str) -> bool:
        """Fail the request of a step's sequence and release the step's checkpoint slots; True if it was live."""
        self._release_checkpoint_slots(seq.checkpoint_slots)
        request = seq.request
        if request.request_id in self._draining:  # it finished last step: drop its possibly broken final state
            self._drain_done(request, retain_state=False)
            return False
        if request.status != RequestStatus.RUNNING:
            return False
        self._fail(request, message)
        return True

    def _fail(self, request: Request, message: str) -> None:
        """End a running request with FINISHED_ERROR; its pages and slot are freed (no state kept) and scrubbed."""
        self._queue_scrub(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        self._retire(request, retain_state=False)

    def _drain_done(self, request: Request, *, retain_state: bool) -> None:
        del self._draining[request.request_id]
        if not retain_state:
            self._queue_scrub(request)
        self.cache.free_request(request, retain_state=retain_state)

    def _queue_scrub(self, request: Request) -> None:
        """Pages and the live slot that freeing the request returns to the free lists (shared or indexed pages
        hold only what successful steps wrote)."""
        blocks, slots = self.cache.pages.pool, self.cache.slots.pool
        self._scrub[0].extend(b for b in request.block_table if blocks.refs(b) == 1 and not blocks.holds(b))
        if request.state_slot and slots.refs(request.state_slot) == 1 and not slots.holds(request.state_slot):
            self._scrub[1].append(request.state_slot)

    def _release_checkpoint_slots(self, checkpoint_slots: list[int]) -> None:
        """Free the checkpoint slots of a failed row, scrubbing them (the step may have written NaN there)."""
        pool = self.cache.slots.pool
        self._scrub[1].extend(s for s in checkpoint_slots if pool.refs(s) == 1 and not pool.holds(s))
        self.cache.slots.free_checkpoints(checkpoint_slots)

    def _take_scrubs(self) -> dict[str, list[int]]:
        blocks, slots = self._scrub
        self._scrub = ([], [])
        return {"scrub_blocks": sorted(set(blocks)), "scrub_slots": sorted(set(slots))}

    # ---- speculative decoding ----
    def _propose_host_drafts(self) -> None:
        """Host drafts for every decoding request that may speculate (when the next step can verify)."""
        spec = self.speculative
        active = spec.speculates(len(self.running))
        for request in self.running:
            decoding = request.num_tokens - request.num_computed_tokens == 1
            may = active and decoding and request.sampling_params.can_speculate
            if may:
                self._gate_step(request)
            request.draft_token_ids = self.host_drafter(request) if may and self._drafts_now(request) else []

    def _gate_step(self, request: Request) -> None:
        """Before a step ``request`` could draft in (its ``DraftGate`` counts paused steps)."""
        if request.draft_gate is not None:
            request.draft_gate.step()
            self.spec_stats.num_paused_steps += not request.draft_gate.drafting

    @staticmethod
    def _drafts_now(request: Request) -> bool:
        """Whether ``request``'s drafts go into the next step it takes part in (its ``DraftGate`` is not paused).
        Device drafts are kept either way: a step chained before the gate paused verifies them."""
        return request.draft_gate is None or request.draft_gate.drafting

    def _ngram_lookup(self, request: Request) -> list[int]:
        """N-gram prompt lookup over the request's prompt and output so far."""
        spec = self.speculative
        return ngram.propose(request.all_token_ids, spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max, request.token_bytes())

    def _speculating(self) -> bool:
        """Drafts are verified in the next step (the batch is small enough) for some running request."""
        spec = self.speculative
        return (spec is not None and spec.speculates(len(self.running))
                and any(r.draft_token_ids and r.sampling_params.can_speculate and self._drafts_now(r)
                        for r in self.running))

    def _verifies(self, decoding: list[Request], prefilling: list[Request]) -> bool:
        """The next step is a verification step: drafts exist, every running request decodes, and nothing that
        could be admitted waits (admission goes first: a prefill chunk would make the step a mixed one)."""
        if not self._speculating() or prefilling:
            return False
        return not (self.waiting and len(self.running) < self.config.max_num_seqs)

    def _num_drafts(self, request: Request) -> int:
        """Drafts worth verifying for ``request`` now: at most k, none past what max_tokens or max_model_len
        still allow after the token the step draws itself (the rule ``chain_verification`` applies on the device
        to ``_draft_limit``)."""
        room = self._draft_limit(request) - request.num_tokens - 1
        return max(0, min(len(request.draft_token_ids), self.speculative.num_speculative_tokens, room))

    def _schedule_verify(self, decoding: list[Request]) -> SchedulerOutput | None:
        """A verification step over every decoding request, or None when no request ends up with drafts (the
        caller then schedules a plain decode step)."""
        tq = 1 + self.speculative.num_speculative_tokens
        budget = self.config.max_num_batched_tokens
        plan: list[tuple[Request, int, list[int]]] = []
        for request in decoding:
            m = min(self._num_drafts(request), max(budget - 1, 0)) if self._drafts_now(request) else 0
            lookahead = self.draft_lookahead if m else 0
            pages = self.cache.pages.num_new_pages(request, 1 + m + lookahead)
            if m and not self.cache.pages.can_allocate(pages):
                m, lookahead = 0, 0
                pages = self.cache.pages.num_new_pages(request, 1)
            if not self.cache.pages.can_allocate(pages):
                self._release_slots(plan)
                return None  # the plain step preempts
            slots = [self.cache.slots.allocate_checkpoint() for _ in range(1 + m)]
            if None in slots:
                self.cache.slots.free_checkpoints([x for x in slots if x is not None])
                self._release_slots(plan)
                return None
            self.cache.pages.allocate(request, 1 + m + lookahead)
            plan.append((request, m, slots))
            budget -= 1 + m
        if not any(m for _, m, _ in plan):
            self._release_slots(plan)
            return None
        sequences = []
        for request, m, slots in plan:
            start = request.num_computed_tokens
            sequences.append(ScheduledSequence(
                request=request, token_ids=[request.all_token_ids[-1]] + request.draft_token_ids[:m],
                context_len=start, block_table=request.block_table, state_slot=request.state_slot,
                checkpoint_positions=list(range(start + 1, start + 2 + m)), checkpoint_slots=slots,
                is_sampled=True, num_drafts=m))
        block_copies, slot_copies = self.cache.take_copies()
        freed_blocks, freed_slots = self.cache.take_freed()
        return SchedulerOutput(sequences, block_copies, slot_copies, freed_blocks, freed_slots, [], verify_len=tq,
                               **self._take_scrubs())

    def _schedule_verify_ahead(self) -> SchedulerOutput | None:
        """The verification step after the one in flight, before its result is known: every running request
        feeds, on the device, that step's drawn token and the drafts drawn after it (a chained row, see
        ``ScheduledSequence.draft_limit``), so the device never waits for the host between verification steps.
        None (schedule after the result) unless the step in flight verifies every running request, the drafter
        runs on the device, the batch still speculates, no request has a grammar, penalties or a thinking budget
        (their host state needs the tokens) or a paused ``DraftGate``, the token budget holds 1 + k rows per
        request, and each request gets 1 + k slots and pages for the most the two steps may write (its table
        staying within max_model_len)."""
        prev, spec = self._in_flight[0], self.speculative
        tq = 1 + spec.num_speculative_tokens
        running = self.running
        if (not prev.verify_len or not spec.on_device or not spec.speculates(len(running))
                or len(running) * tq > self.config.max_num_batched_tokens):
            return None
        rows = {seq.request.request_id: i for i, seq in enumerate(prev.sequences)}
        if any(rows.get(r.request_id) is None or r.constraint is not None or r.sampling_params.uses_penalties
               or r.think_tokens_left is not None or not self._drafts_now(r) for r in running):
            return None
        # the step in flight keeps at most tq tokens; this one writes tq rows and the drafter's block after them
        reach = 2 * tq + self.draft_lookahead + 1
        pages = self.cache.pages
        need = [pages.num_new_pages(r, reach) for r in running]
        if (any(r.num_computed_tokens + reach > self.config.max_model_len for r in running)
                or not pages.can_allocate(sum(need)) or not self.cache.slots.can_allocate(len(running) * tq)):
            return None
        limits = [self._draft_limit(r) for r in running]
        if not any(limit - (r.num_tokens + 1) - 1 > 0 for r, limit in zip(running, limits)):
            return None  # no request keeps room for a draft even if the step in flight emits only one token
        sequences = []
        for request, limit in zip(running, limits):
            pages.allocate(request, reach)
            slots = [self.cache.slots.allocate_checkpoint() for _ in range(tq)]
            sequences.append(ScheduledSequence(
                request=request, token_ids=[PENDING_TOKEN - rows[request.request_id]],
                context_len=request.num_computed_tokens, block_table=request.block_table,
                state_slot=request.state_slot, checkpoint_positions=[], checkpoint_slots=slots, is_sampled=True,
                num_drafts=tq - 1, draft_limit=limit))
        block_copies, slot_copies = self.cache.take_copies()
        freed_blocks, freed_slots = self.cache.take_freed()
        out = SchedulerOutput(sequences, block_copies, slot_copies, freed_blocks, freed_slots, [], verify_len=tq,
                              **self._take_scrubs())
        self._in_flight.append(out)
        return out

    def _draft_limit(self, request: Request) -> int:
        """The length cap drafts stop before (``ScheduledSequence.draft_limit``): min(max_model_len, prompt +
        max_tokens), 0 for a request that does not speculate."""
        params = request.sampling_params
        if not params.can_speculate:
            return 0
        limit = self.config.max_model_len
        return limit if params.max_tokens is None else min(limit, request.num_prompt_tokens + params.max_tokens)

    def _release_slots(self, plan: list[tuple[Request, int, list[int]]]) -> None:
        for _, _, slots in plan:
            self.cache.slots.free_checkpoints(slots)

    def _reserve_lookahead(self, request: Request, n: int) -> None:
        """Pages for a device drafter's block after the token this step samples for a speculating request (the
        drafter writes its block there; without the pages its drafts are wasted, never wrong)."""
        if (self.draft_lookahead and request.num_computed_tokens + n == request.num_tokens
                and request.sampling_params.can_speculate and self.speculative.speculates(len(self.running))
                and self.cache.pages.can_allocate(self.cache.pages.num_new_pages(request, n + self.draft_lookahead))):
            self.cache.pages.allocate(request, n + self.draft_lookahead)

    def _apply_verified(self, seq: ScheduledSequence, row: int, sampled: SampledTokens, queued: set[str]) -> bool:
        """Append a verification row's accepted drafts and drawn token (stopping at a stop condition), keep the
        KDA state after the last fed token that stays computed and free the other slots. A request that stops
        while ``queued`` in the step after drains. True if the request got tokens."""
        request = seq.request
        slots = seq.checkpoint_slots
        if request.request_id in self._draining:  # it stopped in the step before: its live state is complete
            self.cache.slots.free_checkpoints(slots)
            self._drain_done(request, retain_state=True)
            return False
        if request.status != RequestStatus.RUNNING:
            self.cache.slots.free_checkpoints(slots)
            return False
        # a chained row verified what the device fed it: the drafts the last step left, as many as room allows
        num_drafts = self._num_drafts(request) if seq.scheduled_ahead else seq.num_drafts
        start = request.num_computed_tokens  # (a chained row's context_len is the one before the step before)
        accepted = int(sampled.spec.num_accepted[row])
        emitted = np.asarray(sampled.spec.emitted[row, :accepted + 1]).tolist()
        stats = self.spec_stats
        if num_drafts:
            stats.num_drafts += 1
            stats.num_draft_tokens += num_drafts
            stats.num_accepted_tokens += accepted
            for i in range(accepted):
                stats.accepted_per_pos[i] += 1
            if request.draft_gate is not None:
                request.draft_gate.record(accepted)
        if request.num_output_tokens == 0:
            self.num_prompt_tokens += request.num_prompt_tokens
        appended, stopped = 0, False
        forced = False
        for token in emitted:
            request.append_output_token(token)
            appended += 1
            self.num_generation_tokens += 1
            before = request.num_tokens
            if self._stops(request):
                stopped = True
                break
            if request.num_tokens > before:  # the thinking budget ran out: its closing tokens follow
                forced = True
                break
        kept = appended  # fed tokens whose state stays: the last token and the accepted drafts before the end
        old_live = request.state_slot
        request.state_slot = slots[kept - 1]
        request.num_computed_tokens += kept
        interval = self.cache.config.retention_interval
        checkpoints = [(start + 1 + t, slots[t]) for t in range(kept - 1)
                       if interval and (start + 1 + t) % interval == 0]
        held = {slot for _, slot in checkpoints}
        self.cache.slots.free_checkpoints([s for t, s in enumerate(slots) if t >= kept or
                                           (t < kept - 1 and s not in held)])
        self.cache.slots.free_checkpoints([old_live])
        self.cache.on_step_done(request, checkpoints)
        request.draft_token_ids = []
        if stopped:
            if request.request_id in queued:
                self._drain(request)
            else:
                self._retire(request, retain_state=True)
        elif sampled.spec is not None and self.speculative.on_device and not forced:
            request.draft_token_ids = np.asarray(sampled.spec.drafts[row, :int(sampled.spec.num_drafts[row])]).tolist()
            self._gate_step(request)
        return True

    # ---- internals ----
    def _stops(self, request: Request) -> bool:
        """After a sampled token was appended: apply the stop conditions, else the thinking budget (whose
        closing tokens may in turn reach a length limit). True if the request finished."""
        limit = self.config.max_model_len
        return request.check_stop(limit) or (request.close_thinking_if_due(limit) and request.check_stop(limit))

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
        request.draft_token_ids = []
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
