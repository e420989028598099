"""benchmarks/cpu_kernels.py and cpu_dot_rows.py --smoke in this process: both contenders run and agree."""

from __future__ import annotations


def test_cpu_kernels_smoke_runs_both_contenders_and_they_agree(monkeypatch):
    from benchmarks.cpu_kernels import main

    from axcore_cpu import openblas_dot

    monkeypatch.setattr(openblas_dot, "xla_dot_is_faster", lambda: False)  # openblas serves (not on AVX-512 CPUs).

    report = main(["--smoke"])
    assert set(report["shapes"]) == {"B4xT1xW2", "B2xT8xW2"}
    decode, prefill = report["shapes"]["B4xT1xW2"], report["shapes"]["B2xT8xW2"]
    assert decode["kernels"]["default"] == {"dot": ["openblas"], "paged_attention": ["cpu_paged_decode"]}
    assert decode["kernels"]["xla"] == {"dot": ["xla"], "paged_attention": ["xla_cpu_decode"]}
    assert prefill["kernels"]["default"]["paged_attention"] == ["xla"]  # Prefill chunks: the reference.
    for entry in report["shapes"].values():
        assert entry["logits_max_abs_diff"] < 1e-4 and entry["default"]["median_ms"] > 0


def test_cpu_dot_rows_smoke_times_the_three_products_and_they_agree():
    """benchmarks/cpu_dot_rows.py --smoke: XLA's dot, the sgemm and the rows FFI calls on the same small decoder."""
    from benchmarks.cpu_dot_rows import main

    report = main(["--smoke"])
    assert set(report["rows"]) == {"1", "4"}
    for entry in report["rows"].values():
        assert entry["max_abs_diff_sgemm"] < 1e-4 and entry["max_abs_diff_rows"] < 1e-4
        assert min(entry[name]["median_ms"] for name in ("xla", "sgemm", "rows")) > 0
