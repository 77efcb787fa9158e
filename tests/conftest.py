"""Test-wide setup: CPU JAX with 64-bit indices off, deterministic numpy seeds per test."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test name: fresh random inputs per test, reproducible per test."""
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))
