"""A scripted stand-in for the engine's `AsyncEngine`, for tests of the HTTP layer.

`FakeAsyncEngine` follows the shared interface (generate / abort / stats / tokenizer / max_model_len) and the
engine's stopping rules (EOS unless ignore_eos, stop strings, stop token ids, max_tokens, constraint end), but
its "model" is a reply function: `reply(prompt_ids, params, index) -> text` (special-token names allowed). Each
step emits the next token of the scripted reply; under a `TokenConstraint` a token the mask forbids is replaced
by an allowed one: end of sequence first, then the allowed special token with the highest id (in the Kimi
layouts `<|close|>` ranks above `<|open|>`, so elements end rather than nest), then `"`, `}`, `]`, `0`, then the
lowest allowed id that is not whitespace, then the lowest allowed id. Constrained output is therefore always
grammatical and finite, as with a real model.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
from collections.abc import Callable

from kimi_jax.tokenizer import IncrementalDetokenizer
from serve.engine.async_engine import EngineOverloadedError, RequestFailedError
from serve.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    SpecDecodeStats,
)
from serve.engine.sampling_params import SamplingParams
from serve.openai.constraints import allowed_ids

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima")


def random_words_reply(prompt_ids: list[int], params: SamplingParams, index: int) -> str:
    """Twelve words drawn from a generator seeded by (seed, index); unseeded requests differ from each other."""
    seed = params.seed if params.seed is not None else random.getrandbits(32)
    rng = random.Random(seed * 1000 + index)
    return " ".join(rng.choice(WORDS) for _ in range(12))


class _Sequence:
    def __init__(self, tokenizer, params: SamplingParams, script: list[int], index: int):
        self.index = index
        self.script = script
        self.params = params
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.text = ""
        self.constraint = params.constraint_factory() if params.constraint_factory else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def output(self) -> CompletionOutput:
        cumulative = None if self.logprobs is None else sum(e[t] for e, t in zip(self.logprobs, self.token_ids))
        return CompletionOutput(self.index, self.text, list(self.token_ids),
                                None if self.logprobs is None else list(self.logprobs), cumulative,
                                self.finish_reason, self.stop_reason)


class FakeAsyncEngine:
    """Args:
      tokenizer: a kimi_jax Tokenizer (e.g. `load_tokenizer("tiny")`).
      max_model_len: context limit the server checks against.
      reply: the scripted model (see module docstring); tests may swap `engine.reply` between requests.
      step_delay_s: sleep per decode step, so streams interleave and can be cut mid-way.
      max_num_seqs: requests beyond this many running ones wait (shows in num_requests_waiting).
      num_speculative_tokens: > 0: every token counts as one verification row of that many drafts, of which the
        first ``token % (k + 1)`` were accepted (``stats().spec_decode``, so ``/metrics`` carries the counters).
    """

    def __init__(self, tokenizer, *, max_model_len: int = 512,
                 reply: Callable[[list[int], SamplingParams, int], str] = random_words_reply,
                 step_delay_s: float = 0.002, max_num_seqs: int = 64, num_speculative_tokens: int = 0):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_config = None
        self.reply = reply
        self.step_delay_s = step_delay_s
        self.max_num_seqs = max_num_seqs
        self.received: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: list[str] = []
        self.overloaded = False
        self.fail_after: int | None = None  # steps after which every request fails (output.error set)
        self._abort_requested: set[str] = set()
        self._running: set[str] = set()
        self._waiting = 0
        self._counts = collections.Counter()  # the counter fields of EngineStats
        self._seen_prompts: list[list[int]] = []
        k = num_speculative_tokens
        self.spec_decode = SpecDecodeStats(accepted_per_pos=[0] * k) if k else None

    def check_admission(self, num_prompt_tokens: int, n: int = 1) -> None:
        """Refuse with EngineOverloadedError while `overloaded` is set (tests of the 503)."""
        if self.overloaded:
            raise EngineOverloadedError("The server is overloaded: test. Retry after 1 s.", retry_after_s=1)

    @property
    def num_open_streams(self) -> int:
        return self._waiting + len(self._running)

    def abort_all(self) -> None:
        self._abort_requested.update(self._running)

    def stats(self) -> EngineStats:
        counters = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                    "generation_tokens")
        return EngineStats(num_running=len(self._running), num_waiting=self._waiting,
                           cache_usage=len(self._running) / self.max_num_seqs,
                           spec_decode=self.spec_decode, **{name: self._counts[name] for name in counters})

    async def abort(self, request_id: str) -> None:
        self._abort_requested.add(request_id)
        self.aborted.append(request_id)

    def _prefix_hit(self, prompt_ids: list[int]) -> int:
        best = 0
        for seen in self._seen_prompts:
            common = 0
            for a, b in zip(seen, prompt_ids):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        self._seen_prompts.append(list(prompt_ids))
        return best

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str):
        params.validate()
        self.received[request_id] = (list(prompt_token_ids), params)
        metrics = RequestMetrics(arrival_time=time.monotonic())
        self._waiting += 1
        while len(self._running) >= self.max_num_seqs:
            await asyncio.sleep(self.step_delay_s)
        self._waiting -= 1
        self._running.add(request_id)
        hits = self._prefix_hit(prompt_token_ids)
        self._counts["prefix_cache_queries"] += len(prompt_token_ids)
        self._counts["prefix_cache_hits"] += hits
        self._counts["prompt_tokens"] += len(prompt_token_ids) - hits
        metrics.num_cached_tokens = hits
        seqs = [_Sequence(self.tokenizer, params,
                          self.tokenizer.encode(self.reply(prompt_token_ids, params, i), allow_special=True), i)
                for i in range(params.n)]
        try:
            for step in itertools.count():
                await asyncio.sleep(self.step_delay_s)
                if self.fail_after is not None and step >= self.fail_after:
                    raise RequestFailedError("The engine step running this request failed; the request was stopped.")
                if request_id in self._abort_requested:
                    for seq in seqs:
                        seq.finish_reason = seq.finish_reason or "abort"
                    yield self._output(request_id, prompt_token_ids, seqs, metrics, True)
                    return
                for seq in seqs:
                    if seq.finish_reason is None:
                        self._step(seq)
                if metrics.first_token_time is None:
                    metrics.first_token_time = time.monotonic()
                finished = all(seq.finish_reason is not None for seq in seqs)
                if finished:
                    metrics.finished_time = time.monotonic()
                yield self._output(request_id, prompt_token_ids, seqs, metrics, finished)
                if finished:
                    return
        finally:
            self._running.discard(request_id)

    def _output(self, request_id, prompt_ids, seqs, metrics, finished) -> RequestOutput:
        return RequestOutput(request_id, list(prompt_ids), [s.output() for s in seqs], finished, metrics)

    def _choose(self, seq: _Sequence) -> int:
        position = len(seq.token_ids)
        eos = self.tokenizer.eos_token_ids[0]
        wanted = seq.script[position] if position < len(seq.script) else eos
        if seq.constraint is None:
            return wanted
        allowed = set(allowed_ids(seq.constraint.allowed_token_bitmask(), self.tokenizer.vocab_size).tolist())
        if wanted in allowed:
            return wanted
        special = [t for t in allowed if self.tokenizer.is_special(t)]
        visible = [t for t in allowed if self.tokenizer.token_bytes(t).strip()]
        for preferred in (*self.tokenizer.eos_token_ids, max(special, default=None),
                          *(self.tokenizer.encode(c)[0] for c in '"}]0'), min(visible, default=None)):
            if preferred in allowed:
                return preferred
        return min(allowed)

    def _step(self, seq: _Sequence) -> None:
        token = self._choose(seq)
        params = seq.params
        seq.token_ids.append(token)
        self._counts["generation_tokens"] += 1
        if self.spec_decode is not None:
            spec, k = self.spec_decode, len(self.spec_decode.accepted_per_pos)
            accepted = token % (k + 1)
            spec.num_drafts += 1
            spec.num_draft_tokens += k
            spec.num_accepted_tokens += accepted
            for position in range(accepted):
                spec.accepted_per_pos[position] += 1
        if seq.logprobs is not None:
            entry = {token: -0.5}
            for rank in range(params.logprobs):
                entry.setdefault((token + 1 + rank) % self.tokenizer.vocab_size, -1.0 - rank)
            seq.logprobs.append(entry)
        if seq.constraint is not None:
            seq.constraint.advance(token)
        if token in self.tokenizer.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
            seq.text += seq.detokenizer.flush()
            return
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return
        seq.text += seq.detokenizer.add(token)
        for stop in params.stop:
            at = seq.text.find(stop)
            if at >= 0:
                seq.text = seq.text[:at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        if len(seq.token_ids) >= params.max_tokens:
            seq.finish_reason = "length"
        elif seq.constraint is not None and seq.constraint.is_terminated():
            seq.finish_reason = "stop"
        if seq.finish_reason is not None:
            seq.text += seq.detokenizer.flush()
