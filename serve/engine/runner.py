"""The device side of the engine: parameters and cache pools on a mesh, one precompiled step per bucket.

A step (``ModelRunner.execute``) turns a ``SchedulerOutput`` into padded numpy arrays (a ``StepBatch``: the packed
``StepInputs`` plus per-row ``SamplingTensors``), written straight into the bucket's one int32 word buffer
(``step_batch.WordBuffer``), passes a copy of it as one host argument and launches the bucket's ahead-of-time
compiled executable (steps where every sequence decodes one token take the model's ``decode_only`` path, see
``buckets.py``): model forward over the paged hybrid cache -> logits of each sequence's last row -> grammar
bitmask, penalties, sampling and top logprobs (decode buckets also have a greedy-only variant that just takes the
argmax, picked per step on the host). The cache is donated, so pages and slots update in place. ``execute`` returns
a ``StepHandle`` with the copy of the sampled token ids to the host already queued; only token ids (and logprobs
when a row asked for them) ever cross to the host. The launch must return before the device finishes (that is what
lets the engine schedule ahead), so a step contains no ``while`` loop and no ``lax.cond``: XLA:GPU runs those by
reading their predicate on the host unless it can capture the branches in a CUDA graph (measured in BENCHMARKS.md;
the reference ops do contain loops, the Pallas path does not).

Before the forward, the runner applies the scheduler's cache copies (copy-on-write pages, checkpoint
restores) and, in test mode, fills freed pages and slots with NaN; both are separate small executables
dispatched only when there is work for them. With a KV connector (``kv_connector.py``: CPU offload, prefill /
decode transfer) its queued device -> host saves go first and its host -> device loads after the copies.

Images: with a vision tower (``vision``, or a ``KimiLM`` loaded with one) the cache gets a media pool and the
runner an encoder (``encoder.py``). Before a step, the images of its sequences whose media leases are not
encoded yet are encoded in batches into their pool rows; the step then feeds each placeholder as id
``vocab_size + row`` (``kimi_jax.model.embed_tokens`` reads the row).

Every executable is compiled at warm-up (``warm_up``), and every step is run once there on an all-padding
batch so that a step the device cannot run fails at start-up; a progressive warm-up compiles most buckets on
background threads instead, taken into use between steps and run once when the engine is idle
(``prime_ready_executables``). Calling a compiled executable never traces or compiles, and
``backend_compile_count`` (a ``jax.monitoring`` listener) lets tests prove it.

Placement: parameters, caches and step inputs carry ``NamedSharding``s of ``mesh`` (one device by default,
everything replicated). On a multi-device mesh the step's forward runs every sublayer inside ``jax.shard_map``
(``sharding.Parallel``: tensor, expert and decode context parallelism, Pallas kernels or reference ops alike);
the MLA page pool's blocks are split over the ``dcp`` ranks and the scheduler stripes each request's pages over
them (``page_group_size``). Every step also adds its router load (per-expert routed pairs of real rows) to
device-resident totals that ``router_load()`` fetches without waiting.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import threading
import time
import warnings
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kimi_jax.api import KimiLM
from kimi_jax.model import KimiModel, compute_logits, forward, use_serving_byte_order
from kimi_jax.step import HybridCache, StepInputs, init_cache
from pallas_kernels.greedy import greedy
from pallas_kernels.impl import resolve_impl
from serve.engine import multihost
from serve.engine.background_compile import BackgroundCompiler
from serve.engine.buckets import smallest_ready
from serve.engine.config import CPU_MEMORY_BUDGET, EngineConfig, kv_cache_dtype_name
from serve.engine.encoder import VisionEncoder
from serve.engine.executable_cache import ExecutableCache, environment_parts, fingerprint
from serve.engine.memory_plan import CacheDims, PoolPlan, plan_pools
from serve.engine.memory_report import GIB, check_step_memory, large_buffers, step_temp_bytes
from serve.engine.outputs import SampledTokens
from serve.engine.outputs import SpecTokens
from serve.engine.sampler import SamplingTensors, apply_bitmask, apply_penalties, sample
from serve.engine.scheduler import ScheduledSequence, SchedulerOutput
from serve.engine.speculation import (CARRY_TOKEN, SpecPlan, cache_context, carry_width, chain_verification,
                                     draft_model_next, draft_next, next_carry, verify_rows)
from serve.engine.step_batch import OPTIONAL_SAMPLING, PackedLayout, StepBatch, WordBuffer, join, split, unpack
from sharding import MeshShape, make_mesh, param_specs
from sharding.parallel import parallel_for
from sharding.place import place_array, relayout_conv
from sharding.rules import fitted_cache_specs

COPY_CHUNK = 16
"""Copies (and poisoned ids) handled per launch of the copy (poison) executable."""
GPU_COMPILER_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
"""XLA options of the engine's executables on GPU. CONCURRENT: the CUDA graph of a step orders its kernels by
their buffer dependencies only, so independent small kernels overlap (H200, Kimi-Linear shapes, 4 layers:
device time per decode step 0.71 -> 0.61 ms at batch 1 and 1.78 -> 1.68 ms at batch 16; BENCHMARKS.md,
engine)."""


def describe_executable(key) -> str:
    """A warm-up executable's key in words: ``(T, N, P, decode_only, greedy_only)`` steps, ``("verify", N, P,
    greedy_only)`` verification steps, or the name of a helper executable."""
    if isinstance(key, tuple) and key and key[0] == "verify":
        return f"verification step N={key[1]} P={key[2]}" + (" greedy" if key[3] else "")
    if isinstance(key, tuple) and len(key) == 5:
        t, n, p, decode_only, greedy_only = key
        kind = "decode" if decode_only else "mixed"
        return f"{kind} step T={t} N={n} P={p}" + (" greedy" if greedy_only else "")
    return str(key)


def add_gpu_compiler_options(options: list[str]) -> None:
    """Add ``name=value`` XLA options (e.g. ``xla_gpu_autotune_level=0``) to GPU_COMPILER_OPTIONS; a value of
    true/false is a bool, an integer an int, anything else the string (as XLA's option parser wants them)."""
    global GPU_COMPILER_OPTIONS
    for option in options:
        name, sep, text = option.partition("=")
        if not sep or not name.startswith("xla_"):
            raise ValueError(f"XLA option {option!r}: expected xla_name=value")
        value: bool | int | str = text
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        else:
            try:
                value = int(text)
            except ValueError:
                pass
        GPU_COMPILER_OPTIONS = {**GPU_COMPILER_OPTIONS, name: value}


logger = logging.getLogger(__name__)
PRIME_PER_CALL = 4  # background executables an idle engine runs once per idle tick (``prime_ready_executables``)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
_compile_count = 0
_serving_compile_count = 0  # of those, the ones not made on warm-up threads (``_warm_up_thread``)
_count_lock = threading.Lock()  # compiles finish on several threads at once
_thread = threading.local()


def _count_compiles(event: str, duration_secs: float, **kwargs) -> None:
    global _compile_count, _serving_compile_count
    if event == _BACKEND_COMPILE_EVENT:  # the listener runs on the compiling thread
        warm_up = getattr(_thread, "warm_up", False)
        with _count_lock:
            _compile_count += 1
            _serving_compile_count += not warm_up


def _lower_with_precision(precision, lower: Callable) -> jax.stages.Lowered:
    """``lower()`` under the matmul precision ``precision`` (None: the global default)."""
    if precision is None:
        return lower()
    with jax.default_matmul_precision(precision):
        return lower()


def _warm_up_thread(fn: Callable) -> Callable:
    """``fn`` with the compiles it makes counted as warm-up's (``compiles_after_warm_up`` leaves them out)."""
    def run(*args, **kwargs):
        _thread.warm_up = True
        try:
            return fn(*args, **kwargs)
        finally:
            _thread.warm_up = False
    return run


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def backend_compile_count() -> int:
    """XLA backend compilations in this process so far: every jit, eager op or AOT compile counts, hits of the
    persistent compilation cache included (the event wraps ``compile_or_get_cached``)."""
    return _compile_count


def serving_compile_count() -> int:
    """Of ``backend_compile_count``, those not made on the compile threads of some runner's warm-up (foreground
    or background)."""
    return _serving_compile_count


def _param_path(path: tuple) -> str:
    """A flattened nnx state path -> the rules' parameter path (``kda.q_proj``)."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path if getattr(k, "name", None) != "value")


def _run_step(graphdef, treedef, impl, num_top_logprobs, layout: PackedLayout, greedy_only: bool,
              finite_pages: bool, parallel, plan: SpecPlan | None, drafting: bool, params, cache, words, optional,
              carry, router_totals, drafter_params, draft_probs):
    """The jitted step over a packed batch (``step_batch.pack`` words + the optional sampling arrays).

    carry [S, W] int32: what the previous step left for this one (``speculation.next_carry``; column 0 its sampled
    tokens). A fed token id ``-1 - r`` (a step scheduled ahead) is replaced by ``carry[r, 0]``; in a verification
    step it makes the row a chained one (``speculation.chain_verification``). -> (SampledTokens of every row [N]
    with its ``finite`` flag: a row whose logits hold a NaN or an infinity fails alone, whatever the other rows
    hold), the next step's carry, new cache, ``router_totals [L_moe, E]`` int32 plus this step's router load,
    draft_probs).

    ``parallel`` (static): the mesh's ``sharding.Parallel`` (None on one device).

    ``greedy_only`` (static): the variant for steps with no sampling, grammar, penalties or top logprobs: just
    the argmax. The general variant always applies the bitmask and penalties (neutral when unused), sorts for
    the sampler and takes top logprobs. Neither uses ``lax.cond``: XLA:GPU runs a conditional whose branches it
    cannot put in a CUDA graph (the sampler's sort) by reading the predicate on the host, so the launch returned
    only once the device had finished the forward (measured: 9.6 ms of a 10 ms step), which defeats
    asynchronous scheduling.

    ``finite_pages`` (static): False in test mode, whose NaN-poisoned free pages rule out the Mosaic-GPU MLA
    decode kernel (``kimi_jax.model.forward``).

    ``plan`` (static): speculative decoding, or None. Verification steps (``step.verify_len``) verify each
    sequence's drafts (``speculation.verify_rows``); with a DSpark drafter (``drafter_params``) every step also
    caches its context and drafts the next block after each sequence's new token; with a draft model
    (``drafter_params`` its parameters) every step also runs it on its own pools and drafts k tokens after each
    sequence's new token (``speculation.draft_model_next``). ``draft_probs [S, k, V]``
    carries the drafter's distributions from one step to the next when drafts are sampled (a [1, 1, 1]
    placeholder otherwise): row ``batch.draft_rows[n]`` of the step before is sequence n's.

    ``drafting`` (static): False for the buckets whose steps never speculate (every sequence bucket past
    ``disable_by_batch_size``): a DSpark drafter then only caches this step's context and a draft model only
    follows the target, and the step returns no speculation outputs (``spec`` None: nothing more to copy back), so
    that such steps cost about what they cost without speculation. With n-gram drafts (proposed on the host) a
    step that verifies nothing returns none either."""
    batch = join(unpack(words, layout), optional)
    if batch.step.verify_len and plan is not None:
        chained, sampling = chain_verification(batch.step, batch.sampling, batch.draft_limits, carry)
        batch = dataclasses.replace(batch, step=chained, sampling=sampling)
    ids = batch.step.token_ids
    pending = jnp.clip(-1 - ids, 0, carry.shape[0] - 1)
    step = dataclasses.replace(batch.step, token_ids=jnp.where(ids < 0, carry[pending, CARRY_TOKEN], ids))
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    taps = plan.taps if plan is not None and plan.has_drafter else ()
    aux = {}
    hidden, cache = forward(model, cache, step, impl=impl, mla_form="auto", finite_pages=finite_pages,
                            parallel=parallel, taps=taps, aux=aux)
    if "router_counts" in aux:
        router_totals = router_totals + aux["router_counts"]
    logits = compute_logits(model, hidden)  # [M, vocab] f32
    n = step.num_seqs
    sampled_probs = plan is not None and plan.has_drafter and plan.draft_sampling == "probabilistic"
    if step.verify_len:
        sampled, spec = verify_rows(logits, step, batch.sampling, draft_probs if sampled_probs else None,
                                    batch.draft_rows, plan, greedy_only=greedy_only)
        emitted = spec.num_accepted + 1
    else:
        sampled = _sample_rows(logits, batch, impl, num_top_logprobs, greedy_only, parallel)
        sampled = dataclasses.replace(sampled, finite=jnp.all(jnp.isfinite(logits), axis=-1))
        emitted = jnp.ones(n, jnp.int32)
        # no device drafts (n-gram drafts on the host, or past the batch bound): nothing more to copy back
        spec = None if not (plan is not None and plan.on_device and drafting) else SpecTokens(
            jnp.zeros(n, jnp.int32), sampled.token_ids[:, None], jnp.zeros((n, plan.num_tokens), jnp.int32),
            jnp.zeros(n, jnp.int32))
    if plan is not None and plan.has_draft_model:
        fed = emitted if step.verify_len else step.cu_seqlens[1:] - step.cu_seqlens[:-1]
        cache, drafts = draft_model_next(plan, drafter_params, cache, step, sampled.token_ids, step.context_lens + fed,
                                         spec.num_accepted if step.verify_len else None, impl=impl,
                                         finite_pages=finite_pages, drafting=drafting)
        if drafting:
            spec = dataclasses.replace(spec, drafts=drafts, num_drafts=jnp.full(n, plan.num_tokens, jnp.int32))
    if plan is not None and plan.has_drafter and not drafting:
        cache = cache_context(plan, drafter_params, cache, step, aux["taps"], impl=impl)
    elif plan is not None and plan.has_drafter:
        q_lens = step.cu_seqlens[1:] - step.cu_seqlens[:-1]
        fed = emitted if step.verify_len else q_lens
        cache, drafts, num_drafts, probs = draft_next(
            plan, model, drafter_params, cache, step, aux["taps"], sampled.token_ids, step.context_lens + fed,
            batch.sampling, batch.sampling.step_index + emitted, impl=impl, finite_pages=finite_pages)
        spec = dataclasses.replace(spec, drafts=drafts, num_drafts=num_drafts)
        if probs is not None:
            draft_probs = draft_probs.at[:n].set(probs.astype(draft_probs.dtype))
    if spec is not None:
        sampled = dataclasses.replace(sampled, spec=spec)
    return sampled, next_carry(carry, step, sampled.token_ids, spec), cache, router_totals, draft_probs


def _sample_rows(logits: jax.Array, batch: StepBatch, impl: str | None, num_top_logprobs: int,
                 greedy_only: bool, parallel) -> SampledTokens:
    """One token per sequence from its last row's logits [N, V] (see ``_run_step`` for the two variants)."""
    rows = logits.shape[0]
    if greedy_only:
        sampled = _greedy(logits, impl) if parallel is None else parallel.replicated(partial(_greedy, impl=impl),
                                                                                     logits)
        top = (jnp.zeros((rows, num_top_logprobs), jnp.int32), jnp.zeros((rows, num_top_logprobs), jnp.float32))
        return SampledTokens(sampled.token_ids, sampled.logprobs, *top)
    s = batch.sampling
    # No lax.cond here either (see above): unused stages get neutral inputs (all-allowed bitmask, no penalty)
    logits = apply_penalties(apply_bitmask(logits, s.allowed_bitmask), s)
    sampled = sample(logits, dataclasses.replace(s, **dict.fromkeys(OPTIONAL_SAMPLING)))  # greedy rows: argmax
    if num_top_logprobs:
        top_lps, top_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), num_top_logprobs)
        sampled = SampledTokens(sampled.token_ids, sampled.logprobs, top_ids.astype(jnp.int32), top_lps)
    return sampled


def _greedy(logits: jax.Array, impl: str | None) -> SampledTokens:
    """What ``sample`` returns when every row is greedy (argmax and its log-probability), without the sort; one
    Pallas kernel under ``impl="pallas"`` instead of XLA's six reductions over the vocabulary."""
    tokens, logprobs = greedy(logits, impl=impl)
    empty = jnp.zeros((logits.shape[0], 0))
    return SampledTokens(tokens, logprobs, empty.astype(jnp.int32), empty.astype(jnp.float32))


def _copy_entries(cache: HybridCache, blocks: jax.Array, slots: jax.Array) -> HybridCache:
    """blocks, slots [2, C] (source row, destination row; (0, 0) = padding): copy whole MLA pages (and their fp8
    scales) in every MLA layer and KDA recurrent + conv state in every KDA layer, a draft model's pools too; all
    sources are read before any write."""
    def copy(name: str, pool: jax.Array) -> jax.Array:
        rows = blocks if name.startswith("mla") else slots
        return pool.at[:, rows[1]].set(pool[:, rows[0]])

    draft = None if cache.draft is None else _copy_entries(cache.draft, blocks, slots)
    return dataclasses.replace(cache, draft=draft, **{name: copy(name, pool) for name, pool in cache.pools().items()})


def _poison_entries(cache: HybridCache, blocks: jax.Array, slots: jax.Array) -> HybridCache:
    """Fill pages ``blocks [C]`` and slots ``slots [C]`` with NaN, a draft model's pools too (out-of-range ids =
    padding, dropped)."""
    def poison(name: str, pool: jax.Array) -> jax.Array:
        return pool.at[:, blocks if name.startswith("mla") else slots].set(jnp.nan, mode="drop")

    draft = None if cache.draft is None else _poison_entries(cache.draft, blocks, slots)
    return dataclasses.replace(cache, draft=draft, **{name: poison(name, pool) for name, pool in cache.pools().items()})


class StepHandle:
    """A launched step. ``result()`` waits for it and returns host SampledTokens with one row per sequence.

    ``on_result``: called first by ``result()`` (a fault injector's hook; it may raise)."""

    def __init__(self, sampled: SampledTokens | None, num_rows: int, with_logprobs: bool,
                 on_result: Callable[[], None] | None = None):
        self._sampled = sampled
        self._num_rows = num_rows
        self._with_logprobs = with_logprobs
        self._on_result = on_result
        if sampled is not None and sampled.token_ids.is_fully_addressable:
            sampled.token_ids.copy_to_host_async()
            if sampled.finite is not None:
                sampled.finite.copy_to_host_async()
            if sampled.spec is not None:
                for array in jax.tree.leaves(sampled.spec):
                    array.copy_to_host_async()
            if with_logprobs:
                for array in (sampled.logprobs, sampled.top_token_ids, sampled.top_logprobs):
                    array.copy_to_host_async()

    def result(self) -> SampledTokens:
        if self._on_result is not None:
            self._on_result()
        n = self._num_rows
        if self._sampled is None:
            return SampledTokens(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros((0, 0), np.int32),
                                 np.zeros((0, 0), np.float32))
        host = multihost.host_view  # this process's copy of the replicated outputs
        token_ids = host(self._sampled.token_ids)[:n]
        s = self._sampled
        spec = None if s.spec is None else jax.tree.map(lambda a: host(a)[:n], s.spec)
        finite = None if s.finite is None else host(s.finite)[:n]
        if not self._with_logprobs:
            return SampledTokens(token_ids, np.zeros(n, np.float32), np.zeros((n, 0), np.int32),
                                 np.zeros((n, 0), np.float32), spec, finite)
        return SampledTokens(token_ids, host(s.logprobs)[:n], host(s.top_token_ids)[:n], host(s.top_logprobs)[:n],
                             spec, finite)


class ModelRunner:
    """Parameters, the two cache pools and the compiled steps of one model on one mesh.

    Args:
      model: a KimiModel or KimiLM (its ``impl`` is used unless ``impl`` is given).
      config: engine settings; resolved here for the model and platform (``self.config``).
      mesh: a ``sharding.make_mesh`` mesh of one replica (default: one device). Parameters and cache pools are
        placed with the partition rules of ``sharding.rules`` fitted to it (on one device: everything
        replicated); on more than one device the forward's sublayers run in ``jax.shard_map``
        (``sharding.Parallel``), with either impl.
      expert_parallel: vLLM's ``--enable-expert-parallel``: routed experts split over every device of the mesh.
      capacity_factor: expert-parallel dispatch buffer size (``sharding.moe_ep``; None = exact).
      impl: op implementation passed to the forward (None = backend default).
      warm_up: compile every bucket now (else call ``warm_up()`` before the first step).
      drafter: the DSpark drafter (``kimi_jax.drafter.DSparkDrafter``) when ``config.speculative_config`` asks
        for one (its page layers follow the model's in the MLA pool), or the draft model (a ``KimiModel`` with
        the target's vocabulary) for ``draft_model`` (its pools are ``cache.draft``).

    MXFP4 experts are re-laid in place into the word (or pair-halves) byte order first when
    ``config.mxfp4_byte_order`` asks for it ("auto": Pallas on a GPU), so the model passed in holds ``{w}_words``
    (``{w}_pairs``) parameters afterwards.
    """

    def __init__(self, model: KimiModel | KimiLM, config: EngineConfig, *, mesh: Mesh | None = None,
                 expert_parallel: bool = False, capacity_factor: float | None = None, impl: str | None = None,
                 warm_up: bool = True, progress: Callable[[int, int], None] | None = None, drafter=None,
                 vision=None):
        if isinstance(model, KimiLM):
            vision = vision if vision is not None else model.vision
            impl = impl if impl is not None else model.impl
            if getattr(model, "parallel", None) is not None and mesh is None:
                mesh = model.parallel.mesh
                expert_parallel = model.parallel.shape.expert_parallel
            model = model.model
        self.model_config = model.config
        self.mesh = mesh or make_mesh()
        self.shape = MeshShape.of(self.mesh, expert_parallel=expert_parallel)
        self.multihost = multihost.is_multiprocess()
        self.parallel = parallel_for(self.mesh, expert_parallel=expert_parallel, capacity_factor=capacity_factor)
        self.on_gpu = self.mesh.devices.flat[0].platform == "gpu"
        self.local_device = next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())
        self.config = config.resolve(model.config, gpu=self.on_gpu)
        self.impl = impl
        width_shards = 1 if expert_parallel else self.shape.tensor_parallel
        use_serving_byte_order(model, self.config.mxfp4_byte_order, width_shards=width_shards,
                               fast_kernels=self.on_gpu and resolve_impl(impl) == "pallas")
        relayout_conv(model, self.shape.tensor_parallel if self.parallel is not None else 1)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        specs = param_specs(model, self.shape)
        graphdef, state = nnx.split(model)
        paths_leaves, self._treedef = jax.tree_util.tree_flatten_with_path(state)
        self.param_names = [_param_path(path) for path, _ in paths_leaves]
        self.params = [_place_param(leaf, NamedSharding(self.mesh, specs[name]))
                       for name, (_, leaf) in zip(self.param_names, paths_leaves)]
        self._graphdef = graphdef
        self.vocab_size = model.config.vocab_size
        self.model_dtype = model.dtype
        self.kv_dtype = jnp.dtype(kv_cache_dtype_name(self.config.kv_cache_dtype, jnp.dtype(model.dtype)))
        self.draft_config = None  # a draft model's ModelConfig (its pools are cache.draft)
        self.spec_plan, self.drafter_params, self.num_draft_layers = self._speculation(model, drafter)
        self.encoder = self._vision_encoder(vision)
        self.plan = self._plan_pools()
        self.cache = self._zero_cache()
        self.penalty_width = min(self.config.max_model_len, self.vocab_size)
        self.buckets = self.config.buckets
        self._neutral: dict[int, dict[str, jax.Array]] = {}
        self._steps: dict[tuple[int, int, int, bool], jax.stages.Compiled] = {}
        self.step_temp_bytes: dict[tuple[int, int, int, bool, bool], int] = {}  # temporaries per step executable
        self._buffers: dict[tuple[int, int, int, bool], WordBuffer] = {}  # per bucket
        self._copy = self._poison = None
        self.fault_injector = None  # a serve.engine.faults.FaultInjector (tests and the reliability bench)
        self.num_launches = 0  # steps launched so far (the fault injector's step numbers)
        self._last_launch = None
        self.last_key: tuple | None = None  # the bucket key of the last launched step (launch_step's ``key``)
        self.last_call_seconds = 0.0  # host time of the last step's executable call (dispatch + enqueue)
        self.launch_counts: collections.Counter = collections.Counter()  # step launches by (T, N, P, decode, greedy)
        self._carry = self._initial_carry()
        cfg_m = model.config
        self._router_host = np.zeros((len(cfg_m.moe_layers), cfg_m.num_experts if cfg_m.moe_layers else 0), np.int32)
        self._router_totals = self._put(self._router_host)
        self._router_fetch = None  # a past totals array whose copy to the host is in flight
        self._draft_probs = self._initial_draft_probs()
        self._verify_steps: dict[tuple[int, int, bool], jax.stages.Compiled] = {}
        self._verify_buffers: dict[tuple[int, int], WordBuffer] = {}
        self._rows: dict[str, int] = {}  # request id -> its row in the last step (draft_rows of the next)
        self.connector = None  # a KVConnector (kv_connector.attach_connector) moving entries to and from the host
        self.warm_up_seconds = 0.0
        self.all_ready_seconds: float | None = None  # from warm-up's start until every bucket was in use
        self._warm_up_start = 0.0
        self._background: BackgroundCompiler | None = None  # a progressive warm-up's compiles still under way
        self._free_at_warm_up: int | None = None  # device bytes free for a step's temporaries (GPU)
        self._all_in_use = True  # every planned bucket has its executable (else steps take the smallest ready one)
        self._installed = 0  # executables a progressive warm-up took into use after it returned
        self._ready_memo: dict = {}  # picked bucket -> the ready bucket it runs in (progressive warm-up)
        self._unprimed: dict = {}  # background executables no step has run yet (an ordered set)
        self.on_warm_up_done: Callable[[str], None] | None = None  # told when the last background one is taken in
        self.compile_seconds: dict = {}  # executable key -> seconds its compile took (warm-up's, background ones
        # included; not loaded ones)
        self.compiles_at_warm_up: int | None = None  # backend_compile_count() when warm_up finished
        self.executable_cache: ExecutableCache | None = None  # config.executable_cache_dir's, after warm_up
        self._executable_cache_off = False  # set when a loaded executable could not run
        if warm_up:
            self.warm_up(progress)

    # ---- images ----
    def _vision_encoder(self, vision) -> VisionEncoder | None:
        self.media_rows = 0
        if vision is None or self.multihost:  # several hosts: the text model alone (followers replay no encoder)
            return None
        if vision.config.text_hidden_size != self.model_config.hidden_size:
            raise ValueError(f"the vision projector writes width {vision.config.text_hidden_size}; the model's "
                             f"hidden size is {self.model_config.hidden_size}")
        most = vision.config.max_patches // vision.config.merge_size
        self.media_rows = 1 + (self.config.media_pool_rows or max(self.config.max_num_batched_tokens, 4 * most))
        return VisionEncoder(vision, self.config.encoder_batch_size, self.replicated)

    def _encode_pending(self, sequences: Sequence[ScheduledSequence]) -> None:
        """Encode the images of this step's sequences that hold pool rows not written yet (one pass, batched)."""
        items, leases = [], []
        for seq in sequences:
            for i, lease in seq.request.media_leases.items():
                if not lease.encoded:
                    items.append((seq.request.media[i].image, lease.rows))
                    leases.append(lease)
        if items:
            self.cache = self.encoder.encode(self.cache, items)
            for lease in leases:
                lease.encoded = True

    def _feed_media(self, step_ids: np.ndarray, offset: int, seq: ScheduledSequence) -> None:
        """Write ``vocab_size + row`` at the rows of ``step_ids`` (the sequence's fed tokens from ``offset``)
        that are placeholders of its leased images."""
        start, end = seq.context_len, seq.context_len + seq.num_tokens
        for i, lease in seq.request.media_leases.items():
            span = seq.request.media[i]
            lo, hi = max(start, span.start), min(end, span.end)
            if lo < hi:
                rows = np.asarray(lease.rows[lo - span.start:hi - span.start], np.int32)
                step_ids[offset + lo - start:offset + hi - start] = self.vocab_size + rows

    # ---- speculative decoding ----
    def _speculation(self, model: KimiModel, drafter) -> tuple[SpecPlan | None, list, int]:
        """The static plan of the step executables, the drafter's flat parameters and its page layers."""
        spec = self.config.speculative_config
        if spec is None:
            if drafter is not None:
                raise ValueError("a drafter was given but EngineConfig.speculative_config is None")
            return None, [], 0
        if self.mesh.size > 1:
            raise ValueError("speculative decoding runs on one device for now (its verification and drafting steps "
                             "have no shard_map layouts yet): drop --speculative-config or the parallelism flags")
        if spec.method == "draft_model":
            return self._draft_model_plan(spec, drafter)
        if spec.method != "dspark":
            return SpecPlan(spec.method, spec.num_speculative_tokens, spec.rejection_sample_method,
                            spec.draft_sample_method), [], 0
        if drafter is None:
            raise ValueError("speculative_config.method 'dspark' needs a drafter (speculative_config.model)")
        if drafter.config.num_drafts < spec.num_speculative_tokens:
            raise ValueError(f"speculative_config.num_speculative_tokens {spec.num_speculative_tokens} exceeds the "
                             f"drafter's block ({drafter.config.num_drafts} drafts)")
        graphdef, state = nnx.split(drafter)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        params = [jax.device_put(leaf, self.replicated) for leaf in leaves]
        plan = SpecPlan(spec.method, spec.num_speculative_tokens, spec.rejection_sample_method,
                        spec.draft_sample_method, spec.min_draft_confidence, drafter.config.target_layer_ids,
                        len(self.model_config.mla_layers), graphdef, treedef)
        return plan, params, drafter.config.num_layers

    def _draft_model_plan(self, spec, draft: KimiModel | KimiLM | None) -> tuple[SpecPlan, list, int]:
        """A draft model of the same family: the same vocabulary, its pools beside the target's."""
        if isinstance(draft, KimiLM):
            draft = draft.model
        if not isinstance(draft, KimiModel):
            raise ValueError("speculative_config.method 'draft_model' needs a draft model (speculative_config.model)")
        if draft.config.vocab_size != self.vocab_size:
            raise ValueError(f"speculative_config.model: the draft model's vocabulary ({draft.config.vocab_size} ids) "
                             f"must be the target's ({self.vocab_size} ids)")
        use_serving_byte_order(draft, self.config.mxfp4_byte_order,
                               fast_kernels=self.on_gpu and resolve_impl(self.impl) == "pallas")
        relayout_conv(draft, 1)
        self.draft_config = draft.config
        graphdef, state = nnx.split(draft)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        params = [_place_param(leaf, self.replicated) for leaf in leaves]
        plan = SpecPlan(spec.method, spec.num_speculative_tokens, spec.rejection_sample_method,
                        spec.draft_sample_method, drafter_graphdef=graphdef, drafter_treedef=treedef)
        return plan, params, 0

    def _initial_carry(self) -> jax.Array:
        """The carry before any step, int32 [S, W] (``speculation.next_carry``)."""
        return self._put(np.zeros((max(self.buckets.seqs), carry_width(self.spec_plan)), np.int32))

    def _initial_draft_probs(self) -> jax.Array:
        plan = self.spec_plan
        if plan is None or not plan.has_drafter or plan.draft_sampling != "probabilistic":
            return jax.device_put(np.zeros((1, 1, 1), np.float32), self.replicated)
        return jax.device_put(np.zeros((max(self.buckets.seqs), plan.num_tokens, self.vocab_size), np.float32),
                              self.replicated)

    # ---- pools ----
    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks

    @property
    def num_slots(self) -> int:
        return self.plan.num_slots

    @property
    def page_group_size(self) -> int | None:
        """Pages per DCP rank (the pool's blocks are split into that many consecutive ids per rank), or None."""
        return self.plan.num_blocks // self.shape.dcp if self.shape.dcp > 1 else None

    def router_load(self) -> np.ndarray:
        """Routed (token, choice) pairs per expert and MoE layer since start, int32 [L_moe, E], as of a recent
        step: never waits for the device (the totals of a past step are copied to the host in the background,
        and the newest copy that has arrived is returned)."""
        if self._router_fetch is not None and self._router_fetch.is_ready():
            self._router_host = multihost.host_view(self._router_fetch)
            self._router_fetch = None
        if self._router_fetch is None:
            self._router_fetch = self._router_totals
            if self._router_fetch.is_fully_addressable:
                self._router_fetch.copy_to_host_async()
        return self._router_host

    def _plan_pools(self) -> PoolPlan:
        cfg = self.config
        fp8 = self.kv_dtype == jnp.float8_e4m3fn
        dims = CacheDims.from_model_config(self.model_config, mla_dtype_bytes=jnp.dtype(self.kv_dtype).itemsize,
                                           mla_scale_bytes=4 if fp8 else 0, kda_shards=self.shape.tensor_parallel,
                                           mla_shards=self.shape.dcp, extra_mla_layers=self.num_draft_layers)
        if self.draft_config is not None:
            dims = dataclasses.replace(dims, draft=CacheDims.from_model_config(
                self.draft_config, mla_dtype_bytes=jnp.dtype(self.kv_dtype).itemsize, mla_scale_bytes=4 if fp8 else 0))
        budget = cfg.memory_budget_bytes or (self._device_budget() if self.on_gpu else CPU_MEMORY_BUDGET)
        plan_args = dict(block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                         num_checkpoint_slots=cfg.num_checkpoint_slots + cfg.num_speculative_slots)
        plan = plan_pools(budget, dims, **plan_args)
        blocks = plan.num_blocks if cfg.num_blocks_override is None else min(plan.num_blocks, cfg.num_blocks_override)
        blocks -= blocks % MeshShape.of(self.mesh).dcp  # the page pool splits evenly over dcp
        if blocks < plan.num_blocks:
            plan = plan_pools(blocks * plan.bytes_per_block + plan.num_slots * plan.bytes_per_slot, dims, **plan_args)
        return plan

    def _device_budget(self) -> int:
        """Bytes left for the pools on the first device after the weights: utilisation share minus reserve."""
        stats = self.local_device.memory_stats() or {}
        limit = stats.get("bytes_limit", 0)
        in_use = stats.get("bytes_in_use", 0)
        budget = int(limit * self.config.gpu_memory_utilization) - in_use - self.config.activation_reserve_bytes
        if self.multihost:  # every process must size its pools identically: the smallest budget wins
            from jax.experimental import multihost_utils
            budget = int(np.min(multihost_utils.process_allgather(np.array([budget], np.int64))))
        if budget <= 0:
            raise ValueError(f"no device memory left for the cache pools (limit {limit} B, in use {in_use} B, "
                             f"reserve {self.config.activation_reserve_bytes} B); set memory_budget_bytes")
        return budget

    def _zero_cache(self) -> HybridCache:
        pools = dict(num_blocks=self.plan.num_blocks, block_size=self.config.block_size,
                     num_slots=self.plan.num_slots, dtype=self.kv_dtype)
        draft_config = self.draft_config

        def make() -> HybridCache:
            cache = init_cache(self.model_config, **pools, extra_mla_layers=self.num_draft_layers,
                               media_rows=self.media_rows, media_dtype=self.model_dtype)
            if draft_config is None:
                return cache
            return dataclasses.replace(cache, draft=init_cache(draft_config, **pools))

        specs = fitted_cache_specs(jax.eval_shape(make), MeshShape.of(self.mesh).sizes())
        self.cache_shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs)
        # compiled ahead and kept: recover() calls it again, and must not compile even if JAX's jit caches are cleared
        self._make_cache = jax.jit(make, out_shardings=self.cache_shardings).lower().compile()
        return self._make_cache()

    def recover(self) -> bool:
        """After a step failed: whether the device state was lost with it. If any pool or carried array can no
        longer be read (a device error poisons a donated cache), everything is rebuilt as at start-up (zeroed
        pools, fresh token and router buffers, no recompilation) and True is returned: every request holding
        cache state must then be failed and the prefix cache emptied (``LLMEngine`` does both)."""
        try:
            jax.block_until_ready((self.cache, self._carry, self._router_totals, self._draft_probs))
            return False
        except Exception:  # noqa: BLE001 - whatever broke the arrays, they are replaced
            self.cache = self._make_cache()
            self._carry = self._initial_carry()
            self._router_totals = self._put(self._router_host)
            self._draft_probs = self._initial_draft_probs()
            self._rows = {}
            return True

    # ---- compilation ----
    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Compile the step of every bucket, the copy executable and (test mode) the poison executable, or load
        them from ``config.executable_cache_dir`` (``executable_cache``); ``progress(done, total)`` is called as
        executables become ready.

        ``config.warm_up == "progressive"`` (one process): return once what no step can do without is ready (copy,
        poison, the image encoder, and per drafting class the largest mixed bucket, the largest decode bucket and
        the largest verification bucket: every step fits one of them), and compile the others on background threads
        (``background_compile``), small decode buckets first. ``execute`` takes each into use when it is ready;
        until then a step runs in the smallest ready bucket that holds it (``buckets.smallest_ready``), so no step
        waits for a compile. ``finish_warm_up`` waits for the rest."""
        self.stop_warm_up()
        start = self._warm_up_start = time.perf_counter()
        cfg = self.config
        self.compile_seconds = {}
        planned: dict = {}  # key -> a thunk lowering that executable
        # lowered from shapes and shardings, not the arrays: a background lowering must not touch the cache pools
        # that the steps it runs beside donate
        params, cache, carry, router, drafter_params, draft_probs = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            (self.params, self.cache, self._carry, self._router_totals, self.drafter_params, self._draft_probs))

        def lower(buffer: WordBuffer, optional: tuple, greedy_only: bool, num_seqs: int):
            optional = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.replicated) for a in optional)
            words = jax.ShapeDtypeStruct((buffer.layout.num_words,), jnp.int32, sharding=self.replicated)
            step_fn = jax.jit(partial(_run_step, self._graphdef, self._treedef, self.impl, cfg.max_logprobs,
                                      buffer.layout, greedy_only, not cfg.test_mode, self.parallel, self.spec_plan,
                                      self._drafting(num_seqs)),
                              donate_argnums=(1, 7),
                              out_shardings=(self.replicated, self.replicated, self.cache_shardings, self.replicated,
                                             self.replicated))
            return step_fn.lower(params, cache, words, optional, carry, router, drafter_params, draft_probs)

        layouts = {}  # key -> its step input layout, part of its executable cache key
        for shape in self.buckets.shapes():
            small, optional = split(self._neutral_batch(*shape))
            self._buffers[shape] = buffer = WordBuffer(small)
            for greedy_only in (False, True) if shape[3] else (False,):  # decode buckets get a greedy variant
                planned[(*shape, greedy_only)] = partial(lower, buffer, optional, greedy_only, shape[1])
                layouts[(*shape, greedy_only)] = buffer.layout
        for seqs, pages in self._verify_shapes():
            small, optional = split(self._neutral_batch(seqs * self.verify_len, seqs, pages, False, self.verify_len))
            self._verify_buffers[(seqs, pages)] = buffer = WordBuffer(small)
            for greedy_only in (False, True):
                planned[("verify", seqs, pages, greedy_only)] = partial(lower, buffer, optional, greedy_only, seqs)
                layouts[("verify", seqs, pages, greedy_only)] = buffer.layout
        pairs = jax.ShapeDtypeStruct((2, COPY_CHUNK), jnp.int32, sharding=self.replicated)
        ids = jax.ShapeDtypeStruct((COPY_CHUNK,), jnp.int32, sharding=self.replicated)
        pinned = dict(donate_argnums=(0,), out_shardings=self.cache_shardings)
        planned["copy"] = lambda: jax.jit(_copy_entries, **pinned).lower(cache, pairs, pairs)
        if cfg.test_mode:
            planned["poison"] = lambda: jax.jit(_poison_entries, **pinned).lower(cache, ids, ids)
        if self.encoder is not None:
            encoder_lowered = self.encoder.lower(self.cache, self.cache_shardings)
            planned.update({key: (lambda lo=lo: lo) for key, lo in encoder_lowered.items()})
        self.executable_cache = store = self._open_executable_cache()
        cache_keys = {key: (key, repr(layouts.get(key))) for key in planned}
        threads = cfg.compile_threads or min(8, os.cpu_count() or 1)
        options = GPU_COMPILER_OPTIONS if self.on_gpu else None
        compiled, pending = {}, {}

        def build(key, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
            began = time.perf_counter()
            executable = lowered.compile(options)
            self.compile_seconds[key] = time.perf_counter() - began
            if store is not None:  # as each finishes: a start stopped half-way leaves its work for the next one
                store.store(cache_keys[key], executable)
            return executable

        # cache hits skip tracing and lowering; misses are lowered in turn on this thread while the compiles of
        # the ones before run on the pool (XLA compiles outside the GIL), so a cold start takes about the longer
        # of the two, not their sum
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            if store is not None:  # deserialising (about 0.4 s per step of `tiny` on an H100 host) runs in parallel
                loaded = pool.map(_warm_up_thread(store.load), cache_keys.values())
                compiled.update({key: hit for key, hit in zip(planned, loaded) if hit is not None})
            later = [key for key in self._deferred_keys(planned) if key not in compiled]
            first = [key for key in planned if key not in later]
            report = progress or (lambda done, total: None)
            report(len(compiled), len(first))

            def collect(block: bool) -> None:
                done = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)[0] \
                    if block else [f for f in pending if f.done()]
                for future in done:
                    compiled[pending.pop(future)] = future.result()
                    report(len(compiled), len(first))

            for key in first:
                if key not in compiled:
                    pending[pool.submit(_warm_up_thread(build), key, planned[key]())] = key
                    collect(block=False)
            while pending:
                collect(block=True)
        compiled = {key: compiled[key] for key in planned if key in compiled}  # in the order they were planned
        self._copy = compiled.pop("copy")
        if self.encoder is not None:
            self.encoder.set_compiled(compiled)
        self._poison = compiled.pop("poison", None)
        self._verify_steps = {key[1:]: compiled.pop(key) for key in planned if key in compiled and key[0] == "verify"}
        # in the order they were planned, not finished: every process of a multi-host replica runs them in turn
        self._steps = {key: compiled[key] for key in planned if key in compiled}
        self.step_temp_bytes = {key: step_temp_bytes(c) for key, c in compiled.items()}
        self.step_temp_bytes.update({("verify", *key): step_temp_bytes(c) for key, c in self._verify_steps.items()})
        if self.on_gpu:
            self._check_step_memory()
        try:
            self._run_each_step_once()
        except RuntimeError as err:
            if store is None or not store.hits:
                raise
            # an executable read back from the cache cannot run here: forget the folder and compile afresh
            warnings.warn(f"{store.summary()}: a loaded executable failed ({err}); discarding the cache and "
                          f"compiling every step", RuntimeWarning, stacklevel=2)
            store.discard()
            self._executable_cache_off = True
            self.recover()
            return self.warm_up(progress)
        if self.encoder is not None:
            self.cache = self.encoder.run_once(self.cache)
        self.warm_up_seconds = time.perf_counter() - start
        self.all_ready_seconds = None if later else self.warm_up_seconds
        self._all_in_use = not later
        self._ready_memo.clear()
        self._unprimed.clear()
        self.compiles_at_warm_up = serving_compile_count()
        if later:
            self._installed = 0
            # the caller's thread-local JAX settings (``with jax.default_matmul_precision(...)``) shape what it
            # lowered; another thread does not inherit them
            precision = jax.config.jax_default_matmul_precision
            items = [(key, partial(_lower_with_precision, precision, planned[key])) for key in later]
            self._background = BackgroundCompiler(items, build, threads, wrap=_warm_up_thread)

    def _deferred_keys(self, planned: dict) -> list:
        """The step keys a progressive warm-up compiles in the background, in the order it compiles them (by
        sequences, then pages, then tokens: a lightly loaded server's buckets first); [] for a full warm-up or
        several processes (every process must hold every executable the leader may launch)."""
        if self.config.warm_up != "progressive" or self.multihost:
            return []
        b = self.buckets
        anchors = set()
        for drafting in {self._drafting(n) for n in b.seqs}:
            widest = max(n for n in b.seqs if self._drafting(n) == drafting)
            anchors.add((b.tokens[-1], widest, b.pages[-1], False, False))
            anchors.add((widest, widest, b.pages[-1], True, False))  # decode steps need not pad to T tokens
        verify = self._verify_shapes()
        if verify:
            anchors.add(("verify", max(n for n, _ in verify), b.pages[-1], False))
        steps = [key for key in planned if not isinstance(key, str) and key not in anchors
                 and (key[0] == "verify" or isinstance(key[0], int))]

        def order(key):  # the buckets a lightly loaded server needs first: few sequences, short tables, few tokens
            if key[0] == "verify":
                _, n, p, greedy = key
                return n, p, n * self.verify_len, 1, greedy
            t, n, p, decode_only, greedy = key
            return n, p, t, 0 if decode_only else 2, greedy

        return sorted(steps, key=order)

    def prime_ready_executables(self, limit: int = PRIME_PER_CALL) -> bool:
        """On an idle engine (no step in flight, no request running): take the executables a progressive warm-up
        finished into use and run up to ``limit`` of those no step has run yet once on their all-padding batches,
        as warm-up runs its own, so that no request's step loads their kernels or records their CUDA graphs (a few
        per call: a request that arrives meanwhile waits for them). One that cannot run is dropped with a warning
        and the pools are rebuilt (``recover``); returns True then: the caller must empty its prefix cache."""
        if self.multihost:  # (progressive warm-up is off there: followers would have to replay these runs)
            return False
        self.take_ready_executables()
        lost = False
        for key in list(self._unprimed)[:limit]:
            del self._unprimed[key]
            try:
                self._run_each_step_once([key])
            except RuntimeError as err:
                if not isinstance(err.__cause__, jax.errors.JaxRuntimeError):
                    raise
                warnings.warn(f"{describe_executable(key)} compiled in the background but cannot run: "
                              f"{err.__cause__}; its steps run in a larger bucket", RuntimeWarning, stacklevel=2)
                self._drop(key)
                lost = self.recover() or lost
        return lost

    def take_ready_executables(self) -> None:
        """Take the executables a progressive warm-up finished since the last call into use (the thread that
        launches steps calls this, ``execute`` before each step). One that failed to compile, or whose
        temporaries do not fit the memory left at warm-up, is dropped with a warning: its steps keep the larger
        ready bucket."""
        background = self._background
        if background is not None:
            self._install(background, background.take())

    def finish_warm_up(self, timeout_s: float | None = None) -> bool:
        """Wait for a progressive warm-up's background compiles and take them all into use; False if some were
        still compiling after ``timeout_s``. Call it from the thread that launches steps."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (background := self._background) is not None and background.pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._install(background, background.take(timeout_s=left))
        return True

    def stop_warm_up(self) -> None:
        """Stop a progressive warm-up's background compiles (at shutdown): no new one starts, and this waits for
        those under way. Steps keep the buckets already in use."""
        background, self._background = self._background, None
        if background is not None:
            background.stop()

    @property
    def num_pending_executables(self) -> int:
        """Executables of a progressive warm-up not yet taken into use (``take_ready_executables``)."""
        background = self._background
        return 0 if background is None else len(background.pending)

    @property
    def num_compiling_executables(self) -> int:
        """Executables a progressive warm-up is still compiling (0 once all have finished)."""
        background = self._background
        return 0 if background is None else background.compiling

    def _install(self, background: BackgroundCompiler, finished: list) -> list:
        """Put ``finished`` (key, executable or exception) of ``background`` into the executable tables; -> the
        keys put there. Taken while steps run (``take_ready_executables``), a bucket is not run on an all-padding
        batch first as warm-up's are (that would stall the steps in flight): its first step loads its kernels and
        records its CUDA graph, and one that cannot run fails that step as any failed step does (the engine fails
        its requests and recovers). ``prime_ready_executables`` runs them first on an idle engine."""
        self._ready_memo.clear()
        installed = []
        for key, result in finished:
            if isinstance(result, BaseException):
                warnings.warn(f"{describe_executable(key)} failed to compile in the background ({result}); its "
                              f"steps run in a larger bucket", RuntimeWarning, stacklevel=3)
                continue
            temp = step_temp_bytes(result)
            if self._free_at_warm_up is not None and temp > self._free_at_warm_up:
                warnings.warn(f"{describe_executable(key)} needs {temp / GIB:.2f} GiB of temporaries, more than the "
                              f"{self._free_at_warm_up / GIB:.2f} GiB free at warm-up; its steps run in a larger "
                              f"bucket", RuntimeWarning, stacklevel=3)
                continue
            self.step_temp_bytes[key] = temp
            if key[0] == "verify":
                self._verify_steps[key[1:]] = result
            else:
                self._steps[key] = result
            self._installed += 1
            self._unprimed[key] = None
            installed.append(key)
        if self._background is background and not background.pending:
            total = background.num_items
            self._all_in_use = self._installed == total
            self._background = None
            self.all_ready_seconds = time.perf_counter() - self._warm_up_start
            message = (f"progressive warm-up done: {self._installed} of {total} background executables in use, "
                       f"{self.all_ready_seconds:.1f} s after it began")
            logger.info(message)
            if self.on_warm_up_done is not None:
                self.on_warm_up_done(message)
        return installed

    def _drop(self, key) -> None:
        """Forget a background executable that cannot run: its steps take a larger ready bucket."""
        if key[0] == "verify":
            self._verify_steps.pop(key[1:], None)
        else:
            self._steps.pop(key, None)
        self.step_temp_bytes.pop(key, None)
        self._installed -= 1  # so that the last arrival cannot count it back in
        self._ready_memo.clear()
        self._all_in_use = False

    def _ready_bucket(self, shape: tuple[int, int, int, bool]) -> tuple[int, int, int, bool]:
        """The bucket a step picked for ``shape`` runs in: itself, or during a progressive warm-up the smallest
        ready one that holds it, of the same drafting class (a drafting step must draft)."""
        if self._all_in_use:
            return shape
        if shape not in self._ready_memo:  # cleared whenever a bucket is taken into use
            ready = {key[:4] for key in self._steps if not key[4]}
            self._ready_memo[shape] = smallest_ready(shape, ready,
                                                     lambda a, b: self._drafting(a[1]) == self._drafting(b[1]))
        return self._ready_memo[shape]

    def compile_summary(self) -> str:
        """One line on warm-up's compiles: how many, their summed seconds and the slowest ('' if all were loaded)."""
        seconds = list(self.compile_seconds.items())  # one C-level copy: background compiles may add entries
        if not seconds:
            return ""
        key, slowest = max(seconds, key=lambda kv: kv[1])
        return (f"{len(seconds)} executables compiled, {sum(s for _, s in seconds):.1f} s of "
                f"compiling summed over threads; slowest {slowest:.1f} s: {describe_executable(key)}")

    def _open_executable_cache(self) -> ExecutableCache | None:
        folder = self.config.executable_cache_dir
        if not folder or self._executable_cache_off:
            return None
        return ExecutableCache(folder, self._executable_fingerprint())

    def _executable_fingerprint(self) -> str:
        """What shapes this runner's executables besides their bucket (see ``executable_cache``)."""
        def avals(tree) -> list:
            return [(jax.tree_util.keystr(path), tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", None)))
                    for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]]

        spec = self.config.speculative_config  # its drafting pause and the host's n-gram lookup shape no program
        program_config = dataclasses.replace(
            self.config, seed=0, async_scheduling=True, compile_threads=None, warm_up="full",
            executable_cache_dir=None,
            speculative_config=spec and dataclasses.replace(spec, min_acceptance_length=None, prompt_lookup_min=1,
                                                            prompt_lookup_max=1))
        encoder = None if self.encoder is None else (avals(self.encoder._params), self.encoder.buckets,
                                                     repr(self.encoder.config), self.encoder.batch,
                                                     self.encoder._attention, repr(self.encoder._graphdef))
        return fingerprint(dict(
            graph=repr(self._graphdef), params=avals(self.params), cache=avals(self.cache), carry=avals(self._carry),
            router=avals(self._router_totals), drafter=avals(self.drafter_params),
            draft_probs=avals(self._draft_probs), config=repr(program_config), impl=resolve_impl(self.impl),
            spec_plan=repr(self.spec_plan), parallel=repr(self.parallel), encoder=encoder,
            mesh=(dict(self.mesh.shape), [d.id for d in self.mesh.devices.flat]),
            environment=environment_parts(list(self.mesh.devices.flat), GPU_COMPILER_OPTIONS if self.on_gpu else {})))

    @property
    def compiles_after_warm_up(self) -> int:
        """XLA compilations in this process since warm-up finished, other than those on warm-up compile threads (a
        progressive warm-up's background ones; another runner's, though its main-thread compiles count): 0 while
        serving."""
        return 0 if self.compiles_at_warm_up is None else serving_compile_count() - self.compiles_at_warm_up

    def _run_each_step_once(self, keys: Sequence | None = None) -> None:
        """Run every compiled step (or those of ``keys``, warm-up's key form) once on its all-padding batch, which
        reads and writes only the reserved entry 0 of each pool. A step that cannot run (e.g. out of device memory
        at run time, which the compile-time memory check can miss) then fails here with its bucket named (at
        start-up, or for a background executable while the engine is idle), not at the first request that needs
        it. On GPU this also loads its kernels and records its CUDA graph."""
        runs = [(step, self._buffers[key[:4]], key[1], "decode" + (" (greedy)" if key[4] else "") if key[3]
                 else "mixed", key[:3]) for key, step in self._steps.items() if keys is None or key in keys]
        runs += [(step, self._verify_buffers[key[:2]], key[0], "verify" + (" (greedy)" if key[2] else ""),
                  (key[0] * self.verify_len, key[0], key[1])) for key, step in self._verify_steps.items()
                 if keys is None or ("verify", *key) in keys]
        for step, buffer, seqs, kind, (tokens, _, pages) in runs:
            buffer.reset()
            optional = tuple(self._neutral_sampling(seqs)[name] for name in OPTIONAL_SAMPLING)
            try:
                words = buffer.take()
                sampled, _, self.cache, _, self._draft_probs = step(
                    self.params, self.cache, self._put(words) if self.multihost else words, optional, self._carry,
                    self._router_totals, self.drafter_params, self._draft_probs)
                jax.block_until_ready((sampled, self.cache))
            except jax.errors.JaxRuntimeError as err:
                raise RuntimeError(
                    f"the {kind} step of bucket T={tokens}, N={seqs}, pages={pages} cannot run on "
                    f"{self.mesh.devices.flat[0].device_kind}: {err}. Lower max_num_batched_tokens or max_num_seqs, "
                    f"or leave more device memory (memory_budget_bytes, gpu_memory_utilization)") from err

    def _check_step_memory(self) -> None:
        """Fail at start-up, not mid-serving, when a step's temporaries do not fit beside weights and pools."""
        stats = self.local_device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)

        def describe(key) -> str:
            step = self._verify_steps[key[1:]] if key[0] == "verify" else self._steps[key]
            top = large_buffers(step.as_text(), min_bytes=256 << 20, limit=4)
            return "; its largest buffers: " + ", ".join(f"{name} ({op}, {size / GIB:.2f} GiB)"
                                                          for size, name, op in top) if top else ""

        self._free_at_warm_up = free
        check_step_memory(self.step_temp_bytes, free, describe)

    @property
    def num_executables(self) -> int:
        """Executables compiled at warm-up (one step per bucket plus a greedy variant per decode bucket, two per
        verification bucket with speculative decoding, copy, poison in test mode, a KV connector's copies, the
        image encoder's buckets)."""
        return (len(self._steps) + len(self._verify_steps) + (self._copy is not None) + (self._poison is not None)
                + (self.connector.num_executables if self.connector is not None else 0)
                + (self.encoder.num_executables if self.encoder is not None else 0))

    @property
    def verify_len(self) -> int:
        """Rows per sequence of a verification step (1 + k), 0 without speculative decoding."""
        return 0 if self.spec_plan is None else 1 + self.spec_plan.num_tokens

    def _drafting(self, num_seqs: int) -> bool:
        """Whether steps of sequence bucket ``num_seqs`` may be followed by a verification step, so draft: some
        step that fits it has fewer running requests than ``disable_by_batch_size`` (a step's sequences are
        running requests, so a bucket whose smallest step has at least that many never speculates)."""
        spec = self.config.speculative_config
        if spec is None or not spec.disable_by_batch_size:
            return spec is not None
        seqs = self.buckets.seqs
        i = seqs.index(num_seqs)
        return (seqs[i - 1] + 1 if i else 1) < spec.disable_by_batch_size

    def _verify_shapes(self) -> list[tuple[int, int]]:
        """(N, P) of every verification bucket: each sequence bucket that speculates with each page bucket."""
        if not self.verify_len:
            return []
        return list(itertools.product([n for n in self.buckets.seqs if self._drafting(n)], self.buckets.pages))

    # ---- one step ----
    def execute(self, out: SchedulerOutput) -> StepHandle:
        """Apply the step's poisoning (test mode), scrubs and copies, then launch its forward + sampling (async).
        Scrubs copy the scratch entry 0 over the pages and slots of failed requests, so the non-finite values a
        failed step may have written there cannot reach the next owner (the Mosaic-GPU MLA decode kernel
        multiplies keys past a context by a zero probability, which a NaN survives)."""
        if not self._steps:
            raise RuntimeError("ModelRunner.warm_up() has not run")
        self.take_ready_executables()
        if self.connector is not None:  # before anything may overwrite an evicted page or slot
            self.connector.flush_saves()
        if self._poison is not None:
            self._launch_poison(out.freed_blocks, out.freed_slots)
        if out.scrub_blocks or out.scrub_slots:  # in their own launches: a scrubbed page may be a copy's target
            self._launch_copies([(0, b) for b in out.scrub_blocks], [(0, s) for s in out.scrub_slots])
        if out.block_copies or out.slot_copies:
            self._launch_copies(out.block_copies, out.slot_copies)
        if self.connector is not None:
            self.connector.flush_loads()
        if not out.sequences:
            return StepHandle(None, 0, False)
        step_number, self.num_launches = self.num_launches, self.num_launches + 1
        on_result = None
        injector = self.fault_injector
        if injector is not None:
            ids = [seq.request_id for seq in out.sequences]
            # (a chained verification row reads the live slot the step before leaves on the device, not state_slot)
            readers = [seq for seq in out.sequences if seq.context_len > 0
                       and not (out.verify_len and seq.scheduled_ahead)]
            if self._poison is not None and readers:
                chosen = set(injector.nan_targets(step_number, [seq.request_id for seq in readers]))
                self._launch_poison([], [seq.state_slot for seq in readers if seq.request_id in chosen])
            injector.on_launch(step_number, ids)
            on_result = partial(injector.on_result, step_number, ids)
        if self.encoder is not None:
            self._encode_pending(out.sequences)
        batch, optional, with_logprobs = self.build_batch(out.sequences, verify_len=out.verify_len)
        step = batch.step
        shape = (step.num_tokens, step.num_seqs, step.block_tables.shape[1], step.decode_only)
        greedy_only = ((step.decode_only or step.verify_len > 0)
                       and not any(map(bool, (batch.use_sampling, batch.use_bitmask, batch.use_penalties,
                                              batch.want_top_logprobs))))
        if step.verify_len:
            key = ("verify", *shape[1:3], greedy_only and (*shape[1:3], True) in self._verify_steps)
            words = self._verify_buffers[shape[1:3]].take()
        else:
            key = (*shape, greedy_only and (*shape, True) in self._steps)
            words = self._buffers[shape].take()
        if self.multihost:  # the followers replay this launch (serve.engine.multihost)
            mask = sum(1 << i for i, a in enumerate(optional) if isinstance(a, np.ndarray))
            multihost.announce(multihost.STEP, (*shape[:3], int(shape[3]), int(key[-1]), mask),
                               (words, tuple(a for a in optional if isinstance(a, np.ndarray))))
        sampled = self.launch_step(key, words, optional)
        self._rows = {seq.request_id: i for i, seq in enumerate(out.sequences)}
        return StepHandle(sampled, len(out.sequences), with_logprobs, on_result)

    def launch_step(self, key: tuple, words: np.ndarray, optional: tuple) -> SampledTokens:
        """Launch the compiled step ``key`` (a bucket key, or ``("verify", N, P, greedy_only)``) on a packed word
        buffer and the optional sampling arrays."""
        # Host arrays (the word buffer; penalty or grammar arrays when a row uses them) go to the executable as
        # numpy: its C++ argument path transfers them. jax.device_put first cost ~160 us of host time per step
        # here against ~6 us; the neutral optional arrays already live on the device. Several processes: every
        # host array becomes a replicated global array first (each process places its identical copy).
        if self.multihost:
            words = self._put(words)
            optional = tuple(self._put(a) if isinstance(a, np.ndarray) else a for a in optional)
        executable = self._verify_steps[key[1:]] if key[0] == "verify" else self._steps[key]
        if self._unprimed:
            self._unprimed.pop(key, None)  # this step runs it first
        self.launch_counts[key if key[0] != "verify" else (key[1] * self.verify_len, *key[1:3], False, key[3],
                                                            self.verify_len)] += 1
        self._last_launch = (executable, (words, optional, self._carry, self._router_totals))
        self.last_key = key
        start = time.perf_counter()
        sampled, self._carry, self.cache, self._router_totals, self._draft_probs = executable(
            self.params, self.cache, *self._last_launch[1], self.drafter_params, self._draft_probs)
        self.last_call_seconds = time.perf_counter() - start
        return sampled

    # ---- several hosts (serve.engine.multihost) ----
    def _put(self, host: np.ndarray) -> jax.Array:
        return place_array(host, self.replicated)

    def step_payload_like(self, key: tuple, host_mask: int) -> tuple:
        """Zero arrays shaped like a step's broadcast inputs (a follower's receive buffers)."""
        neutral = self._neutral_sampling(key[1])
        host = tuple(np.zeros(neutral[name].shape, neutral[name].dtype) for i, name in enumerate(OPTIONAL_SAMPLING)
                     if host_mask >> i & 1)
        return np.zeros(self._buffers[key[:4]].layout.num_words, np.int32), host

    def follower_step(self, key: tuple, words: np.ndarray, host_optional: tuple, host_mask: int) -> None:
        neutral = self._neutral_sampling(key[1])
        received = iter(host_optional)
        optional = tuple(next(received) if host_mask >> i & 1 else neutral[name]
                         for i, name in enumerate(OPTIONAL_SAMPLING))
        self.launch_step(key, words, optional)

    def copy_payload_like(self) -> tuple:
        return np.zeros((2, COPY_CHUNK), np.int32), np.zeros((2, COPY_CHUNK), np.int32)

    def poison_payload_like(self) -> tuple:
        return np.zeros(COPY_CHUNK, np.int32), np.zeros(COPY_CHUNK, np.int32)

    def launch_copy(self, blocks: np.ndarray, slots: np.ndarray) -> None:
        if self.multihost:
            blocks, slots = self._put(blocks), self._put(slots)
        self.cache = self._copy(self.cache, blocks, slots)

    def launch_poison(self, blocks: np.ndarray, slots: np.ndarray) -> None:
        if self.multihost:
            blocks, slots = self._put(blocks), self._put(slots)
        self.cache = self._poison(self.cache, blocks, slots)

    def follow(self) -> None:
        """A follower process: replay process 0's launches until it calls :meth:`stop_followers`."""
        multihost.follow(self)

    def stop_followers(self) -> None:
        """Process 0: end the followers' replay loops (at shutdown)."""
        if self.multihost and jax.process_index() == 0:
            multihost.announce(multihost.STOP)

    def time_step(self, repeats: int) -> float:
        """Device seconds per step of the last launched step, relaunched ``repeats`` times back to back with no
        host work in between (a benchmark: it advances the KDA state of that step's sequences again)."""
        executable, args = self._last_launch
        jax.block_until_ready(self.cache)
        start = time.perf_counter()
        for _ in range(repeats):
            sampled, _, self.cache, self._router_totals, self._draft_probs = executable(
                self.params, self.cache, *args, self.drafter_params, self._draft_probs)
        jax.block_until_ready((sampled, self.cache))
        return (time.perf_counter() - start) / repeats

    def build_batch(self, sequences: Sequence[ScheduledSequence], *, verify_len: int = 0
                    ) -> tuple[StepBatch, tuple, bool]:
        """The step's arrays in the smallest bucket, written into that bucket's word buffer: (the batch of views
        into it, without the optional sampling arrays; those arrays in OPTIONAL_SAMPLING order; whether logprobs
        must be fetched). ``verify_len`` (a verification step): sequence i owns rows i*Tq .. i*Tq + Tq - 1 (its
        fed tokens, then padding), and every row's logits are kept."""
        lens = [s.num_tokens for s in sequences]
        widest = max(len(s.block_table) for s in sequences)
        if verify_len:
            views, n = self._verify_views(len(sequences), widest, verify_len)
            step = views.step
            cu = step.cu_seqlens
            cu[:len(lens) + 1] = np.arange(len(lens) + 1) * verify_len
            cu[len(lens) + 1:] = len(lens) * verify_len
            for i, seq in enumerate(sequences):
                step.token_ids[i * verify_len:i * verify_len + len(seq.token_ids)] = seq.token_ids
            step.logits_indices[...] = np.arange(n * verify_len)
        else:
            total = sum(lens)
            decode_only = all(s.num_tokens == 1 and s.context_len > 0 and not s.checkpoint_positions
                              for s in sequences)
            bucket = self._ready_bucket(self.buckets.pick(total, len(sequences), widest, decode_only=decode_only))
            n = bucket[1]
            views = self._buffers[bucket].reset()
            step = views.step
            cu = step.cu_seqlens
            cu[1:len(lens) + 1] = list(itertools.accumulate(lens))
            cu[len(lens) + 1:] = total
            step.token_ids[:total] = np.fromiter((tok for s in sequences for tok in s.token_ids), np.int32, total)
            for offset, seq in zip(cu, sequences):
                if seq.request.media_leases:
                    self._feed_media(step.token_ids, int(offset), seq)
            step.logits_indices[:len(lens)] = cu[1:len(lens) + 1] - 1
        for i, seq in enumerate(sequences):
            step.context_lens[i] = seq.context_len
            step.block_tables[i, :len(seq.block_table)] = seq.block_table
            step.state_slots[i] = seq.state_slot
            step.checkpoint_positions[i, :len(seq.checkpoint_positions)] = seq.checkpoint_positions
            step.checkpoint_slots[i, :len(seq.checkpoint_slots)] = seq.checkpoint_slots
            views.draft_rows[i] = self._rows.get(seq.request_id, 0)
            views.draft_limits[i] = seq.draft_limit
        rows = [s.request if s.is_sampled else None for s in sequences]
        views.sampling.fill_rows(rows, self.vocab_size)
        if not verify_len:  # (a chained verification row's index advances on the device, by what it emitted)
            for i, seq in enumerate(sequences):
                if seq.scheduled_ahead:  # the in-flight step's token is this request's next output
                    views.sampling.step_index[i] += 1
        live = [r for r in rows if r is not None]
        with_logprobs = any(r.sampling_params.logprobs is not None for r in live)
        views.want_top_logprobs[...] = any(r.sampling_params.logprobs for r in live)
        views.use_sampling[...] = any(not r.sampling_params.is_greedy for r in live)
        views.use_bitmask[...] = any(r.constraint is not None for r in live)
        views.use_penalties[...] = any(r.sampling_params.uses_penalties for r in live)
        optional = self._neutral_sampling(n)  # device-resident; replaced by host arrays where a row needs them
        if views.use_bitmask or views.use_penalties:
            built = SamplingTensors.from_requests(rows, self.vocab_size, num_rows=n, penalty_width=self.penalty_width)
            optional = {name: value if (value := getattr(built, name)) is not None else optional[name]
                        for name in OPTIONAL_SAMPLING}
        return views, tuple(optional[name] for name in OPTIONAL_SAMPLING), with_logprobs

    def _verify_views(self, num_seqs: int, num_pages: int, verify_len: int) -> tuple[StepBatch, int]:
        """The reset word-buffer views of the smallest verification bucket for this step, and its N."""
        if verify_len != self.verify_len:
            raise ValueError(f"a verification step of {verify_len} rows per sequence, but the runner compiled "
                             f"{self.verify_len}")
        _, n, p, _ = self.buckets.pick(num_seqs, num_seqs, num_pages, decode_only=True)
        if not self._all_in_use:  # a progressive warm-up: the smallest verification bucket in use
            ready = {(m, m, q, True) for m, q, greedy in self._verify_steps if not greedy}
            _, n, p, _ = smallest_ready((n, n, p, True), ready)
        return self._verify_buffers[(n, p)].reset(), n

    def _neutral_batch(self, t: int, n: int, p: int, decode_only: bool, verify_len: int = 0) -> StepBatch:
        """A bucket's all-padding batch on the host (every optional sampling array present)."""
        sampling = SamplingTensors.from_requests([], self.vocab_size, num_rows=n, penalty_width=self.penalty_width,
                                                 always_penalties=True, always_bitmask=True)
        flag = np.asarray(False)
        return StepBatch(self._empty_step(t, n, p, decode_only, verify_len), sampling, flag, flag, flag, flag,
                         np.zeros(n, np.int32), np.zeros(n, np.int32))

    def _empty_step(self, t: int, n: int, p: int, decode_only: bool, verify_len: int = 0) -> StepInputs:
        """Bucket-shaped StepInputs of padding only (every sequence empty, block 0, slot 0). A verification bucket
        keeps every row's logits and one checkpoint column per fed row."""
        pc = verify_len or self.config.max_checkpoints_per_seq
        return StepInputs(
            token_ids=np.zeros(t, np.int32), cu_seqlens=np.zeros(n + 1, np.int32),
            context_lens=np.zeros(n, np.int32), block_tables=np.zeros((n, p), np.int32),
            state_slots=np.zeros(n, np.int32), logits_indices=np.zeros(t if verify_len else n, np.int32),
            checkpoint_positions=np.full((n, pc), -1, np.int32), checkpoint_slots=np.zeros((n, pc), np.int32),
            decode_only=decode_only, verify_len=verify_len)

    def _neutral_sampling(self, n: int) -> dict[str, jax.Array]:
        """Device-resident penalty and bitmask arrays that change nothing, for steps that do not use them."""
        if n not in self._neutral:
            full = SamplingTensors.from_requests([], self.vocab_size, num_rows=n, penalty_width=self.penalty_width,
                                                 always_penalties=True, always_bitmask=True)
            self._neutral[n] = {name: self._put(getattr(full, name)) for name in OPTIONAL_SAMPLING}
        return self._neutral[n]

    def _launch_copies(self, block_copies: list[tuple[int, int]], slot_copies: list[tuple[int, int]]) -> None:
        for start in range(0, max(len(block_copies), len(slot_copies)), COPY_CHUNK):
            blocks = _pairs(block_copies[start:start + COPY_CHUNK])
            slots = _pairs(slot_copies[start:start + COPY_CHUNK])
            if self.multihost:
                multihost.announce(multihost.COPY, payload=(blocks, slots))
            self.launch_copy(blocks, slots)

    def _launch_poison(self, blocks: list[int], slots: list[int]) -> None:
        for start in range(0, max(len(blocks), len(slots)), COPY_CHUNK):
            b = _padded_ids(blocks[start:start + COPY_CHUNK], self.num_blocks)
            s = _padded_ids(slots[start:start + COPY_CHUNK], self.num_slots)
            if self.multihost:
                multihost.announce(multihost.POISON, payload=(b, s))
            self.launch_poison(b, s)


def _place_param(leaf, sharding: NamedSharding) -> jax.Array:
    """A parameter on its target sharding (a no-op when the loader already put it there)."""
    if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
        return leaf
    if sharding.is_fully_addressable or not (isinstance(leaf, jax.Array) and not leaf.is_fully_addressable):
        return place_array(leaf, sharding)
    return jax.jit(lambda x: x, out_shardings=sharding)(leaf)


def _pairs(copies: list[tuple[int, int]]) -> np.ndarray:
    """[2, COPY_CHUNK] (source row, destination row), padded with (0, 0)."""
    out = np.zeros((2, COPY_CHUNK), np.int32)
    if copies:
        out[:, :len(copies)] = np.asarray(copies, np.int32).T
    return out


def _padded_ids(ids: list[int], out_of_range: int) -> np.ndarray:
    out = np.full(COPY_CHUNK, out_of_range, np.int32)
    out[:len(ids)] = ids
    return out
