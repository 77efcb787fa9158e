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
    """The opt-in persistent XLA compilation cache (tests/jit_cache.py says why it is off by default)."""
    from tests import jit_cache

    if jit_cache.FOLDER:
        import jax

        jax.config.update("jax_compilation_cache_dir", jit_cache.FOLDER)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
