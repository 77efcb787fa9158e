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


def test_kda_bench_suggests_decode_routing_from_its_timings():
    """The Mosaic-GPU fields the decode-mgpu suite prints: one launch where it beat three in most cases, the bf16
    reductions where they beat the wgmma in the chosen launch form, and per pool dtype the fewest rows from which
    that form beat the tuned kernel in every case (a loss at a larger step moves the threshold past it)."""
    def row(b, h, dtype, triton, one, three, reduce=None, reduce3=None):
        r = dict(kind="decode", B=b, H=h, state_dtype=dtype, ours_device_us=triton, ours_mgpu_device_us=one,
                 ours_mgpu3_device_us=three)
        if reduce is not None:
            r.update(ours_mgpu_reduce_device_us=reduce, ours_mgpu3_reduce_device_us=reduce3)
        return r

    rows = [row(16, 32, "float32", 20, 25, 30), row(64, 32, "float32", 100, 95, 110),  # 512, 2048 rows
            row(16, 96, "float32", 80, 79, 85), row(256, 32, "float32", 400, 390, 405),  # 1536, 8192
            row(64, 32, "bfloat16", 60, 70, 75, 58, 80), row(64, 96, "bfloat16", 190, 200, 210, 180, 215),
            row(256, 32, "bfloat16", 250, 260, 270, 255, 280), row(256, 96, "bfloat16", 800, 780, 790, 700, 790),
            dict(kind="prefill", name="H32 T8K")]
    assert kda_bench.suggest_decode_routing(rows) == dict(
        mgpu_min_rows=1536, mgpu_min_rows_bf16=24576, mgpu_one_launch=True, mgpu_bf16_sums="reduce")
    three_wins = [row(16, 32, "float32", 20, 31, 30), row(64, 32, "float32", 100, 99, 98),
                  row(16, 96, "float32", 80, 86, 85), row(256, 32, "float32", 400, 391, 390)]
    assert kda_bench.suggest_decode_routing(three_wins) == dict(
        mgpu_min_rows=2048, mgpu_min_rows_bf16=0, mgpu_one_launch=False, mgpu_bf16_sums="wgmma")
    assert kda_bench.suggest_decode_routing([]) == dict(
        mgpu_min_rows=0, mgpu_min_rows_bf16=0, mgpu_one_launch=False, mgpu_bf16_sums="wgmma")
