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
