"""The benches fail loudly: a check that crashes, returns nothing or misses its bound makes the bench print a line
saying so and exit non-zero (here through the KDA bench's own check runner and verdict)."""

import pytest

from pallas_kernels import bench_checks
from pallas_kernels.kda import bench as kda_bench


def crashing_check(key):
    raise RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded")


@pytest.mark.parametrize("check,expected", [
    (crashing_check, "checks crashed: RuntimeError('RESOURCE_EXHAUSTED"),
    (lambda key: {}, "checks returned no results"),
    (lambda key: {"float32 softplus": [3e-4, 1e-6, 1e-6]}, "float32 softplus[0]: 3.000e-04 > 1.0e-04"),
    (lambda key: {"bfloat16 lower_bound": [1e-3, float("nan"), 1e-3]}, "bfloat16 lower_bound[1]: nan"),
])
def test_kda_bench_exits_non_zero_when_its_checks_fail(check, expected, capsys):
    report = {"rows": []}
    failures = kda_bench.run_checks(report, check, None)
    assert any(f.startswith(expected) for f in failures), failures
    with pytest.raises(SystemExit) as exit_info:
        bench_checks.finish("kda bench", failures + kda_bench.row_failures(report))
    assert exit_info.value.code == 1
    assert "kda bench: CORRECTNESS CHECKS FAILED" in capsys.readouterr().out


def test_kda_bench_passes_within_bounds_and_flags_rows(capsys):
    report = {"rows": [dict(kind="decode", H=32, B=16, state_dtype="float32", err_vs_ref_y=1e-3),
                       dict(kind="prefill", name="H32 T8K", error="xla reference compile: OOM")]}
    assert kda_bench.run_checks(report, lambda key: {"float32 softplus": [5e-5], "bfloat16 softplus": [1e-2]},
                                None) == []
    assert kda_bench.row_failures(report) == []
    bench_checks.finish("kda bench", [])
    assert "kda bench: correctness checks passed" in capsys.readouterr().out
    report["rows"] += [dict(kind="decode", H=96, B=16, state_dtype="bfloat16", err_vs_ref_state=0.5),
                       dict(kind="prefill", name="H96 T1K", error="ours compile: RESOURCE_EXHAUSTED")]
    assert [f.split(":")[0] for f in kda_bench.row_failures(report)] == [
        "rows/(96, 16, 'bfloat16')/err_vs_ref_state", "rows/H96 T1K"]


def test_over_reads_nested_results():
    tol = lambda path: None if path.startswith("info") else 1e-2  # noqa: E731
    results = {"a": {"o": 5e-3, "lse": 2e-2}, "info": {"speed": 3.0}, "b": [True, False], "c": "error: boom"}
    assert bench_checks.over(results, tol) == ["a/lse: 2.000e-02 > 1.0e-02", "b[1]: False", "c: error: boom"]
