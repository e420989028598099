"""benchmarks/cpu_kernels.py --smoke in this process: both runners run every step shape and agree."""

from __future__ import annotations


def test_cpu_kernels_smoke_runs_both_contenders_and_they_agree():
    from benchmarks.cpu_kernels import main

    report = main(["--smoke"])
    assert set(report["shapes"]) == {"B4xT1xW2", "B2xT8xW2"}
    decode, prefill = report["shapes"]["B4xT1xW2"], report["shapes"]["B2xT8xW2"]
    assert decode["kernels"]["default"] == {"dot": ["openblas"], "paged_attention": ["cpu_paged_decode"]}
    assert decode["kernels"]["xla"] == {"dot": ["xla"], "paged_attention": ["xla_cpu_decode"]}
    assert prefill["kernels"]["default"]["paged_attention"] == ["xla"]  # Prefill chunks: the reference.
    for entry in report["shapes"].values():
        assert entry["logits_max_abs_diff"] < 1e-4 and entry["default"]["median_ms"] > 0
