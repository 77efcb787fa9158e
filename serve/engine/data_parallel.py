"""Data parallelism: independent engine replicas behind one front, and the factory that builds any layout.

``DataParallelEngine`` has the ``LLMEngine`` interface (``add_request`` / ``step`` / ``abort_request`` /
``stats`` ...), so ``kimi_jax.LLM`` and the server's ``AsyncEngine`` drive it unchanged. Each replica is a whole
``LLMEngine`` on its own sub-mesh of ``tensor x expert x dcp`` devices (its own parameters, pools, scheduler and
prefix cache); ``step()`` steps every replica with work, in turn, on the calling thread. A step only waits for
that replica's previous step, whose launch already queued its device work, so replicas' devices run concurrently
while the host visits the others.

Balancing: a new request goes to the replica with the fewest unfinished requests (running + waiting, counted by
the front, so it is exact), except that a prompt whose leading pages (the prefix cache's match unit) were last
sent to replica r goes to r again while r has at most ``AFFINITY_SLACK`` more requests than the least loaded
one: conversations that grow turn by turn, and prompts sharing a system prefix, then keep hitting one replica's
prefix cache. The front remembers the hashes of the first 1 .. ``AFFINITY_BLOCKS`` pages of each prompt it
routed and prefers the replica of the longest remembered one (a few ``hash()`` calls of token tuples per request).
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Sequence

import numpy as np

from serve.engine.engine import LLMEngine, router_expert_tokens, router_imbalance
from serve.engine.outputs import EngineStats, RequestOutput
from serve.engine.sampling_params import SamplingParams

AFFINITY_BLOCKS = 4
"""Leading prompt pages hashed for prefix affinity (fewer when the prompt is shorter; at least one page)."""
AFFINITY_SLACK = 2
"""A replica keeps its prefix's requests while it has at most this many more unfinished ones than the least loaded."""
AFFINITY_ENTRIES = 4096
"""Prefix hashes remembered (least recently used forgotten first)."""


class DataParallelEngine:
    """Several ``LLMEngine`` replicas behind the ``LLMEngine`` interface (see the module docstring)."""

    def __init__(self, engines: Sequence[LLMEngine]):
        if not engines:
            raise ValueError("DataParallelEngine needs at least one engine")
        self.engines = list(engines)
        first = self.engines[0]
        self.tokenizer = first.tokenizer
        self.vision_config = getattr(first, "vision_config", None)
        self.media_rows = min(getattr(e, "media_rows", 0) for e in self.engines)
        self.model_config = first.model_config
        self.runner = first.runner  # for start-up messages; every replica has its own
        self.config = first.config
        self._owner: dict[str, int] = {}
        self._assigned = [set() for _ in self.engines]
        self._affinity: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.assignments = collections.Counter()  # requests sent to each replica (for tests and logs)

    @property
    def max_model_len(self) -> int:
        return min(e.max_model_len for e in self.engines)

    @property
    def num_replicas(self) -> int:
        return len(self.engines)

    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.engines[0].validate_request(prompt_token_ids, params)

    def _prefix_keys(self, prompt: Sequence[int]) -> list[int]:
        """Hashes of the prompt's first 1, 2, ... pages (up to AFFINITY_BLOCKS; a short prompt: itself)."""
        block = self.config.block_size
        tokens = tuple(int(t) for t in prompt[:AFFINITY_BLOCKS * block])
        pages = max(1, len(tokens) // block)
        return [hash(tokens[:n * block]) for n in range(1, pages + 1)]

    def pick_replica(self, prompt: Sequence[int]) -> int:
        """The replica a new request with this prompt goes to (see the module docstring)."""
        loads = [len(a) for a in self._assigned]
        least = min(loads)
        keys = self._prefix_keys(prompt)
        cached = next((self._affinity[k] for k in reversed(keys) if k in self._affinity), None)
        if cached is not None and loads[cached] <= least + AFFINITY_SLACK:
            choice = cached
        else:  # least loaded; ties go to the replica that has received fewest requests so far
            choice = min(range(len(loads)), key=lambda i: (loads[i], self.assignments[i], i))
        for key in keys:
            self._affinity[key] = choice
            self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return choice

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    *, arrival_time: float | None = None, media: Sequence = ()) -> None:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = self.pick_replica(prompt_token_ids)
        self.engines[replica].add_request(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                          **({"media": media} if media else {}))
        self._owner[request_id] = replica
        self._assigned[replica].add(request_id)
        self.assignments[replica] += 1

    def abort_request(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            self.engines[replica].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def is_idle(self) -> bool:
        return all(e.is_idle() for e in self.engines)

    def idle(self) -> None:
        """Each replica's ``LLMEngine.idle``."""
        for engine in self.engines:
            engine.idle()

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for replica, engine in enumerate(self.engines):
            if not engine.has_unfinished_requests():
                continue
            for out in engine.step():
                outputs.append(out)
                if out.finished:
                    self._assigned[replica].discard(out.request_id)
                    self._owner.pop(out.request_id, None)
        return outputs

    def router_load(self) -> np.ndarray:
        loads = [e.router_load() for e in self.engines]
        return np.sum(loads, axis=0) if loads[0].size else loads[0]

    def waiting_load(self) -> tuple[int, int]:
        """(sequences waiting for admission, their tokens) over every replica."""
        loads = [e.waiting_load() for e in self.engines]
        return sum(n for n, _ in loads), sum(t for _, t in loads)

    def stats(self) -> EngineStats:
        each = [e.stats() for e in self.engines]
        load = self.router_load()
        summed = {f.name: sum(getattr(s, f.name) for s in each) for f in dataclasses.fields(EngineStats)
                  if f.name in ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits",
                                "num_preemptions", "prompt_tokens", "generation_tokens")}
        return EngineStats(**summed, cache_usage=float(np.mean([s.cache_usage for s in each])),
                           router_expert_tokens=router_expert_tokens(load), router_imbalance=router_imbalance(load),
                           num_replicas=len(self.engines),
                           compiles_after_warm_up=max(s.compiles_after_warm_up for s in each),
                           executables_pending=sum(s.executables_pending for s in each))


def build_engine(model, *, tokenizer="auto", dtype="auto", seed: int = 0, impl: str | None = None,
                 progress: bool = False, parallel=None, capacity_factor: float | None = None, **engine_args):
    """The engine for a model and a layout: an ``LLMEngine`` (one replica, on one or many devices) or a
    ``DataParallelEngine`` of ``data_parallel_size`` replicas.

    ``model``: preset name or checkpoint folder (a KimiLM / KimiModel only for one replica); ``parallel``: a
    ``sharding.layout.ParallelConfig`` (None: one device). The layout is validated first (heads, experts and
    widths divisible, enough devices, weights plus one full-length request fitting device memory) and refused
    with the reason and the planner's suggested layouts."""
    from kimi_jax.api import load
    from kimi_jax.config import ModelConfig
    from kimi_jax.presets import PRESETS, get_preset
    from pallas_kernels.impl import on_gpu
    from serve.engine.config import EngineConfig
    from serve.engine.engine import _resolve_tokenizer
    from serve.engine.runner import ModelRunner
    from serve.progress import ProgressBar
    from sharding.layout import ParallelConfig, device_memory_bytes, init_distributed, replica_meshes
    from sharding.planner import validate_layout

    import jax

    pc = parallel or ParallelConfig()
    init_distributed(pc)
    if pc.num_devices == 1 and not pc.enable_expert_parallel:
        return LLMEngine.from_pretrained(model, tokenizer=tokenizer, dtype=dtype, seed=seed, impl=impl,
                                         progress=progress, **engine_args)
    if not isinstance(model, str):
        raise ValueError("a parallel layout needs a preset name or a checkpoint folder (each replica loads its own "
                         "shards)")
    if pc.num_replicas > 1 and jax.process_count() > 1:
        raise ValueError("--data-parallel-size with several hosts is not supported: one replica spans the hosts")
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu() else "float32"
    if os.path.isdir(model):
        cfg = ModelConfig.from_json_file(os.path.join(model, "config.json"))
    elif model in PRESETS:
        cfg = get_preset(model)
    else:
        raise ValueError(f"{model!r} is neither a checkpoint folder nor a preset ({sorted(PRESETS)})")
    config = EngineConfig(**engine_args)
    resolved = config.resolve(cfg, gpu=on_gpu())
    validate_layout(cfg, pc, num_devices=jax.device_count(), hbm_bytes=device_memory_bytes(),
                    context_len=resolved.max_model_len, weight_dtype=dtype)
    engines = []
    for mesh in replica_meshes(pc):
        lm = load(model, dtype, seed=seed, impl=impl, mesh=mesh, enable_expert_parallel=pc.enable_expert_parallel,
                  progress=ProgressBar("loading weights", unit="parameters") if progress else None)
        compiling = ProgressBar("compiling step buckets", unit="executables") if progress else None
        runner = ModelRunner(lm, config, mesh=mesh, expert_parallel=pc.enable_expert_parallel,
                             capacity_factor=capacity_factor, impl=impl, progress=compiling)
        engines.append(LLMEngine(runner, tokenizer=_resolve_tokenizer(tokenizer, model)))
    return engines[0] if len(engines) == 1 else DataParallelEngine(engines)
