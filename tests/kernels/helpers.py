"""Assertions shared by the kernel tests."""

import numpy as np


def assert_close(actual, expected, tol, name):
    """Max-abs error relative to the largest expected magnitude, with shapes checked first."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    err = np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30)
    assert err <= tol, f"{name}: relative max error {err:.3e} > {tol:.1e}"
