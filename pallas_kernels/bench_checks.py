"""Correctness verdicts of the kernel benches (GPU runs, not the library): a bench whose checks fail or crash prints
a line saying so and exits non-zero once it has written its report, instead of leaving an empty ``checks``."""

from __future__ import annotations

import math
import sys
import traceback
from typing import Any, Callable


def run(fn: Callable, *args) -> tuple[Any, list[str]]:
    """``(fn(*args), [])``, or ``({}, [the crash])`` with its traceback printed; no results at all is a failure."""
    try:
        results = fn(*args)
    except Exception as err:  # noqa: BLE001 - reported, and the bench exits non-zero at its end
        traceback.print_exc()
        return {}, [f"checks crashed: {err!r}"[:500]]
    return results, [] if results else ["checks returned no results"]


def over(results: Any, tolerance: Callable[[str], float | None], path: str = "") -> list[str]:
    """Failures in a nested dict / list of check results: a number above ``tolerance(path)`` (None: not a check)
    or NaN, ``False``, or a string starting with ``"error"`` (a recorded crash) where the path has a tolerance."""
    if isinstance(results, dict):
        return [f for key, value in results.items() for f in over(value, tolerance, f"{path}/{key}" if path else
                                                                  str(key))]
    if isinstance(results, (list, tuple)):
        return [f for i, value in enumerate(results) for f in over(value, tolerance, f"{path}[{i}]")]
    tol = tolerance(path)
    if tol is None:
        return []
    if isinstance(results, bool):
        return [] if results else [f"{path}: False"]
    if isinstance(results, str):
        return [f"{path}: {results[:200]}"] if results.startswith("error") else []
    if isinstance(results, (int, float)) and (math.isnan(results) or results > tol):
        return [f"{path}: {results:.3e} > {tol:.1e}"]
    return []


def finish(bench: str, failures: list[str]) -> None:
    """Print the verdict; exit with status 1 when any check failed."""
    if not failures:
        print(f"{bench}: correctness checks passed", flush=True)
        return
    print(f"{bench}: CORRECTNESS CHECKS FAILED ({len(failures)}):", flush=True)
    for failure in failures:
        print(f"  {failure}", flush=True)
    sys.exit(1)
