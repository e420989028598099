"""`benchmarks.gpu_profile` and `benchmarks.profile_summary`: summaries of profiler traces read through ProfileData.

Two traces, each checked against numbers computed independently of the summary code:
(a) a GPU-like XSpace written by hand as a text proto (kernel times, stats by value and by
reference, a derived line that must not count, the session's start time), whose expected
busy time, gaps, categories and lead/tail are worked out by hand below; (b) a real CPU
trace from `jax.profiler.trace`, whose summaries are checked against sums over the trace's
events made here with plain loops and NumPy. And `--smoke` end to end.
"""

import collections
import glob
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import profile_summary

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Two kernels on a stream line that starts 100 ns into the session: loop_add_fusion_3 at
# 1100 ns for 3000 ns (hlo_op "fusion.3" by value, hlo_module by reference to stat metadata 3,
# an int64 stat), nvjet_hsh_gemm at 10100 ns for 2000 ns; on a second stream cudnn_fmha at
# 3100 ns for 2000 ns (overlapping the first kernel's end); a derived "XLA Ops" line repeating
# the first (must not count); a host plane; the session start (ns since the epoch).
GPU_SPACE = """
planes {
  id: 2 name: "/device:GPU:0"
  lines { id: 7 name: "Stream #7(Compute)" timestamp_ns: 100
    events { metadata_id: 10 offset_ps: 1000000 duration_ps: 3000000
             stats { metadata_id: 1 str_value: "fusion.3" } stats { metadata_id: 2 ref_value: 3 }
             stats { metadata_id: 4 int64_value: -9 } }
    events { metadata_id: 11 offset_ps: 10000000 duration_ps: 2000000 } }
  lines { id: 9 name: "Stream #9(Compute)" timestamp_ns: 100
    events { metadata_id: 12 offset_ps: 3000000 duration_ps: 2000000 } }
  lines { id: 8 name: "XLA Ops" timestamp_ns: 101 events { metadata_id: 10 duration_ps: 5000 } }
  event_metadata { key: 10 value { id: 10 name: "loop_add_fusion_3" } }
  event_metadata { key: 11 value { id: 11 name: "nvjet_hsh_gemm" } }
  event_metadata { key: 12 value { id: 12 name: "cudnn_fmha" } }
  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } }
  stat_metadata { key: 2 value { id: 2 name: "hlo_module" } }
  stat_metadata { key: 3 value { id: 3 name: "jit_step" } }
  stat_metadata { key: 4 value { id: 4 name: "n" } }
}
planes { id: 1 name: "/host:CPU" lines { id: 1 name: "python" events { metadata_id: 1 duration_ps: 5000 } }
         event_metadata { key: 1 value { id: 1 name: "f" } } }
planes { id: 3 name: "Task Environment" stats { metadata_id: 1 uint64_value: 1000000000000 }
         stat_metadata { key: 1 value { id: 1 name: "profile_start_time" } } }
"""


def test_gpu_trace_events_and_summary_by_hand(tmp_path):
    profile = jax.profiler.ProfileData.from_text_proto(GPU_SPACE)
    name, events, counts = profile_summary.device_events(profile)
    assert name == "/device:GPU:0" and counts == {"Stream #7(Compute)": 2, "XLA Ops": 1, "Stream #9(Compute)": 1}
    a, b, c = events  # The stream lines only: the derived line would double count.
    assert (a["name"], a["start_ns"], a["duration_ns"]) == ("loop_add_fusion_3", 1100, 3000)
    assert a["stats"] == {"hlo_op": "fusion.3", "hlo_module": "jit_step", "n": -9}
    assert (b["name"], b["start_ns"], b["duration_ns"], b["stats"]) == ("nvjet_hsh_gemm", 10100, 2000, {})
    assert (c["name"], c["start_ns"], c["duration_ns"], c["line"]) == ("cudnn_fmha", 3100, 2000, "Stream #9(Compute)")

    summary = profile_summary.summarize_profile(events, 1, {"fusion.3": {"opcode": "fusion", "target": "kLoop"}}, 5)
    t = summary["timeline"]
    # Busy: 1100..5100 (two kernels overlapping) and 10100..12100 = 6000 ns of an 11000 ns span; one 5 us gap.
    assert t["busy_ms_per_step"] == pytest.approx(0.006) and t["span_ms_per_step"] == pytest.approx(0.011)
    assert t["idle_ms_per_step"] == pytest.approx(0.005) and t["kernel_sum_ms_per_step"] == pytest.approx(0.007)
    assert t["busy_segments_per_step"] == 2
    assert [g["count_per_step"] for g in t["gaps"]] == [0, 1, 0, 0, 0]  # 5 us falls in "5-20 us".
    assert t["largest_gaps"] == [{"us": 5.0, "after": "cudnn_fmha", "before": "nvjet_hsh_gemm"}]
    assert summary["categories"]["gemm"]["ms_per_step"] == pytest.approx(0.002)
    assert summary["categories"]["fusion"]["ms_per_step"] == pytest.approx(0.003)
    assert summary["categories"]["attention"]["ms_per_step"] == pytest.approx(0.002)
    assert summary["categories"]["fusion"]["share"] == pytest.approx(3 / 7)
    assert summary["mapped_by"] == {"hlo_op": 1, "none": 2}
    # An hlo_op naming no instruction (a CUDA graph's command buffer): XLA's kernel name gives the instruction.
    by_name = profile_summary.summarize_profile(events, 1, {"loop_add_fusion.3": {"opcode": "fusion", "target": "kLoop"}}, 5)
    assert by_name["mapped_by"] == {"kernel_name": 1, "none": 2}
    assert by_name["top_op_groups"][0]["example"] == "loop_add_fusion.3"

    # The file path: lead and tail against a host window on the epoch clock (session start 1e12 ns).
    path = tmp_path / "t.xplane.pb"
    path.write_bytes(jax.profiler.ProfileData.text_proto_to_serialized_xspace(GPU_SPACE))
    p = profile_summary.profile_file(str(path), 1, {}, 5, window_ns=(10**12 + 100, 10**12 + 13_100))
    assert p["timeline"]["lead_ms"] == pytest.approx((1100 - 100) / 1e6)  # Window start to the first kernel.
    assert p["timeline"]["tail_ms"] == pytest.approx((13_100 - 12_100) / 1e6)  # The last kernel's end to window end.
    assert p["timeline"]["window_ms"] == pytest.approx(0.013)
    assert p["event_stat_keys"] == {"hlo_op": 1, "hlo_module": 1, "n": 1}
    assert p["file_bytes"] == path.stat().st_size and p["plane"] == "/device:GPU:0"


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """(ProfileData, hlo instructions) of two traced calls of a small jitted step on CPU."""
    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=0) + jnp.exp(w).mean())
    x, w = jnp.ones((64, 64)), jnp.full((64, 64), 0.01)
    compiled = f.lower(x, w).compile()
    compiled(x, w).block_until_ready()
    directory = tmp_path_factory.mktemp("trace")
    with jax.profiler.trace(str(directory)):
        for _ in range(2):
            compiled(x, w).block_until_ready()
    path = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0]
    return path, profile_summary.hlo_instructions(compiled.as_text())


def test_cpu_trace_summary_against_sums_by_hand(cpu_trace):
    path, hlo = cpu_trace
    profile = jax.profiler.ProfileData.from_file(path)
    # Independently: every /host:CPU event whose stats name an hlo_op, as (name, start, end, hlo_op).
    ops = [(e.name, e.start_ns, e.end_ns, dict(e.stats)["hlo_op"])
           for p in profile.planes if p.name == "/host:CPU" for line in p.lines for e in line.events
           if "hlo_op" in dict(e.stats)]
    assert len(ops) >= 4 and all(op in hlo for _, _, _, op in ops), "every thunk maps to a compiled instruction"
    s = profile_summary.profile_file(path, 2, hlo, 1000)
    assert s["plane"] == "/host:CPU" and s["events"] == len(ops) and s["mapped_by"] == {"hlo_op": len(ops)}
    durations = np.array([end - start for _, start, end, _ in ops])
    t = s["timeline"]
    assert t["kernel_sum_ms_per_step"] == pytest.approx(durations.sum() / 1e6 / 2)
    # Busy: the union of [start, end) intervals, swept with NumPy (the running max of ends).
    order = np.argsort([start for _, start, _, _ in ops], kind="stable")
    starts, ends = np.array([ops[i][1] for i in order]), np.array([ops[i][2] for i in order])
    reach = np.maximum.accumulate(ends)
    new_segment = np.concatenate([[True], starts[1:] > reach[:-1]])
    seg_ids = np.cumsum(new_segment) - 1
    seg_start = starts[new_segment]
    seg_end = np.array([reach[seg_ids == k].max() for k in range(seg_ids.max() + 1)])
    assert t["busy_ms_per_step"] == pytest.approx((seg_end - seg_start).sum() / 1e6 / 2)
    assert t["span_ms_per_step"] == pytest.approx((ends.max() - starts.min()) / 1e6 / 2)
    assert t["busy_segments_per_step"] == len(seg_start) / 2
    # Per kernel name: counts and total time.
    by_name = collections.defaultdict(float)
    for name, start, end, _ in ops:
        by_name[name] += end - start
    counts = collections.Counter(name for name, *_ in ops)
    for k in s["top_kernels"]:
        assert k["ms_per_step"] == pytest.approx(by_name[k["name"]] / 1e6 / 2), k["name"]
        assert k["count_per_step"] == counts[k["name"]] / 2
    assert s["distinct_kernels"] == len(by_name)
    assert sum(c["count_per_step"] for c in s["categories"].values()) == len(ops) / 2
    assert sum(c["share"] for c in s["categories"].values()) == pytest.approx(1.0)
    assert {"hlo_op", "hlo_module"} <= set(s["event_stat_keys"])


@pytest.mark.slow
def test_smoke_profiles_both_contenders(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_profile", "--smoke", "--top", "5", "--results-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "== axcore" in proc.stdout and "== pure_jax" in proc.stdout
    data = json.loads((tmp_path / "gpu_profile_auto.json").read_text())
    for name, c in data["contenders"].items():
        p = c["profile"]
        assert p["events"] > 10 and p["events_with_hlo_op"] == p["events"], name
        assert all(k["name"] and k["ms_per_step"] > 0 and k["count_per_step"] > 0 for k in p["top_kernels"]), name
        assert len(p["top_kernels"]) == 5 and p["top_hlo_ops"][0]["opcode"] != "?", name
        assert p["top_op_groups"] and p["top_op_groups"][0]["instructions"] >= 1, name
        t = p["timeline"]
        assert 0 < t["busy_ms_per_step"] <= t["span_ms_per_step"] + 1e-9
        assert t["lead_ms"] >= 0 and t["tail_ms"] >= 0 and t["window_ms"] >= t["span_ms_per_step"], t  # One clock.
        assert sum(v["share"] for v in p["categories"].values()) == pytest.approx(1.0)
        assert min(c["wall_ms_per_step"]) > 0
