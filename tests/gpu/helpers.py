"""Error measures shared by the GPU tests."""

from __future__ import annotations

import numpy as np


def relative_max_error(actual, expected) -> float:
    """Max absolute error relative to the largest expected magnitude (the kernel tests' measure)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30)) if actual.size else 0.0


def row_relative_error(actual, expected) -> float:
    """Largest per-row max error relative to the row's largest expected magnitude (the MXFP4 tests' measure: rows
    scaled by up to 2**+-100 each count)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float((np.abs(actual - expected).max(1) / np.maximum(np.abs(expected).max(1), 1e-300)).max())
