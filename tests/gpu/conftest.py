"""The GPU suite: every test here is marked ``gpu`` and skipped unless JAX's first device is a CUDA GPU (run it with
``JAX_PLATFORMS=cuda``; ``tests/conftest.py`` only defaults the platform to the CPU). ``python tests/gpu/run_suite.py
--out DIR`` runs it in one process and writes ``DIR/gpu_suite.json``.

Each test names its kernel with ``@pytest.mark.kernel("...")``; the ``check`` fixture asserts a tolerance and
records the error measured, which the suite's summary reports per kernel (its largest error relative to its
tolerance)."""

from __future__ import annotations

import pytest

GPU_REASON = "needs a CUDA device (JAX_PLATFORMS=cuda)"


def on_gpu() -> bool:
    import jax

    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:  # no backend for the requested platform
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel(name): the kernel a GPU test checks (the suite summary's row)")


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    gpu = on_gpu()
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not gpu:
                item.add_marker(pytest.mark.skip(reason=GPU_REASON))


@pytest.fixture
def check(request):
    """``check(name, error, tol)``: record a measured error under the test's kernel and assert it is at most
    ``tol`` (NaN fails)."""

    def check_error(name: str, error: float, tol: float) -> None:
        request.node.user_properties.append(("error", (name, float(error), tol)))
        assert error <= tol, f"{name}: error {error:.3e} > {tol:.1e}"

    return check_error
