"""LLMEngine: the synchronous serving loop (add_request / step / abort_request) and its output processing.

One ``step()``:
1. waits for the step launched by the previous call and feeds its sampled tokens to the scheduler
   (``update_from_output``: tokens appended, EOS / stop ids / max_tokens / max_model_len applied);
2. schedules and launches the next step (``ModelRunner.execute`` queues it on the device);
3. while the device runs, does the output processing of the tokens of 1 (incremental detokenisation, stop
   strings, n > 1 aggregation, RequestOutput building) and returns those outputs.
So the host work of 3 (and the return to the caller, and whatever the caller does before calling step()
again, such as streaming to clients) overlaps the device's next step. With ``async_scheduling``, in steady
decoding step n+1 is even scheduled and launched before step n's tokens reach the host (placeholder tokens fed
from the device, ``Scheduler.schedule_ahead``), so phases 1-2 overlap the device too, and so do verification
steps with a device drafter (each chained to the one in flight, its inputs built on the device); otherwise
(admission, prefill, the first verification step after them) the device idles for their duration
(``StepTiming``). A request that a stop string ends in 3 is already part of the step in flight; the scheduler
drops that step's token for it (and, since the step may still write its slot, does not keep its final state as a
prefix-cache checkpoint).

n > 1: the request becomes n scheduler requests (``request_id``, ``request_id#1``, ...) with seeds
``seed + i``; the later ones wait for the first one's prompt and resume from its prompt-end checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from typing import Sequence

import numpy as np

from serve.engine.cache_manager import CacheConfig
from serve.engine.config import EngineConfig
from serve.engine.media import check_media
from serve.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from serve.engine.request import Request, RequestStatus
from serve.engine.runner import ModelRunner
from serve.engine.sampling_params import SamplingParams, TokenConstraint
from serve.engine.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

STEP_FAILED_MESSAGE = ("The engine step running this request failed, so the request was stopped and its cache "
                       "released; other requests were not affected. Retrying it may succeed.")
DEVICE_LOST_MESSAGE = ("The engine lost its device state while running this request (the cache was rebuilt), so "
                       "the request was stopped. Retrying it may succeed.")
OUTPUT_FAILED_MESSAGE = ("Processing this request's output failed, so the request was stopped; other requests were "
                         "not affected.")

@dataclasses.dataclass
class StepTiming:
    """Host seconds of the phases of one ``step()`` (``wait`` = blocked on the device)."""

    wait: float = 0.0
    update: float = 0.0
    schedule: float = 0.0
    launch: float = 0.0
    process: float = 0.0
    ahead: bool = False  # the step launched here was scheduled before the previous one finished

    @property
    def host(self) -> float:
        return self.update + self.schedule + self.launch + self.process


class _Completion:
    """Output state of one scheduler request (one of the n completions of a user request)."""

    def __init__(self, request: Request, index: int, tokenizer):
        self.request = request
        self.index = index
        self.text = ""
        self.num_processed = 0
        self.finish_reason: str | None = None  # set when a stop string ended it
        self.stop_reason: str | int | None = None
        self.detokenizer = None
        if tokenizer is not None:
            from kimi_jax.tokenizer import IncrementalDetokenizer
            self.detokenizer = IncrementalDetokenizer(
                tokenizer, skip_special_tokens=request.sampling_params.skip_special_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.request.is_finished

    def output(self) -> CompletionOutput:
        r = self.request
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(r.output_token_ids),
            logprobs=None if r.output_logprobs is None else list(r.output_logprobs),
            cumulative_logprob=r.cumulative_logprob, finish_reason=self.finish_reason or r.finish_reason,
            stop_reason=self.stop_reason if self.finish_reason else r.stop_reason)


class _UserRequest:
    def __init__(self, request_id: str, prompt_token_ids: list[int], completions: list[_Completion]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.completions = completions
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def output(self) -> RequestOutput:
        requests = [c.request for c in self.completions]
        first = [r.first_token_time for r in requests if r.first_token_time is not None]
        done = [r.finished_time for r in requests if r.finished_time is not None]
        finished = self.finished
        metrics = RequestMetrics(arrival_time=requests[0].arrival_time, first_token_time=min(first, default=None),
                                 finished_time=max(done, default=None) if finished else None,
                                 num_cached_tokens=requests[0].num_cached_tokens)
        return RequestOutput(self.request_id, list(self.prompt_token_ids), [c.output() for c in self.completions],
                             finished, metrics, self.error)


class _PaddedConstraint:
    """A TokenConstraint whose bitmask is narrower than the model's vocabulary: extra ids are disallowed."""

    def __init__(self, inner: TokenConstraint, num_words: int):
        self._inner = inner
        self._num_words = num_words

    def allowed_token_bitmask(self) -> np.ndarray:
        mask = np.zeros(self._num_words, np.int32)
        inner = np.asarray(self._inner.allowed_token_bitmask(), np.int32)[:self._num_words]
        mask[:len(inner)] = inner
        return mask

    def advance(self, token_id: int) -> None:
        self._inner.advance(token_id)

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()


class LLMEngine:
    """Continuous batching over one ModelRunner.

    Args:
      runner: the device side (parameters, pools, compiled buckets).
      tokenizer: a kimi_jax Tokenizer for text output and stop strings, or None (token ids only).
      config: scheduling settings for this engine (default ``runner.config``). Only ``max_model_len``,
        ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``,
        ``prefix_cache_retention_interval``, ``max_checkpoints_per_seq``, ``num_blocks_override``, ``seed`` and
        ``async_scheduling`` are read; they must fit what the runner compiled (buckets, checkpoint width);
        block size, pools, buckets, dtypes and test mode are the runner's.
    """

    def __init__(self, runner: ModelRunner, *, tokenizer=None, config: EngineConfig | None = None):
        cfg = runner.config if config is None else _scheduling_config(config, runner)
        self.runner = runner
        self.config = cfg
        self.tokenizer = tokenizer
        self.model_config = runner.model_config
        self.vision_config = runner.encoder.config if runner.encoder is not None else None  # None: text only
        self.media_rows = runner.media_rows
        if tokenizer is not None and tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only "
                             f"{self.model_config.vocab_size}")
        if tokenizer is not None:
            self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        else:
            eos = self.model_config.eos_token_id
            self.eos_token_ids = () if eos is None else (eos,)
        num_blocks = min(runner.num_blocks, cfg.num_blocks_override or runner.num_blocks)
        cache_config = CacheConfig(
            block_size=cfg.block_size, num_blocks=num_blocks, num_slots=runner.num_slots,
            enable_prefix_caching=cfg.enable_prefix_caching, retention_interval=cfg.prefix_cache_retention_interval,
            max_checkpoints_per_seq=cfg.max_checkpoints_per_seq, bytes_per_block=runner.plan.bytes_per_block,
            bytes_per_slot=runner.plan.bytes_per_slot, page_group_size=runner.page_group_size,
            media_rows=runner.media_rows)
        spec = cfg.speculative_config
        self.scheduler = Scheduler(SchedulerConfig(max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                                                   max_num_batched_tokens=cfg.max_num_batched_tokens), cache_config,
                                   spec, draft_lookahead=spec.num_speculative_tokens if runner.drafter_params else 0)
        self._rng = random.Random(cfg.seed)
        self._requests: dict[str, _UserRequest] = {}
        self._completion_of: dict[str, _Completion] = {}
        self._owner: dict[str, _UserRequest] = {}
        self._aborted: list[str] = []
        self._in_flight = None
        self.last_timing = StepTiming()
        self._compiles_seen = runner.compiles_after_warm_up

    @classmethod
    def from_pretrained(cls, model, *, tokenizer="auto", dtype="auto", seed: int = 0, impl: str | None = None,
                        mesh=None, progress: bool = False, **engine_args) -> "LLMEngine":
        """Build model, runner and engine. ``model``: preset name, checkpoint folder, KimiLM or KimiModel;
        ``tokenizer``: "auto" (the preset's / folder's, if any), a preset name or folder, a Tokenizer, or None;
        ``dtype``: parameter dtype ("auto": float32 on CPU, bfloat16 on GPU); ``progress``: progress bars on
        stderr for weight loading and warm-up compilation; ``engine_args``: EngineConfig fields.
        """
        from kimi_jax.api import load
        from serve.progress import ProgressBar

        config = EngineConfig(**engine_args)
        if isinstance(model, str):
            if dtype == "auto":
                from pallas_kernels.impl import on_gpu
                dtype = "bfloat16" if on_gpu() else "float32"
            lm = load(model, dtype, seed=seed, impl=impl,
                      progress=ProgressBar("loading weights", unit="parameters") if progress else None)
        else:
            lm = model
        drafter = _load_drafter(config.speculative_config, model, lm)
        compiling = ProgressBar("compiling step buckets", unit="executables") if progress else None
        return cls(ModelRunner(lm, config, mesh=mesh, impl=impl, progress=compiling, drafter=drafter),
                   tokenizer=_resolve_tokenizer(tokenizer, model))

    # ---- requests ----
    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the problem) for a request this engine cannot serve."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens leaves no room to generate with "
                             f"max_model_len={self.max_model_len}")
        bad = [t for t in params.thinking_end_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.thinking_end_token_ids out of range [0, {vocab}): {bad[:5]}")
        if params.logprobs is not None and params.logprobs > self.runner.config.max_logprobs:
            raise ValueError(f"SamplingParams.logprobs {params.logprobs} exceeds the engine's max_logprobs="
                             f"{self.runner.config.max_logprobs}")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer (this engine has none)")

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    *, arrival_time: float | None = None, media: Sequence = ()) -> None:
        """Queue a request; its outputs come from later ``step()`` calls. ``media``: the prompt's images
        (``media.ImageSpan``s, see ``media.find_spans``)."""
        params = params or SamplingParams()
        self.validate_request(prompt_token_ids, params)
        check_media(media, prompt_token_ids, self.runner.media_rows)
        ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]
        clash = [i for i in ids if i in self._completion_of or i in self._requests]
        if clash:
            raise ValueError(f"request id {clash[0]!r} is already in use")
        prompt = [int(t) for t in prompt_token_ids]
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        words = -(-self.model_config.vocab_size // 32)
        completions, parent = [], None
        for index, child_id in enumerate(ids):
            request = Request(child_id, prompt, params, eos_token_ids=self.eos_token_ids, arrival_time=arrival,
                              seed=(base_seed + index) % (1 << 64), parent=parent, media=media)
            if request.constraint is not None and len(request.constraint.allowed_token_bitmask()) != words:
                request.constraint = _PaddedConstraint(request.constraint, words)
            parent = parent or request
            completions.append(_Completion(request, index, self.tokenizer))
        user = _UserRequest(request_id, prompt, completions)
        for completion in completions:
            self.scheduler.add_request(completion.request)
            self._completion_of[completion.request.request_id] = completion
            self._owner[completion.request.request_id] = user
        self._requests[request_id] = user

    def abort_request(self, request_id: str) -> None:
        """End a request now; its final output (finish_reason "abort") comes from the next ``step()``."""
        user = self._requests.get(request_id)
        if user is None:
            return
        for completion in user.completions:
            self.scheduler.abort(completion.request.request_id)
        self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._in_flight is not None

    def is_idle(self) -> bool:
        """No request left and no page or slot referenced (the prefix cache may still hold entries)."""
        return not self.has_unfinished_requests() and self.scheduler.cache.is_idle()

    def idle(self) -> None:
        """Use a moment without requests: a progressive warm-up's finished executables are taken into use and a
        few of them run once (``ModelRunner.prime_ready_executables``), so no request pays for loading them. A
        no-op while any request or step is in flight; an error is logged, never raised (the loop keeps serving)."""
        if self.has_unfinished_requests():
            return
        try:
            if self.runner.prime_ready_executables():  # one could not run, and the pools were rebuilt
                self.scheduler.cache.clear_prefix_cache(spill=False)
        except Exception:  # noqa: BLE001 - priming is an optimisation; a request's step would meet the same fault
            logger.exception("priming the executables a progressive warm-up finished failed")

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """Launch the next step, finish the step in flight, and return the outputs of the finished step.

        With ``async_scheduling`` the next step is scheduled and launched before waiting for the step in flight
        whenever the scheduler can (steady decoding, see ``Scheduler.schedule_ahead``), so the device never
        waits for the host; otherwise it is scheduled after the step in flight has been applied."""
        timing = StepTiming()
        changed: list[Request] = []
        clock = time.perf_counter()
        ahead = None
        if self._in_flight is not None and self.config.async_scheduling:
            out = self.scheduler.schedule_ahead()
            clock, timing.schedule = _lap(clock)
            if out is not None:
                try:
                    ahead = (out, self.runner.execute(out))
                except Exception as err:  # noqa: BLE001 - one failed step must not stop the engine
                    changed += self._step_failed(out, err)
                clock, timing.launch = _lap(clock)
        if self._in_flight is not None:
            out, handle = self._in_flight
            self._in_flight = None
            try:
                sampled = handle.result()
            except Exception as err:  # noqa: BLE001
                changed += self._step_failed(out, err)
                if ahead is not None:  # it was fed this step's tokens
                    changed += self._step_failed(ahead[0], err)
                    ahead = None
            else:
                clock, timing.wait = _lap(clock)
                changed += self.scheduler.update_from_output(out, sampled)
            clock, timing.update = _lap(clock)
        if ahead is not None:
            self._in_flight = ahead
        elif self.scheduler.has_unfinished_requests():
            out = self.scheduler.schedule()
            clock, schedule = _lap(clock)
            timing.schedule += schedule
            try:
                handle = self.runner.execute(out)
                if out.sequences:
                    self._in_flight = (out, handle)
                else:
                    self.scheduler.update_from_output(out, handle.result())
            except Exception as err:  # noqa: BLE001
                changed += self._step_failed(out, err)
            clock, timing.launch = _lap(clock)
        timing.ahead = ahead is not None
        outputs = self._process(changed)
        _, timing.process = _lap(clock)
        self.last_timing = timing
        self._check_compiles()
        return outputs

    def _check_compiles(self) -> None:
        """Warn once per new compilation while serving: a step shape, copy or host-side op that warm-up missed
        costs seconds of latency each time it compiles (``EngineStats.compiles_after_warm_up``)."""
        count = self.runner.compiles_after_warm_up
        if count > self._compiles_seen:
            logger.warning("%d XLA compilation(s) after warm-up (%d in all): a shape or op compiled while serving",
                           count - self._compiles_seen, count)
            self._compiles_seen = count

    def _step_failed(self, out, err: BaseException) -> list[Request]:
        """A launched (or launching) step raised: fail its requests and keep serving. When the device state did
        not survive (``ModelRunner.recover``), every running request fails and the prefix cache is emptied."""
        if not self.scheduler.in_flight(out):  # already failed with the step before it
            return []
        logger.error("engine step failed; failing its %d request(s)", len(out.sequences), exc_info=err)
        lost = self.runner.recover()
        failed = self.scheduler.fail_step(out, DEVICE_LOST_MESSAGE if lost else STEP_FAILED_MESSAGE)
        if lost:
            logger.error("the device state was lost with the step: cache pools rebuilt, running requests failed")
            failed += self.scheduler.fail_running(DEVICE_LOST_MESSAGE)
            self.scheduler.cache.clear_prefix_cache(spill=False)  # the rebuilt pools hold zeros
            self._in_flight = None
        return failed

    def waiting_load(self) -> tuple[int, int]:
        """(sequences waiting for admission, their tokens to compute): the queue that admission control bounds."""
        waiting = self.scheduler.waiting
        return len(waiting), sum(r.num_tokens for r in waiting)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        load = self.runner.router_load()  # as of a recent step; never waits for the device
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting, cache_usage=s.cache_usage,
                           prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
                           num_preemptions=s.num_preemptions, prompt_tokens=s.prompt_tokens,
                           generation_tokens=s.generation_tokens, router_expert_tokens=router_expert_tokens(load),
                           router_imbalance=router_imbalance(load), spec_decode=s.spec_decode,
                           compiles_after_warm_up=self.runner.compiles_after_warm_up,
                           executables_pending=self.runner.num_compiling_executables)

    def router_load(self):
        """Routed pairs per MoE layer and expert since start, int32 [L_moe, E] (``ModelRunner.router_load``)."""
        return self.runner.router_load()

    # ---- output processing ----
    def _process(self, changed: list[Request]) -> list[RequestOutput]:
        touched: dict[str, _UserRequest] = {}
        for request in changed:
            completion = self._completion_of.get(request.request_id)
            if completion is None:
                continue
            user = self._owner[request.request_id]
            touched[user.request_id] = user
            try:
                self._advance(completion)
            except Exception as err:  # noqa: BLE001 - a detokenizer or stop-string failure ends this request only
                logger.error("output processing failed for %s", request.request_id, exc_info=err)
                self._fail_user(user, OUTPUT_FAILED_MESSAGE)
                continue
            if request.status == RequestStatus.FINISHED_ERROR:
                self._fail_user(user, request.error)
        for request_id in self._aborted:
            if request_id in self._requests:
                touched[request_id] = self._requests[request_id]
        self._aborted = []
        outputs = []
        for user in touched.values():
            outputs.append(user.output())
            if outputs[-1].finished:
                self._forget(user)
        return outputs

    def _fail_user(self, user: _UserRequest, message: str) -> None:
        """End every completion of a user request with finish_reason "error" (siblings of a failed one too: the
        request cannot be answered in part)."""
        user.error = user.error or message
        for completion in user.completions:
            request = completion.request
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
                request.error = message
            completion.finish_reason, completion.stop_reason = "error", None

    def _advance(self, completion: _Completion) -> None:
        """Detokenise the completion's new tokens and apply stop strings."""
        request = completion.request
        injector = self.runner.fault_injector
        if injector is not None:
            injector.on_detokenize(request.request_id)
        tokens = request.output_token_ids
        new = tokens[completion.num_processed:]
        completion.num_processed = len(tokens)
        if completion.detokenizer is None or completion.finish_reason is not None:
            return
        params = request.sampling_params
        hide_last = (_ended_by_stop_token(request) and not params.include_stop_str_in_output)
        for i, token in enumerate(new):
            if hide_last and i == len(new) - 1:
                break
            before = len(completion.text)
            completion.text += completion.detokenizer.add(token)
            if params.stop and self._apply_stop_strings(completion, before):
                return
        if request.is_finished:
            completion.text += completion.detokenizer.flush()

    def _apply_stop_strings(self, completion: _Completion, before: int) -> bool:
        """End the completion at the first stop string that the text from ``before`` on completes."""
        params = completion.request.sampling_params
        text = completion.text
        longest = max(len(s) for s in params.stop)
        search_from = max(0, before - longest + 1)
        found = [(text.find(s, search_from), s) for s in params.stop]
        found = [(at, s) for at, s in found if at >= 0]
        if not found:
            return False
        at, stop = min(found, key=lambda f: (f[0], -len(f[1])))
        completion.text = text[:at + len(stop)] if params.include_stop_str_in_output else text[:at]
        completion.finish_reason, completion.stop_reason = "stop", stop
        request = completion.request
        if not request.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, stop)
        return True

    def _forget(self, user: _UserRequest) -> None:
        for completion in user.completions:
            request = completion.request
            if not request.is_finished:  # ended by a stop string while its siblings finished: nothing to keep
                self.scheduler.abort(request.request_id)
            self._completion_of.pop(request.request_id, None)
            self._owner.pop(request.request_id, None)
        self._requests.pop(user.request_id, None)


def router_expert_tokens(load: np.ndarray) -> tuple[int, ...]:
    """Per-expert routed pairs summed over MoE layers."""
    return tuple(int(v) for v in load.sum(axis=0)) if load.size else ()


def router_imbalance(load: np.ndarray) -> float:
    """Mean over MoE layers of max / mean routed pairs per expert (0 before any token was routed)."""
    if not load.size or not load.sum():
        return 0.0
    per_layer = load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-9)
    return float(per_layer[load.sum(axis=1) > 0].mean())


def _ended_by_stop_token(request: Request) -> bool:
    """Finished on EOS or a stop token id (whose text is not part of the output)."""
    if request.status != RequestStatus.FINISHED_STOPPED or not request.output_token_ids:
        return False
    if isinstance(request.stop_reason, int):
        return True
    last = request.output_token_ids[-1]
    return (request.stop_reason is None and not request.sampling_params.ignore_eos
            and last in request.eos_token_ids)


def _scheduling_config(config: EngineConfig, runner: ModelRunner) -> EngineConfig:
    """``config``'s scheduling fields on top of the runner's settings, checked against what it compiled."""
    base = runner.config
    cfg = dataclasses.replace(
        base, max_model_len=config.max_model_len or base.max_model_len,
        max_num_seqs=config.max_num_seqs or base.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens or base.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        max_checkpoints_per_seq=config.max_checkpoints_per_seq, num_blocks_override=config.num_blocks_override,
        seed=config.seed, async_scheduling=config.async_scheduling, speculative_config=config.speculative_config)
    spec, compiled = config.speculative_config, base.speculative_config
    static = ("method", "num_speculative_tokens", "model", "draft_sample_method", "rejection_sample_method",
              "min_draft_confidence")
    if (spec is None) != (compiled is None) or (spec is not None and any(
            getattr(spec, f) != getattr(compiled, f) for f in static)):
        raise ValueError(f"EngineConfig.speculative_config must match the runner's in {static} (its executables "
                         "depend on them); only the scheduling fields may differ")
    limit = 0 if compiled is None else compiled.disable_by_batch_size
    if limit and not 0 < spec.disable_by_batch_size <= limit:
        raise ValueError(f"EngineConfig.speculative_config.disable_by_batch_size must be in [1, {limit}] (the runner's: "
                         f"its sequence buckets past {limit} were compiled without verification or drafting), got "
                         f"{spec.disable_by_batch_size}")
    cfg.validate(runner.model_config)
    if cfg.max_model_len > base.max_model_len:
        raise ValueError(f"EngineConfig.max_model_len {cfg.max_model_len} exceeds the runner's {base.max_model_len}")
    if cfg.max_checkpoints_per_seq > base.max_checkpoints_per_seq:
        raise ValueError(f"EngineConfig.max_checkpoints_per_seq {cfg.max_checkpoints_per_seq} exceeds the "
                         f"runner's compiled width {base.max_checkpoints_per_seq}")
    return cfg


def _load_drafter(spec, model, lm):
    """The draft model a ``draft_model`` config names (``spec.model``), or the DSpark drafter of a ``dspark`` one:
    ``spec.model`` (a folder or a preset with a shipped
    drafter), else the one beside the target: ``<folder>-dspark`` for a checkpoint folder, the shipped
    ``kimi_jax/assets/<preset>-dspark`` for a preset."""
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "draft_model":  # a preset or checkpoint folder of the same family, in the target's dtype
        from kimi_jax.api import load

        target = lm.model if hasattr(lm, "model") else lm
        return load(spec.model, target.dtype, impl=getattr(lm, "impl", None)).model
    from kimi_jax.api import shipped_checkpoint
    from kimi_jax.weights.drafter_io import load_drafter

    name = spec.model or (os.path.normpath(model) + "-dspark" if isinstance(model, str) else None)
    folder = name if name and os.path.isdir(name) else shipped_checkpoint(name) if name else None
    if folder is None:
        raise ValueError(f"speculative_config.model: no DSpark drafter at {name!r} (a checkpoint folder or a "
                         "preset with a shipped drafter, e.g. 'tiny-dspark')")
    return load_drafter(folder, lm.model if hasattr(lm, "model") else lm)


def _resolve_tokenizer(tokenizer, model):
    if tokenizer is None or not isinstance(tokenizer, str):
        return tokenizer
    if tokenizer != "auto":
        from kimi_jax.tokenizer import load_tokenizer
        return load_tokenizer(tokenizer)
    if isinstance(model, str) and (model in ("tiny", "tiny-code", "tiny-k2")
                                   or os.path.exists(os.path.join(model, "tiktoken.model"))):
        from kimi_jax.tokenizer import load_tokenizer
        return load_tokenizer(model)
    return None


def _lap(start: float) -> tuple[float, float]:
    now = time.perf_counter()
    return now, now - start
