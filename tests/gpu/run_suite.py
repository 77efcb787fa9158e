"""Run the GPU suite (tests/gpu) in one process and write ``DIR/gpu_suite.json``: per kernel the cases, how many
passed / failed / were skipped, and the largest error measured (and its tolerance); per test its outcome, time
and errors. Prints a table; exits 1 if anything failed, 2 if nothing ran (no GPU).

Usage, from the repository root on a GPU machine::

    export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=.
    python3 tests/gpu/run_suite.py --out $OUT [-k EXPR] [test_kda.py ...]

The suite is compile-bound (each case builds its kernels): on a many-core host, run one process per file
(``--out $OUT/<file>`` each) side by side. ``gpu_suite.partial.json`` is rewritten after every test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


class Recorder:
    """A pytest plugin collecting each test's kernel, outcome, duration and the errors ``check`` recorded."""

    def __init__(self, partial_path: str | None = None):
        self.kernel_of, self.tests, self.partial_path = {}, {}, partial_path

    def pytest_itemcollected(self, item):
        marker = item.get_closest_marker("kernel")
        self.kernel_of[item.nodeid] = marker.args[0] if marker else item.module.__name__.rsplit(".", 1)[-1]

    def pytest_runtest_logreport(self, report):
        test = self.tests.setdefault(report.nodeid, dict(kernel=self.kernel_of.get(report.nodeid, "?"),
                                                         outcome="passed", seconds=0.0, errors=[]))
        test["seconds"] += report.duration
        test["errors"] = [dict(zip(("name", "error", "tol"), value)) for key, value in report.user_properties
                          if key == "error"]
        if report.outcome == "skipped" and test["outcome"] == "passed":
            test["outcome"], test["reason"] = "skipped", str(report.longrepr[-1] if isinstance(
                report.longrepr, tuple) else report.longrepr)[:300]
        elif report.outcome == "failed":
            test["outcome"] = "failed" if report.when == "call" else "error"
            test["message"] = str(report.longrepr)[-2000:]
        if self.partial_path and report.when == "teardown":  # a run cut short still leaves what it finished
            with open(self.partial_path, "w") as f:
                json.dump(dict(partial=True, kernels=summarize(self.tests), tests=self.tests), f, indent=1)


def summarize(tests: dict) -> dict:
    kernels = collections.defaultdict(lambda: dict(cases=0, passed=0, failed=0, skipped=0, max_error=None,
                                                   max_error_tol=None, max_error_case=None))
    for test in tests.values():
        k = kernels[test["kernel"]]
        k["cases"] += 1
        k[{"passed": "passed", "skipped": "skipped"}.get(test["outcome"], "failed")] += 1
        for e in test["errors"]:
            if k["max_error"] is None or e["error"] > k["max_error"]:
                k.update(max_error=e["error"], max_error_tol=e["tol"], max_error_case=e["name"])
    return dict(sorted(kernels.items()))


def print_table(kernels: dict) -> None:
    print(f"\n{'kernel':<22}{'cases':>6}{'passed':>7}{'failed':>7}{'skipped':>8}{'max error':>11}{'tol':>9}"
          "  worst case")
    for name, k in kernels.items():
        err = "-" if k["max_error"] is None else f"{k['max_error']:.2e}"
        tol = "-" if k["max_error_tol"] is None else f"{k['max_error_tol']:.0e}"
        print(f"{name:<22}{k['cases']:>6}{k['passed']:>7}{k['failed']:>7}{k['skipped']:>8}{err:>11}{tol:>9}  "
              f"{k['max_error_case'] or ''}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("-k", default=None, help="pytest -k expression (a subset of the suite)")
    parser.add_argument("files", nargs="*", help="test files of tests/gpu to run (default: all)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    recorder = Recorder(os.path.join(args.out, "gpu_suite.partial.json"))
    start = time.perf_counter()
    targets = [os.path.join(HERE, os.path.basename(f)) for f in args.files] or [HERE]
    pytest_args = [*targets, "-q", "-rfEs", "-p", "no:cacheprovider", "-o", "addopts=--durations=15"]
    if args.k:
        pytest_args += ["-k", args.k]
    code = pytest.main(pytest_args, plugins=[recorder])
    kernels = summarize(recorder.tests)
    import jax

    devices = [str(d.device_kind) for d in jax.devices()]
    passed = sum(k["passed"] for k in kernels.values())
    failed = sum(k["failed"] for k in kernels.values())
    summary = dict(devices=devices, jax=jax.__version__, pytest_exit_code=int(code),
                   seconds=time.perf_counter() - start, passed=passed, failed=failed,
                   skipped=sum(k["skipped"] for k in kernels.values()), kernels=kernels, tests=recorder.tests)
    with open(os.path.join(args.out, "gpu_suite.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print_table(kernels)
    print(f"\ngpu suite on {devices[0] if devices else '?'}: {passed} passed, {failed} failed, "
          f"{summary['skipped']} skipped in {summary['seconds']:.0f} s -> {os.path.join(args.out, 'gpu_suite.json')}")
    if failed or code not in (0, 5):
        return 1
    return 0 if passed else 2


if __name__ == "__main__":
    sys.exit(main())
