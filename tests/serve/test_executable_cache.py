"""The executable cache (``serve.engine.executable_cache``): a second runner of the same program loads every step
executable instead of tracing, lowering and compiling it, and serves the same greedy tokens; any change to what
shapes the program starts a new fingerprint; damaged files and backends that cannot serialise are misses, never
errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from serve.cli import build_parser, engine_args_from_cli
from serve.engine import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.executable_cache import ExecutableCache, fingerprint, source_digest
from serve.engine.runner import ModelRunner, backend_compile_count
from tests.serve.test_engine_runner import BLOCK, MAX_NEW, PROMPTS, RUNNER_CONFIG, add_all, greedy, run, shared_lm

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("a", "d", "h")


def cached_config(folder: Path) -> EngineConfig:
    return dataclasses.replace(RUNNER_CONFIG, executable_cache_dir=str(folder), test_mode=False)


def serve_greedy(runner: ModelRunner) -> dict[str, list[int]]:
    engine = LLMEngine(runner, config=EngineConfig(block_size=BLOCK))
    add_all(engine, NAMES, greedy())
    return {name: list(out.outputs[0].token_ids) for name, out in run(engine).items()}


START = """
import json, sys
from serve.engine.runner import ModelRunner, backend_compile_count
from tests.serve import test_executable_cache as t
from tests.serve.test_engine_runner import shared_lm
lm = shared_lm()
before = backend_compile_count()
runner = ModelRunner(lm, t.cached_config(t.Path(sys.argv[1])))
compiles = backend_compile_count() - before
store = runner.executable_cache
print(json.dumps(dict(hits=store.hits, misses=store.misses, stored=store.stored, compiles=compiles,
                      executables=runner.num_executables, tokens=t.serve_greedy(runner),
                      after=runner.compiles_after_warm_up)))
"""


def start_server_process(folder: Path) -> dict:
    """A runner built in a new process, as ``kimi-jax serve`` builds one (XLA's CPU client cannot run an
    executable deserialised in a process that compiled others before, e.g. a pytest worker)."""
    run = subprocess.run([sys.executable, "-c", START, str(folder)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """The model's own greedy continuations (no engine, no cache)."""
    outs = shared_lm().generate([PROMPTS[n] for n in NAMES], max_new_tokens=MAX_NEW, stop_token_ids=[])
    return {n: out[len(PROMPTS[n]):] for n, out in zip(NAMES, outs)}


def test_a_restart_loads_every_executable_and_serves_the_same_tokens(tmp_path, expected):
    cold = start_server_process(tmp_path)
    assert cold["hits"] == 0 and cold["misses"] == cold["stored"] == cold["executables"] > 0
    warm = start_server_process(tmp_path)
    assert warm["hits"] == cold["executables"] and warm["misses"] == warm["stored"] == 0
    assert warm["compiles"] <= 1 < cold["compiles"]  # the pool initialiser only: no step traced or compiled
    assert warm["tokens"] == cold["tokens"] == expected and warm["after"] == 0


def test_a_loaded_executable_that_cannot_run_is_discarded_and_compiled_again(tmp_path, monkeypatch, expected):
    class Broken:
        def __call__(self, *args):
            raise jax.errors.JaxRuntimeError("NOT_FOUND: Function wrapped_iota not found")

        def memory_analysis(self):
            return None

    fp = ModelRunner(shared_lm(), cached_config(tmp_path), warm_up=False)._executable_fingerprint()
    (tmp_path / fp[:40]).mkdir()
    (tmp_path / fp[:40] / "stale.exec").write_bytes(b"x")
    def load(self, key):
        self.hits += 1
        return Broken()

    monkeypatch.setattr(ExecutableCache, "load", load)
    with pytest.warns(RuntimeWarning, match="discarding the cache"):
        runner = ModelRunner(shared_lm(), cached_config(tmp_path))
    assert runner.executable_cache is None and runner.num_executables > 0
    assert serve_greedy(runner) == expected
    assert not list(tmp_path.rglob("*.exec"))  # the next start compiles and stores afresh


def test_the_fingerprint_follows_what_shapes_the_program(tmp_path):
    folder = tmp_path
    fp = ModelRunner(shared_lm(), cached_config(folder), warm_up=False)._executable_fingerprint()
    same = ModelRunner(shared_lm(), dataclasses.replace(cached_config(folder), seed=7, compile_threads=1,
                                                        async_scheduling=False), warm_up=False)
    assert same._executable_fingerprint() == fp  # settings that do not change a program share the executables
    for change in (dict(max_num_seqs=4, seq_buckets=(4,)), dict(max_logprobs=3), dict(memory_budget_bytes=2 << 20)):
        other = ModelRunner(shared_lm(), dataclasses.replace(cached_config(folder), **change), warm_up=False)
        assert other._executable_fingerprint() != fp, change
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    speculating = [ModelRunner(shared_lm(), dataclasses.replace(cached_config(folder), speculative_config=spec),
                               warm_up=False)._executable_fingerprint()
                   for spec in (ngram, {**ngram, "min_acceptance_length": 0}, {**ngram, "num_speculative_tokens": 3},
                                {**ngram, "prompt_lookup_min": 1, "prompt_lookup_max": 7})]
    # the drafting pause and the n-gram lookup run on the host: they shape no program
    assert speculating[0] == speculating[1] == speculating[3] != speculating[2] != fp
    assert fingerprint(dict(a=1, b=2)) == fingerprint(dict(b=2, a=1)) != fingerprint(dict(a=1, b=3))
    assert len(source_digest()) == 64


def test_a_damaged_file_is_a_miss_and_is_rewritten(tmp_path):
    fn = jax.jit(lambda x: x * 2 + 1)
    compiled = fn.lower(jax.ShapeDtypeStruct((5,), jnp.float32)).compile()
    store = ExecutableCache(tmp_path, "f" * 64)
    assert store.load("k") is None and store.misses == 1  # absent
    assert store.store("k", compiled)
    loaded = ExecutableCache(tmp_path, "f" * 64).load("k")
    assert loaded is not None and jnp.array_equal(loaded(jnp.arange(5.0)), jnp.arange(5.0) * 2 + 1)
    (path,) = (tmp_path / ("f" * 40)).iterdir()
    path.write_bytes(path.read_bytes()[:40])  # truncated
    damaged = ExecutableCache(tmp_path, "f" * 64)
    assert damaged.load("k") is None and damaged.misses == 1 and damaged.hits == 0
    assert ExecutableCache(tmp_path, "e" * 64).load("k") is None  # another fingerprint never sees it
    assert damaged.store("k", compiled) and ExecutableCache(tmp_path, "f" * 64).load("k") is not None
    assert not list((tmp_path / ("f" * 40)).glob("*.tmp"))


def test_a_backend_that_cannot_serialise_still_serves(tmp_path, monkeypatch, expected):
    from jax.experimental import serialize_executable

    def refuse(compiled):
        raise jax.errors.JaxRuntimeError("UNIMPLEMENTED: `LessThan` is not serializable.")

    monkeypatch.setattr(serialize_executable, "serialize", refuse)
    runner = ModelRunner(shared_lm(), cached_config(tmp_path))
    store = runner.executable_cache
    assert store.stored == 0 and store.unserializable == runner.num_executables and store.hits == 0
    assert "not serialisable" in store.summary()
    assert serve_greedy(runner) == expected


def test_kimi_jax_serve_keeps_executables_beside_the_compile_cache_on_a_gpu(monkeypatch, tmp_path):
    import pallas_kernels.impl

    args = build_parser().parse_args(["serve", "tiny"])
    monkeypatch.setenv("KIMI_JAX_COMPILE_CACHE", str(tmp_path))
    assert "executable_cache_dir" not in engine_args_from_cli(args)  # CPU: XLA's compilation cache only
    monkeypatch.setattr(pallas_kernels.impl, "on_gpu", lambda: True)
    assert engine_args_from_cli(args)["executable_cache_dir"] == str(tmp_path / "executables")
    monkeypatch.setenv("KIMI_JAX_COMPILE_CACHE", "off")
    assert "executable_cache_dir" not in engine_args_from_cli(args)
