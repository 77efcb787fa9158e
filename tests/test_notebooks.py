"""Every notebook in notebooks/ runs top to bottom without an error, and the repository holds them stripped.

The notebooks run in a fresh kernel of this interpreter (a temporary kernelspec pointing at ``sys.executable``, so
the installed ``python3`` spec, which names whatever ``python`` is on PATH, is never used), with the working
directory set to notebooks/ and JAX's persistent compilation cache shared with the rest of the suite.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
KERNEL = "kimi-jax-test"
CELL_TIMEOUT_S = 600


def test_notebooks_exist_and_are_stripped():
    from notebooks.strip_outputs import stripped

    assert {"quickstart.ipynb", "kernels.ipynb", "cache.ipynb", "sharding.ipynb"} <= set(NAMES)
    for name in NAMES:
        book = nbformat.read(NOTEBOOKS / name, as_version=4)
        assert book == stripped(book), f"{name} carries outputs: run python notebooks/strip_outputs.py"


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernelspec for this interpreter on JUPYTER_PATH, and the environment the kernels inherit."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "kimi-jax test kernel", "language": "python"}))
    cache = os.environ.get("KIMI_JAX_TEST_JIT_CACHE", os.path.expanduser("~/.cache/kimi_jax/jit"))
    env = {"JUPYTER_PATH": str(root), "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": cache,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.slow  # 1-3 minutes per notebook on a 2-core CPU, most of it compiling
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, kernel_env):
    from nbclient import NotebookClient

    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(book, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError naming the cell and its traceback
    errors = [out for cell in book.cells if cell.cell_type == "code" for out in cell.outputs
              if out.output_type == "error"]
    assert not errors
