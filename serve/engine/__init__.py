"""Serving engine, host side: requests, sampling parameters, the two cache pools with hybrid prefix caching,
and the continuous-batching scheduler (no JAX here; the on-device sampler is ``serve.engine.sampler``)."""

from serve.engine.cache_manager import CacheConfig, CacheManager, PrefixHit
from serve.engine.memory_plan import CacheDims, PoolPlan, plan_pools
from serve.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput, SampledTokens
from serve.engine.request import Request, RequestStatus
from serve.engine.sampling_params import MAX_LOGPROBS, SamplingParams, TokenConstraint
from serve.engine.scheduler import (ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput,
                                    SchedulerStats)

__all__ = [
    "CacheConfig", "CacheDims", "CacheManager", "CompletionOutput", "EngineStats", "MAX_LOGPROBS", "PoolPlan",
    "PrefixHit", "Request", "RequestMetrics", "RequestOutput", "RequestStatus", "SampledTokens", "SamplingParams",
    "ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats", "TokenConstraint",
    "plan_pools",
]

# Device side and loops (they import JAX): loaded on first use, so ``import serve.engine`` stays JAX-free.
from serve.engine.buckets import Buckets  # noqa: E402
from serve.engine.config import EngineConfig  # noqa: E402

_LAZY = {"AsyncEngine": "serve.engine.async_engine", "LLM": "serve.engine.llm", "LLMEngine": "serve.engine.engine",
         "ModelRunner": "serve.engine.runner"}
__all__ += ["Buckets", "EngineConfig", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'serve.engine' has no attribute {name!r}")
