"""`serve/bench/offload_ttft.py` on the tiny preset's first 4 layers: its main path times the three ways, proves
the host hit came from the host tier, and fails when the device copy is not evicted. One engine serves both runs."""

from __future__ import annotations

import json

import jax
import pytest

from serve.bench import offload_ttft as bench
from serve.engine.sampling_params import SamplingParams

ARGV = ["--preset", "tiny", "--layers", "4", "--dtype", "float32", "--prompt-lens", "256", "--repeats", "1",
        "--block-size", "16", "--prefill-chunk", "128", "--memory-gib", "0.0625", "--cpu-offload-gb", "0.0625"]


@pytest.fixture(scope="module")
def engine():
    return bench.build_engine(bench.parse_args(ARGV))


@pytest.fixture
def run_main(engine, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "build_engine", lambda args: engine)

    def run() -> tuple[int, dict]:
        code = bench.main(ARGV + ["--out", str(tmp_path)])
        return code, json.loads((tmp_path / "offload_ttft.json").read_text())
    return run


def assert_pools_free(engine) -> None:
    cache = engine.scheduler.cache
    pages, slots = cache.pages.pool, cache.slots.pool
    assert pages.num_free == pages.num_usable and slots.num_free == slots.num_usable
    assert cache.connector.store.stats().num_bytes == 0


def test_host_hit_is_verified_and_first_tokens_match(engine, run_main):
    code, got = run_main()
    assert code == 0 and got["status"] == "done"
    (row,) = got["rows"]
    assert row["prompt_len"] == 256 and row["repeats"] == 1
    for name in bench.VARIANTS:
        assert row[name]["median_s"] > 0
    assert row["recompute"]["cached_tokens"] == [0]
    assert row["device_hit"]["cached_tokens"] == [255] and row["device_hit"]["host_tier_tokens"] == [0]
    assert row["host_hit"]["host_tier_tokens"] == row["host_hit"]["cached_tokens"] == [255]
    assert row["first_tokens_identical"] and len(set(row["first_tokens"][0])) == 1
    assert got["compiles_after_setup"] == 0
    assert_pools_free(engine)


def test_skipping_the_eviction_fails_the_verification(engine, run_main, monkeypatch, capsys):
    monkeypatch.setattr(bench, "evict_device_copy", lambda engine: None)
    code, got = run_main()
    assert code == 2
    assert "the device copy was not evicted" in got["status"] and "not evicted" in capsys.readouterr().out
    assert not got["rows"]
    assert_pools_free(engine)


def test_store_arrays_are_the_spilled_entries(engine):
    cache = engine.scheduler.cache
    engine.add_request("spill", list(range(40)), SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    bench.evict_device_copy(engine)
    arrays = cache.connector.store.arrays()
    stats = cache.connector.store.stats()
    layout = cache.connector.copier.layout
    assert stats.num_pages == 2 and stats.num_checkpoints > 0  # 40 tokens: 2 full pages; every checkpoint has a tail
    assert len(arrays) == (stats.num_pages * len(layout.page.names)
                           + stats.num_checkpoints * (len(layout.slot.names) + len(layout.page.names)))
    assert all(isinstance(a, jax.Array) for a in arrays)
    cache.connector.store.clear()
    assert not cache.connector.store.arrays()
    assert_pools_free(engine)


def test_differing_first_tokens_fail_on_the_cpu(engine, run_main, monkeypatch):
    real = bench.first_token

    def host_hit_off_by_one(engine, request_id, prompt):
        run = real(engine, request_id, prompt)
        if request_id.endswith("-host") and not request_id.startswith("warm"):
            run.token += 1
        return run
    monkeypatch.setattr(bench, "first_token", host_hit_off_by_one)
    code, got = run_main()
    assert code == 3 and "first tokens differ" in got["status"]
    assert_pools_free(engine)


def test_a_compilation_inside_a_timed_run_fails(engine, run_main, monkeypatch):
    from serve.engine import runner

    calls = iter(range(10 ** 6))
    monkeypatch.setattr(runner, "backend_compile_count", lambda: next(calls))  # every read: one more compilation
    code, got = run_main()
    assert code == 4 and "compilation(s) inside the timed run" in got["status"]
    assert_pools_free(engine)
