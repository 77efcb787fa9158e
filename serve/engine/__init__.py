"""Serving engine, host side: requests, sampling parameters, the two cache pools with hybrid prefix caching,
and the continuous-batching scheduler (no JAX here; the on-device sampler is ``serve.engine.sampler``)."""

from serve.engine.cache_manager import CacheConfig, CacheManager, PrefixHit
from serve.engine.memory_plan import CacheDims, PoolPlan, plan_pools
from serve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, SampledTokens
from serve.engine.request import Request, RequestStatus
from serve.engine.sampling_params import MAX_LOGPROBS, SamplingParams, TokenConstraint
from serve.engine.scheduler import (ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput,
                                    SchedulerStats)

__all__ = [
    "CacheConfig", "CacheDims", "CacheManager", "CompletionOutput", "MAX_LOGPROBS", "PoolPlan", "PrefixHit",
    "Request", "RequestMetrics", "RequestOutput", "RequestStatus", "SampledTokens", "SamplingParams",
    "ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats", "TokenConstraint",
    "plan_pools",
]
