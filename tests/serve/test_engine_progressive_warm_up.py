"""Progressive warm-up (``EngineConfig.warm_up = "progressive"``): the engine serves once its largest buckets are
compiled, every step runs in the smallest ready bucket that holds it, and the other buckets are taken into use as
their background compiles finish, with greedy outputs equal to the cache-free reference throughout.

The background compiles are held back by a gate (``BackgroundCompiler`` wrapped) so that the tests see the engine
both before and after they finish, whatever the speed of the machine. The small fp32 model and its reference are
test_engine_runner.py's; differences between bucket shapes are ~1e-6 relative there, far below the prompts'
top-2 logit gaps.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import jax
import pytest

from serve.bench.hit_rates import run_to_completion
from serve.engine import EngineConfig, SamplingParams, ngram
from serve.engine import runner as runner_module
from serve.engine.background_compile import BackgroundCompiler
from serve.engine.buckets import smallest_ready
from serve.engine.engine import LLMEngine
from serve.engine.runner import ModelRunner
from tests.serve.test_engine_runner import BLOCK, PROMPTS, RUNNER_CONFIG, assert_pools_free, greedy, shared_lm

CONFIG = dataclasses.replace(RUNNER_CONFIG, warm_up="progressive", seq_buckets=(2, 8))
NAMES = ["a", "d", "f", "g", "j"]


class Gate:
    """Holds every background compile until ``open()``, those of keys in ``late`` until ``open_late()`` too; a
    compile of a key in ``fail`` raises instead."""

    def __init__(self, monkeypatch):
        self.event, self.late_event = threading.Event(), threading.Event()
        self.fail, self.late = (), ()
        gate = self

        class Held(BackgroundCompiler):
            def __init__(self, items, build, threads, wrap=lambda fn: fn):
                def held(key, lowered):
                    gate.event.wait()
                    if key in gate.late:
                        gate.late_event.wait()
                    if key in gate.fail:
                        raise RuntimeError("injected compile failure")
                    return build(key, lowered)
                super().__init__(items, held, threads, wrap)

        monkeypatch.setattr(runner_module, "BackgroundCompiler", Held)

    def open(self) -> None:
        self.event.set()

    def open_late(self) -> None:
        self.late_event.set()


@pytest.fixture
def gate(monkeypatch):
    """A closed Gate, opened at teardown (stopping a compiler waits for its compiles, so none may stay held)."""
    held = Gate(monkeypatch)
    yield held
    held.open()
    held.open_late()


def run(engine: LLMEngine, names, params=None) -> dict[str, list[int]]:
    """Output token ids of the prompts ``names``, run together to completion (background compiles may finish
    meanwhile, so no compile count is asserted here)."""
    for name in names:
        engine.add_request(name, PROMPTS[name], params or greedy())
    return run_to_completion(engine)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    names = sorted(PROMPTS)
    outs = shared_lm().generate([PROMPTS[n] for n in names], max_new_tokens=8, stop_token_ids=[])
    return {n: out[len(PROMPTS[n]):] for n, out in zip(names, outs)}


def test_smallest_ready_takes_the_cheapest_bucket_that_holds_the_step():
    ready = {(64, 8, 16, False), (16, 8, 16, False), (8, 8, 16, True), (64, 2, 16, False)}
    assert smallest_ready((16, 2, 16, False), ready) == (16, 8, 16, False)  # fewer tokens before fewer sequences
    assert smallest_ready((16, 8, 16, False), ready) == (16, 8, 16, False)  # ready itself
    assert smallest_ready((2, 2, 16, True), ready) == (8, 8, 16, True)  # a decode bucket before a mixed one
    assert smallest_ready((2, 2, 4, True), {(64, 8, 16, False)}) == (64, 8, 16, False)  # decode in a mixed one
    assert smallest_ready((16, 2, 16, False), ready, lambda a, b: b[1] == 2) == (64, 2, 16, False)
    with pytest.raises(ValueError, match="no ready bucket"):
        smallest_ready((16, 2, 16, False), {(8, 8, 16, True)})  # a mixed step never runs in a decode bucket


def test_serves_from_the_largest_buckets_then_takes_the_rest_into_use(gate, reference):
    runner = ModelRunner(shared_lm(), CONFIG)
    anchors = {(64, 8, 16, False, False), (8, 8, 16, True, False)}  # the largest mixed and decode buckets
    assert set(runner._steps) == anchors and runner.num_pending_executables == 6  # 3 mixed, 3 decode
    assert runner.num_executables == 2 + 2  # the anchors, copy, poison
    engine = LLMEngine(runner, config=EngineConfig(block_size=BLOCK))
    early = run(engine, NAMES)
    assert early == {n: reference[n] for n in NAMES}
    assert set(runner.launch_counts) == anchors  # every step in a ready bucket, greedy decode in the general one
    assert_pools_free(engine)
    assert runner.all_ready_seconds is None and engine.stats().executables_pending == 6

    told = []
    runner.on_warm_up_done = told.append
    gate.open()
    assert runner.finish_warm_up(timeout_s=600)
    assert runner.num_pending_executables == 0 and runner.all_ready_seconds >= runner.warm_up_seconds
    assert len(told) == 1 and told[0].startswith("progressive warm-up done: 6 of 6 background executables in use")
    assert len(runner._steps) == 8 and runner.num_executables == 8 + 2
    runner.launch_counts.clear()
    late = run(engine, NAMES)
    assert late == early and (8, 8, 16, True, True) in runner.launch_counts
    assert run(engine, ["f"]) == {"f": reference["f"]}
    assert (2, 2, 16, True, True) in runner.launch_counts  # one request decodes in its own bucket
    assert engine.stats().compiles_after_warm_up == 0  # the background compiles are warm-up's, not serving's
    assert engine.stats().executables_pending == 0
    assert_pools_free(engine)


def test_a_failed_background_compile_leaves_its_steps_on_a_larger_bucket(gate, reference):
    failing = (2, 2, 16, True, True)
    gate.fail = (failing,)
    runner = ModelRunner(shared_lm(), CONFIG)
    gate.open()
    with pytest.warns(RuntimeWarning, match="decode step T=2 N=2 P=16 greedy failed to compile"):
        assert runner.finish_warm_up(timeout_s=600)
    assert failing not in runner._steps and (2, 2, 16, True, False) in runner._steps
    engine = LLMEngine(runner, config=EngineConfig(block_size=BLOCK))
    assert run(engine, ["f"]) == {"f": reference["f"]}
    assert failing not in runner.launch_counts and (2, 2, 16, True, False) in runner.launch_counts


def test_stopping_the_warm_up_keeps_serving_on_the_ready_buckets(gate, reference):
    runner = ModelRunner(shared_lm(), CONFIG)
    gate.open()  # (stopping waits for the compiles under way)
    runner.stop_warm_up()
    assert runner.num_pending_executables == 0 and runner.finish_warm_up(timeout_s=1)
    engine = LLMEngine(runner, config=EngineConfig(block_size=BLOCK))
    assert run(engine, ["a", "g"]) == {n: reference[n] for n in ("a", "g")}
    assert set(runner.launch_counts) == {(64, 8, 16, False, False), (8, 8, 16, True, False)}


def reference_drafts(monkeypatch, reference) -> None:
    """n-gram drafts are the reference continuation, so verification steps accept them."""
    continuations = {tuple(PROMPTS[n]): reference[n] for n in PROMPTS}

    def propose(tokens, k, lo, hi, data=None):
        for prompt, cont in continuations.items():
            n = len(prompt)
            if tuple(tokens[:n]) == prompt:
                return cont[len(tokens) - n:len(tokens) - n + k]
        return []

    monkeypatch.setattr(ngram, "propose", propose)


def test_speculating_engine_verifies_in_the_largest_verification_bucket_until_the_others_are_ready(
        monkeypatch, gate, reference):
    """Until the gate opens, verification runs in the one ready verification bucket (N=8), then small batches take
    N=2."""
    reference_drafts(monkeypatch, reference)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0, "min_acceptance_length": 0}
    runner = ModelRunner(shared_lm(), dataclasses.replace(CONFIG, token_buckets=(64,), speculative_config=spec))
    assert set(runner._verify_steps) == {(8, 16, False)}
    engine = LLMEngine(runner, config=EngineConfig(block_size=BLOCK, speculative_config=spec))
    assert run(engine, ["a", "f"]) == {n: reference[n] for n in ("a", "f")}
    assert (24, 8, 16, False, False, 3) in runner.launch_counts  # verification steps ran, all at N=8
    gate.open()
    assert runner.finish_warm_up(timeout_s=600)
    runner.launch_counts.clear()
    assert run(engine, ["g"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)) == {"g": reference["g"]}
    assert (6, 2, 16, False, True, 3) in runner.launch_counts  # greedy verification of one request: N=2, Tq=3
    assert_pools_free(engine)


def test_a_process_that_exits_mid_warm_up_exits_cleanly():
    """Exiting while background compiles run (no stop_warm_up) waits for them instead of crashing in XLA's
    teardown (SIGSEGV / SIGABRT before the atexit hook)."""
    script = textwrap.dedent("""
        import dataclasses
        from serve.engine.runner import ModelRunner
        from tests.serve.test_engine_progressive_warm_up import CONFIG
        from tests.serve.test_engine_runner import shared_lm
        runner = ModelRunner(shared_lm(), dataclasses.replace(CONFIG, page_buckets=(4, 8, 16)))
        print("pending", runner.num_pending_executables, flush=True)
    """)
    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split("pending")[1]) > 0  # it did exit with compiles under way


def test_steps_keep_to_their_drafting_class(monkeypatch, gate, reference):
    """``disable_by_batch_size`` 3 over sequence buckets (2, 8): N=2 steps may be followed by verification, N=8
    steps never are, and they compile different programs, so each class has its own largest buckets before
    serving and a step never borrows the other class's."""
    reference_drafts(monkeypatch, reference)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 3, "min_acceptance_length": 0}
    runner = ModelRunner(shared_lm(), dataclasses.replace(CONFIG, token_buckets=(64,), speculative_config=spec))
    assert set(runner._steps) == {(64, 2, 16, False, False), (64, 8, 16, False, False), (2, 2, 16, True, False),
                                  (8, 8, 16, True, False)}
    assert set(runner._verify_steps) == {(2, 16, False)}
    engine = LLMEngine(runner, config=EngineConfig(block_size=BLOCK, speculative_config=spec))
    assert run(engine, ["a", "f"]) == {n: reference[n] for n in ("a", "f")}  # two requests: they speculate
    assert (6, 2, 16, False, False, 3) in runner.launch_counts
    runner.launch_counts.clear()
    assert run(engine, ["d", "g", "j"]) == {n: reference[n] for n in ("d", "g", "j")}  # three: they do not
    assert set(runner.launch_counts) <= {(64, 8, 16, False, False), (8, 8, 16, True, False)}
    assert_pools_free(engine)


def test_an_idle_engine_takes_finished_executables_into_use_and_runs_them_once(monkeypatch, gate, reference):
    """``LLMEngine.idle`` (the server's engine loop calls it when no request is left) installs what the background
    finished and runs a few of them once per call on their all-padding batches, as warm-up does, so a request's
    first step in a new bucket loads no kernels. One that cannot run is dropped with a warning and its steps take a
    larger bucket, also after the last bucket arrives later (it must not be counted back in)."""
    last = (64, 2, 16, False, False)
    gate.late = (last,)
    runner = ModelRunner(shared_lm(), CONFIG)
    engine = LLMEngine(runner, config=EngineConfig(block_size=BLOCK))
    gate.open()
    deadline = time.monotonic() + 600
    while runner.num_compiling_executables > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.num_compiling_executables == 1 and runner.num_pending_executables == 6  # 5 finished, not taken
    broken, ran = (16, 2, 16, False, False), []
    run_once = runner._run_each_step_once

    def spy(keys=None):
        ran.extend(keys)
        if keys == [broken]:
            try:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: injected")
            except jax.errors.JaxRuntimeError as err:
                raise RuntimeError("the step cannot run") from err
        run_once(keys)

    monkeypatch.setattr(runner, "_run_each_step_once", spy)
    with pytest.warns(RuntimeWarning, match="mixed step T=16 N=2 P=16 compiled in the background but cannot run"):
        engine.idle()  # 4 of the 5 run
        engine.idle()  # and the fifth
    assert len(ran) == 5 and runner.num_pending_executables == 1 and broken not in runner._steps
    gate.open_late()
    assert runner.finish_warm_up(timeout_s=600) and len(runner._steps) == 7  # 8 planned, one dropped
    assert run(engine, ["f"]) == {"f": reference["f"]}
    assert (16, 8, 16, False, False) in runner.launch_counts and broken not in runner.launch_counts  # fewest tokens
    assert not runner._all_in_use  # steps keep looking for a ready bucket
    assert list(runner._unprimed) == [last]  # taken into use by finish_warm_up, not run yet: the next idle tick runs it
    engine.idle()
    assert ran[-1] == last and not runner._unprimed
    assert_pools_free(engine)
