"""AsyncEngine: concurrent streams, abort, early consumer exit, stats and shutdown, on the shared small runner
of test_engine_runner.py. Streams must carry exactly what the synchronous engine produces."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve.engine import SamplingParams
from serve.engine.async_engine import AsyncEngine, EngineDeadError
from tests.serve.test_engine_runner import PROMPTS, make_engine, run


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_streams_abort_early_exit_stats_and_shutdown():
    names = ["a", "d", "g", "k"]
    sync = make_engine(max_num_seqs=8, max_num_batched_tokens=64)
    for name in names:
        sync.add_request(name, PROMPTS[name], greedy(6))
    expected = {name: out.outputs[0].token_ids for name, out in run(sync).items()}

    engine = AsyncEngine(make_engine(max_num_seqs=8, max_num_batched_tokens=64), idle_wait_s=0.01)
    assert engine.max_model_len == 64 and engine.model_config.vocab_size == 4096 and engine.tokenizer is None

    async def stream(name: str, request_id: str, *, abort_after=None, leave_after=None, max_tokens=6):
        outs = []
        async for out in engine.generate(PROMPTS[name], greedy(max_tokens), request_id):
            outs.append(out)
            if len(outs) == abort_after:
                await engine.abort(request_id)
            if len(outs) == leave_after:
                break
        return outs

    async def main():
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate([], greedy(2), "bad"):
                pass
        full = [stream(name, f"full-{name}") for name in names]
        # 30 tokens to go: the abort lands long before the request could finish (with 6 the engine thread, running
        # ahead, sometimes finished it first on a loaded CI machine)
        aborted = stream("h", "aborted", abort_after=2, max_tokens=30)
        left = stream("k", "left", leave_after=1)
        results = await asyncio.gather(*full, aborted, left)
        duplicate = engine.generate(PROMPTS["a"], greedy(2), "dup")
        first = await duplicate.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await engine.generate(PROMPTS["a"], greedy(2), "dup").__anext__()
        rest = [out async for out in duplicate]
        return results, [first] + rest

    results, dup = asyncio.run(main())
    for name, outs in zip(names, results[:4]):
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == list(range(1, 7)), name  # one cumulative output per step, the last one finished
        assert [o.finished for o in outs] == [False] * 5 + [True]
        assert outs[-1].outputs[0].token_ids == expected[name] and outs[-1].metrics.first_token_time is not None
    aborted = results[4]
    assert aborted[-1].finished and aborted[-1].outputs[0].finish_reason == "abort"
    assert len(aborted[-1].outputs[0].token_ids) < 30
    assert len(results[5]) == 1 and dup[-1].finished

    deadline = time.monotonic() + 30
    while not engine.engine.is_idle() and time.monotonic() < deadline:  # the engine thread aborts "left"
        time.sleep(0.01)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.generation_tokens >= 4 * 6 and stats.prompt_tokens > 0 and 0.0 <= stats.cache_usage <= 1.0
    engine.shutdown()
    assert engine.engine.is_idle()

    async def after_shutdown():
        async for _ in engine.generate(PROMPTS["a"], greedy(2), "late"):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(after_shutdown())
