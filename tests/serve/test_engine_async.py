"""AsyncEngine: concurrent streams, abort, early consumer exit, stats and shutdown, on the shared small runner
of test_engine_runner.py. Streams must carry exactly what the synchronous engine produces."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve.engine import SamplingParams
from serve.engine.async_engine import AsyncEngine, EngineDeadError
from serve.engine.faults import FaultInjector, InjectedFault
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


def test_admission_control_bounds_the_waiting_queue():
    """One request runs (max_num_seqs=1) while others queue: the queue holds at most 3 sequences, and 40 tokens
    unless it is empty; refused requests raise EngineOverloadedError at once, and nothing leaks."""
    from serve.engine.async_engine import EngineOverloadedError

    engine = AsyncEngine(make_engine(max_num_seqs=1, max_num_batched_tokens=64), idle_wait_s=0.01,
                         max_waiting_requests=3, max_waiting_tokens=40)

    async def collect(stream):
        return [out async for out in stream]

    async def main():
        long = engine.generate(PROMPTS["h"], greedy(50), "long")
        await long.__anext__()  # running: nothing else can be admitted until it ends
        accepted = [engine.generate(PROMPTS[name], greedy(2), f"q{i}")
                    for i, name in enumerate(["f", "g", "j"])]  # 3 + 9 + 1 tokens
        firsts = [asyncio.ensure_future(s.__anext__()) for s in accepted]
        await asyncio.sleep(0)
        refused = []
        n2 = SamplingParams(temperature=0.0, max_tokens=2, n=2)
        for request_id, prompt, params in [("full", PROMPTS["j"], greedy(2)), ("n2", PROMPTS["j"], n2)]:
            with pytest.raises(EngineOverloadedError, match="sequences are waiting"):
                await engine.generate(prompt, params, request_id).__anext__()
            refused.append(request_id)
        with pytest.raises(EngineOverloadedError):
            engine.check_admission(1)
        await engine.abort("long")
        rest = await collect(long)
        outs = [[await first] + await collect(s) for first, s in zip(firsts, accepted)]
        # an empty queue takes a request larger than the token bound
        big = await collect(engine.generate(PROMPTS["k"], greedy(2), "big"))
        return rest, outs, big

    rest, outs, big = asyncio.run(main())
    assert rest[-1].outputs[0].finish_reason == "abort"
    assert all(o[-1].finished and len(o[-1].outputs[0].token_ids) == 2 for o in outs)
    assert big[-1].finished
    deadline = time.monotonic() + 30
    while not engine.engine.is_idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.engine.is_idle() and engine.num_open_streams == 0
    engine.shutdown()


class _FailFirstStepOf(FaultInjector):
    """Reading the first step that holds ``request_id`` raises."""

    def __init__(self, request_id: str):
        super().__init__()
        self._target = request_id

    def on_result(self, step: int, request_ids: list[str]) -> None:
        if self._target in request_ids and not self.fired:
            self.fired.append(("result", step, tuple(request_ids)))
            raise InjectedFault("injected")


def test_token_bound_and_failed_requests_and_abort_all():
    from serve.engine.async_engine import EngineOverloadedError, RequestFailedError

    sync = make_engine(max_num_seqs=8, max_num_batched_tokens=64)
    engine = AsyncEngine(make_engine(max_num_seqs=1, max_num_batched_tokens=64), idle_wait_s=0.01,
                         max_waiting_requests=8, max_waiting_tokens=12)
    sync.add_request("g", PROMPTS["g"], greedy(6))
    expected = run(sync)["g"].outputs[0].token_ids

    async def main():
        long = engine.generate(PROMPTS["h"], greedy(50), "long")
        await long.__anext__()
        queued = engine.generate(PROMPTS["g"], greedy(6), "g")  # 9 tokens waiting
        first = asyncio.ensure_future(queued.__anext__())
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloadedError, match="prompt tokens are waiting"):
            await engine.generate(PROMPTS["a"], greedy(2), "a0").__anext__()  # 9 + 17 > 12
        # the next step of "long" fails; "g" (still waiting) is not in it
        runner = engine.engine.runner
        runner.fault_injector = _FailFirstStepOf("long")
        with pytest.raises(RequestFailedError, match="engine step"):
            async for _ in long:
                pass
        runner.fault_injector = None
        got = [await first] + [out async for out in queued]
        a = engine.generate(PROMPTS["a"], greedy(40), "a")
        b = engine.generate(PROMPTS["b"], greedy(40), "b")
        firsts = [await a.__anext__(), asyncio.ensure_future(b.__anext__())]
        await asyncio.sleep(0)  # b's stream opens (it waits: max_num_seqs=1)
        engine.abort_all()
        ends = [[out async for out in a], [await firsts[1]] + [out async for out in b]]
        return got, ends

    got, ends = asyncio.run(main())
    assert got[-1].outputs[0].token_ids == expected
    assert [e[-1].outputs[0].finish_reason for e in ends] == ["abort", "abort"]
    deadline = time.monotonic() + 30
    while not engine.engine.is_idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.engine.is_idle() and engine.is_alive
    engine.shutdown()
    assert not engine.is_alive
