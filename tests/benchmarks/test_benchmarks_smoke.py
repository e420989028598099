"""`python -m benchmarks.run --smoke` end to end, so the runner and its benchmarks never rot.

One smoke run (tiny models, few steps) is shared by every test here. Its numbers mean
nothing; checked are the exit status, one JSON file per benchmark naming the machine
with every target carrying a value and a `met` flag, the summary table, and what a
smoke run can establish (e.g. the step-time contenders compute the same losses from
the same parameters, and `axcore config` imports no plugin that is not enabled).
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MACHINE_KEYS = {"cpu_model", "cores", "python", "jax_version", "backend", "device_kind", "device_count"}
BENCHMARKS = [
    "step_time", "utilization", "memory", "compile_time", "startup", "checkpoint_io", "checkpoint_blocking",
    "dispatch_overlap", "recovery_latency", "decode_speed", "first_step", "data_wait",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--results-dir", str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return directory


def _load(results: pathlib.Path, name: str) -> dict:
    data = json.loads((results / f"{name}.json").read_text())
    assert data["benchmark"] == name and data["smoke"] is True
    assert MACHINE_KEYS <= set(data["machine"])
    for target_name, target in data.get("targets", {}).items():
        assert {"target", "value", "met"} <= set(target), target_name
        assert isinstance(target["met"], bool), target_name
    return data


def _is_summary(entry: dict) -> bool:
    return {"median", "p10", "p90", "n"} <= set(entry) and entry["median"] >= 0


def test_every_benchmark_writes_json_and_the_summary_lists_it(results):
    summary = (results / "SUMMARY.md").read_text()
    for name in BENCHMARKS:
        data = _load(results, name)
        assert f"| {name} |" in summary, name
    assert data["machine"]["cpu_model"] in summary


def test_step_time_contenders_do_the_same_math(results):
    step = _load(results, "step_time")
    assert {"axcore", "axcore_scan", "pure_jax"} <= set(step["step_time_s"])
    assert len(set(step["num_params"].values())) == 1
    assert step["losses_agree"], step["loss_max_rel_diff_vs_pure"]


def test_utilization_formula_counts_every_dot(results):
    util = _load(results, "utilization")
    assert util["hlo_dot_flops"] == util["flops_per_step"]["total"]


def test_memory_reports_peaks(results):
    memory = _load(results, "memory")
    assert all(v > 0 for v in memory["peak_rss_mib"].values())


def test_compile_time_covers_both_stacks(results):
    data = _load(results, "compile_time")
    assert set(data["results"]) == {f"{v}/{n}" for v in ("unrolled", "scanned") for n in (1, 2)}
    for key, entry in data["results"].items():
        assert not entry["timed_out"], key
        for field in ("time_to_first_step_s", "step_compile_total_s", "step_compile_s", "init_compile_s", "init_total_s"):
            assert _is_summary(entry[field]), (key, field)
        assert entry["step_xla_compiles"] >= 1
    # The scanned stack holds the same parameters as the unrolled one.
    assert data["results"]["scanned/2"]["parameters"] == data["results"]["unrolled/2"]["parameters"]
    assert "scanned_compile_2_over_1_layers" in data["targets"]


def test_startup_imports_only_enabled_plugins(results):
    data = _load(results, "startup")
    assert set(data["results"]) == {f"{c}/{w}" for c in ("help", "plugins", "config") for w in ("with", "without")}
    assert all(_is_summary(e) and e["n"] == 1 for e in data["results"].values())
    assert set(data["targets"]) == {"help_wall_s", "discovery_overhead_s"}
    # `axcore plugins` imports every installed plugin to list its hooks; the others import none.
    assert data["dummy_plugins_imported_by"] == {"help": 0, "plugins": 3, "config": 0}


def test_checkpoint_io_covers_both_backends(results):
    data = _load(results, "checkpoint_io")
    assert 3e6 < data["setup"]["bytes"] < 6e6
    backends = ("orbax", "tensorstore")
    expected = {"raw/write", "raw/read"} | {f"{b}/{m}" for b in backends for m in ("blocking", "save_total", "restore")}
    assert set(data["results"]) == expected
    assert all(_is_summary(e) for e in data["results"].values())
    kinds = ("blocking_s", "save_throughput_vs_raw", "restore_throughput_vs_raw")
    assert set(data["targets"]) == {f"{b}/{t}" for b in backends for t in kinds}


def test_checkpoint_blocking_times_three_contenders(results):
    data = _load(results, "checkpoint_blocking")
    contenders = ("orbax_raw", "orbax_arrays_only", "orbax", "tensorstore")
    assert set(data["results"]) == set(contenders) and data["setup"]["leaves"] == 55
    for name in contenders:
        entry = data["results"][name]
        assert _is_summary(entry["blocking_s"]) and _is_summary(entry["committed_s"]), name
        assert entry["blocking_s"]["median"] <= entry["committed_s"]["median"], name  # save() is part of the save.
    assert set(data["targets"]) == {"orbax/blocking_vs_orbax_raw", "tensorstore/blocking_vs_orbax_raw", "restored_state_verifies"}
    assert data["targets"]["restored_state_verifies"]["met"]


def test_recovery_latency_smoke_splits_each_recovery(results):
    data = _load(results, "recovery_latency")
    assert set(data["results"]) == {"tensorstore/warm"}
    for name, samples in data["samples"].items():
        for s in samples:
            # Every phase took time; it resumed from a committed step.
            parts = (s["restart_s"], s["restore_s"], s["compile_s"], s["first_step_s"])
            assert min(parts) > 0, (name, s)
            assert s["restored_step"] >= 5 and s["restored_step"] % 5 == 0, (name, s)
    assert all(_is_summary(e["total_s"]) for e in data["results"].values())


def test_generate_load_smoke_imports_parameters_only(tmp_path):
    """benchmarks/generate_load.py (run on its own, not by benchmarks.run): import + generate, this checkout."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.generate_load", "--smoke", "--results-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = _load(tmp_path, "generate_load")
    after = data["contenders"]["after"]
    assert pathlib.Path(after["axcore"]).is_relative_to(ROOT) and pathlib.Path(after["axcore_hf"]).is_relative_to(ROOT)
    # Parameters only: about one float32 copy of the weights on disk (Adam's moments would triple it).
    assert 4 * data["parameters"] <= after["checkpoint_bytes"] < 1.2 * 4 * data["parameters"]
    assert 0 < after["restore_s"]["median"] < after["load_s"]["median"] < after["wall_s"]["median"]
    assert after["completion"].startswith("w1 w2 w3 w4 w5 w6 w7 w8") and after["max_rss_bytes"]["median"] > 50 * 2**20  # JAX alone
    # generate and eval load through the placement alone: the train state's shapes (optimizer state included) are
    # never built, and the parameters loaded are one float32 copy of the transformers model's parameters.
    for prefix in ("", "eval_"):
        assert after[f"{prefix}train_states"]["median"] == 0
        assert after[f"{prefix}param_bytes"]["median"] == 4 * data["parameters"]
        assert after[f"{prefix}live_bytes_after_load"]["median"] >= after[f"{prefix}param_bytes"]["median"]
    assert math.isfinite(after["eval_loss"]) and after["eval_loss"] > 0


def test_paged_decode_cpu_smoke_both_kernels_give_the_same_logits():
    """benchmarks/paged_decode_cpu.py --smoke (in this process): the reference and the CPU decode kernel, one
    runner each on the same parameters, agree on every decode step's logits."""
    from benchmarks.paged_decode_cpu import main

    report = main(["--smoke"])
    assert set(report["shapes"]) == {"B4xW1", "B4xW2"}
    for entry in report["shapes"].values():
        assert entry["kernels"] == {"xla": {"paged_attention": ["xla"]},
                                    "xla_cpu_decode": {"paged_attention": ["xla_cpu_decode"]}}
        assert entry["logits_max_abs_diff"] < 1e-4 and entry["xla"]["median_ms"] > 0
