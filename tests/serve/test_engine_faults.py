"""Fault isolation in the engine, on the shared small runner (test mode: freed pages and slots are NaN-poisoned).

A step whose launch raises, whose result read raises, whose request's live state is NaN (so its forward, cache
writes and logits are non-finite inside a real step), or whose output processing raises fails the requests of
that step (and only those, with finish_reason "error" and a message); every other request's greedy tokens equal
a fault-free run, the engine keeps serving, pools end free and nothing compiles. The NaN case is also the
cross-row check: the corrupted request shares its steps (MoE routing, packed attention, padding rows) with the
others, whose outputs stay identical.
"""

from __future__ import annotations

import jax
import pytest

from serve.engine.faults import FaultInjector, InjectedFault, RandomFaults
from serve.engine.scheduler import NON_FINITE_MESSAGE
from tests.serve.test_engine_runner import PROMPTS, add_all, assert_pools_free, greedy, make_engine, run

NAMES = sorted(PROMPTS)


@pytest.fixture(scope="module")
def clean() -> dict[str, list[int]]:
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64)
    add_all(engine, NAMES, greedy(12))
    done = run(engine)
    assert_pools_free(engine)
    return {name: out.outputs[0].token_ids for name, out in done.items()}


def faulted_run(injector: FaultInjector, *, async_scheduling: bool = True, names=NAMES, **scheduling):
    scheduling = {"max_num_seqs": 3, "max_num_batched_tokens": 64, **scheduling}
    engine = make_engine(async_scheduling=async_scheduling, **scheduling)
    engine.runner.fault_injector = injector
    try:
        add_all(engine, names, greedy(12))
        done = run(engine)
    finally:
        engine.runner.fault_injector = None
    assert_pools_free(engine)
    return engine, done


def split(done):
    failed = {name for name, out in done.items() if out.error is not None}
    for name in failed:
        assert all(o.finish_reason == "error" for o in done[name].outputs), done[name]
    return failed, {name: out.outputs[0].token_ids for name, out in done.items() if name not in failed}


def fired_requests(injector: FaultInjector) -> set[str]:
    return {request_id for _, _, ids in injector.fired for request_id in ids}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_step_faults_fail_only_that_steps_requests(clean, async_scheduling):
    base = make_engine().runner.num_launches
    # steps 1 and 6 (in this run's numbering) fail at launch and when read; the live state of "h" turns NaN in
    # the first step from 10 on that reads it (3 requests run at a time, so each fault spares the others)
    injector = FaultInjector(launch={base + 1}, result={base + 6}, nan={base + s: ["h"] for s in range(10, 40)})
    engine, done = faulted_run(injector, async_scheduling=async_scheduling)
    kinds = [kind for kind, _, _ in injector.fired]
    assert sorted(kinds) == ["launch", "nan", "result"], injector.fired
    failed, survivors = split(done)
    assert failed == fired_requests(injector) and set(done) == set(NAMES)
    assert failed and survivors, "the faults should hit some requests and spare others"
    assert survivors == {name: clean[name] for name in survivors}
    nan_failed = {r for kind, _, ids in injector.fired if kind == "nan" for r in ids}
    assert all(done[name].error == NON_FINITE_MESSAGE for name in nan_failed)
    # the engine keeps serving: the failed requests again, now clean
    add_all(engine, sorted(failed), greedy(12))
    again = run(engine)
    assert {name: out.outputs[0].token_ids for name, out in again.items()} == {name: clean[name] for name in failed}
    assert_pools_free(engine)


def test_detokenizer_fault_fails_that_request_and_its_siblings(clean):
    injector = FaultInjector(detokenize={"g#1"})
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64)
    engine.runner.fault_injector = injector
    try:
        engine.add_request("g", PROMPTS["g"], greedy(12, n=2))
        add_all(engine, ["a", "k"], greedy(12))
        done = run(engine)
    finally:
        engine.runner.fault_injector = None
    assert injector.fired == [("detokenize", None, ("g#1",))]
    assert done["g"].error and [o.finish_reason for o in done["g"].outputs] == ["error", "error"]
    assert {n: done[n].outputs[0].token_ids for n in ("a", "k")} == {n: clean[n] for n in ("a", "k")}
    assert_pools_free(engine)


class _LoseDeviceState(FaultInjector):
    """Reading step ``at`` raises after deleting the cache pools, as a device error that poisons them would."""

    def __init__(self, runner, at: int):
        super().__init__()
        self._runner, self._at = runner, at

    def on_result(self, step: int, request_ids: list[str]) -> None:
        if step == self._at:
            for array in jax.tree.leaves(self._runner.cache):
                array.delete()
            self.fired.append(("result", step, tuple(request_ids)))
            raise InjectedFault("device state lost")


def test_lost_device_state_rebuilds_the_cache_and_keeps_serving(clean):
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=64)
    jax.clear_caches()  # the rebuild uses only executables the runner holds, not JAX's jit caches
    injector = _LoseDeviceState(engine.runner, engine.runner.num_launches + 3)
    engine.runner.fault_injector = injector
    try:
        add_all(engine, ["a", "b", "k", "h"], greedy(12))  # two run, two wait: the waiting ones survive
        done = run(engine)
    finally:
        engine.runner.fault_injector = None
    failed, survivors = split(done)
    assert failed == {"a", "b"} and survivors == {n: clean[n] for n in ("k", "h")}
    assert all("device state" in done[n].error for n in failed)
    assert_pools_free(engine)
    add_all(engine, ["a", "b"], greedy(12))  # from the rebuilt pools (the prefix cache was emptied)
    assert {n: o.outputs[0].token_ids for n, o in run(engine).items()} == {n: clean[n] for n in ("a", "b")}


def test_random_faults_with_preemption_and_prefix_hits():
    """Random faults of every kind (three seeds between them fire all four) over a workload with shared prefixes
    and a pool small enough to preempt: survivors equal the fault-free run of the same settings."""
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, num_blocks_override=24)
    reference = make_engine(**settings)
    add_all(reference, NAMES, greedy(12))
    expected = {n: o.outputs[0].token_ids for n, o in run(reference).items()}
    kinds = set()
    for seed in (0, 1, 10):
        injector = RandomFaults(seed=seed, rate=0.12)
        _, done = faulted_run(injector, **settings)
        failed, survivors = split(done)
        assert failed and survivors and failed <= fired_requests(injector)
        assert survivors == {name: expected[name] for name in survivors}
        kinds |= {kind for kind, _, _ in injector.fired}
    assert kinds == {"launch", "result", "nan", "detokenize"}


def test_scrubs_follow_a_failure(monkeypatch):
    """The pages and slots a failed request frees (its live slot and its step's checkpoint slots) are overwritten
    with the scratch entry in the next step, before anything can reuse them."""
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64)
    runner = engine.runner
    seen = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda out: (seen.append(out), execute(out))[1])
    runner.fault_injector = FaultInjector(launch={runner.num_launches})
    try:
        add_all(engine, ["k"], greedy(12))
        done = run(engine)
    finally:
        runner.fault_injector = None
    assert done["k"].error is not None
    failed = seen[0].sequences[0]
    add_all(engine, ["a"], greedy(2))
    run(engine)
    assert set(seen[1].scrub_blocks) == set(failed.block_table)
    assert seen[1].scrub_slots == sorted([failed.state_slot, *failed.checkpoint_slots])
    assert failed.checkpoint_slots and not seen[2].scrub_blocks
    assert_pools_free(engine)
