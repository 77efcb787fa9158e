"""The engine with an fp8 (e4m3 + per-token scale) MLA cache: the same small hybrid model and prompts as
test_engine_runner.py. Greedy outputs must not depend on batching, chunking or prefix-cache hits (a hit reads
the very fp8 rows and scales that recomputation would write), freed pages and their scales are poisoned with
NaN in test mode, and the pools end free. Accuracy against a full-precision cache is a model-level test
(tests/test_model_incremental.py: fp8 equals quantise-dequantise emulation)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from serve.engine import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.outputs import SampledTokens
from serve.engine.runner import ModelRunner
from tests.serve.test_engine_runner import (
    BLOCK,
    PROMPTS,
    RUNNER_CONFIG,
    add_all,
    assert_pools_free,
    run,
    shared_lm,
)

WARM_UP_PROGRESS: list[tuple[int, int]] = []


@functools.cache
def fp8_runner() -> ModelRunner:
    """One mixed bucket (T=64, N=8) + the decode bucket, copy and poison, with e4m3 pages."""
    config = EngineConfig(**{**RUNNER_CONFIG.__dict__, "token_buckets": (64,), "kv_cache_dtype": "fp8"})
    return ModelRunner(shared_lm(), config, progress=lambda done, total: WARM_UP_PROGRESS.append((done, total)))


def engine(**scheduling) -> LLMEngine:
    return LLMEngine(fp8_runner(), config=EngineConfig(block_size=BLOCK, **scheduling))


def test_fp8_cache_pools_and_capacity():
    runner = fp8_runner()
    cache = runner.cache
    assert cache.mla.dtype == jnp.float8_e4m3fn and cache.mla_scales.shape == cache.mla.shape[:3]
    layers, width = cache.mla.shape[0], cache.mla.shape[-1]
    assert runner.plan.bytes_per_block == layers * BLOCK * (width + 4)
    assert WARM_UP_PROGRESS == [(i, 5) for i in range(6)]  # 2 step buckets + greedy decode variant, copy, poison


def test_fp8_greedy_outputs_independent_of_batching_chunking_and_prefix_hits():
    from serve.engine import SamplingParams

    names = ["a", "b", "c", "d", "e", "l", "i"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for key, scheduling in (("alone", dict(enable_prefix_caching=False, max_num_seqs=1)),
                            ("cached", dict(max_num_seqs=3, max_num_batched_tokens=16))):
        e = engine(**scheduling)
        if key == "alone":
            done = {}
            for name in names:
                e.add_request(name, PROMPTS[name], params)
                done.update(run(e))
        else:
            add_all(e, names, params)
            done = run(e)
            assert e.stats().prefix_cache_hits > 0
        outs[key] = {n: done[n].outputs[0].token_ids for n in names}
        assert_pools_free(e)
    assert outs["cached"] == outs["alone"]


def test_fp8_freed_pages_and_scales_are_poisoned():
    e = engine(enable_prefix_caching=False)
    add_all(e, ["f", "g"])
    run(e)
    out = e.scheduler.schedule()
    assert out.freed_blocks and not out.sequences
    e.runner.execute(out)
    e.scheduler.update_from_output(out, SampledTokens(*(np.zeros((0,) * k) for k in (1, 1, 2, 2))))
    cache = e.runner.cache
    for pool in (cache.mla, cache.mla_scales):
        values = np.asarray(pool.astype(jnp.float32))
        assert np.isnan(values[:, out.freed_blocks]).all() and np.isfinite(values[:, 0]).all()
    assert_pools_free(e)
