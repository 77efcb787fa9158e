"""Test-wide setup: CPU JAX with 64-bit indices off, deterministic numpy seeds per test."""

import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test name: fresh random inputs per test, reproducible per test (CRC-32 of
    the test id: Python's ``hash`` of a string changes from process to process, so the inputs did too)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_configure(config):
    """Persistent XLA compilation cache: the suite compiles dozens of small programs; reruns reuse them."""
    import jax

    cache_dir = os.environ.get("KIMI_JAX_TEST_JIT_CACHE", os.path.expanduser("~/.cache/kimi_jax/jit"))
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


MAX_WORKER_MAPS = 30_000  # of Linux's default vm.max_map_count of 65530


@pytest.fixture(scope="module", autouse=True)
def bounded_jit_code():
    """Free compiled programs after a module once this process holds many memory mappings.

    Every XLA:CPU executable keeps its JIT code in anonymous mappings (about three per kernel), so a test worker
    that compiles for the whole suite approaches the kernel's vm.max_map_count; there mmap fails inside LLVM and
    the worker dies with a segfault or an abort in whatever compiles or serialises next. Past MAX_WORKER_MAPS the
    jit caches and the test modules' functools caches (shared models and runners, rebuilt on next use) let go."""
    yield
    if _num_mappings() > MAX_WORKER_MAPS:
        import functools
        import gc
        import sys

        import jax

        for name, module in list(sys.modules.items()):
            if name == "tests" or name.startswith("tests."):
                for value in list(vars(module).values()):
                    if isinstance(value, functools._lru_cache_wrapper):
                        value.cache_clear()
        jax.clear_caches()
        gc.collect()


def _num_mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0
