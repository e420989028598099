"""`benchmarks.gpu_profile`: its protobuf wire decoder against hand-encoded bytes and JAX's own reader, and `--smoke`.

The encoder below is written from the protobuf encoding spec (key = field << 3 | wire
type; varints little-endian base 128; negative int64 as 10-byte two's complement),
independently of the decoder, so a wrong field number or wire type in either fails.
"""

import glob
import json
import pathlib
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import gpu_profile, xplane

ROOT = pathlib.Path(__file__).resolve().parent.parent


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 fields: two's complement.
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def int_field(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def len_field(number: int, payload: bytes | str) -> bytes:
    payload = payload.encode() if isinstance(payload, str) else payload
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def double_field(number: int, value: float) -> bytes:
    return varint(number << 3 | 1) + struct.pack("<d", value)


def fixed32_field(number: int, value: int) -> bytes:
    return varint(number << 3 | 5) + struct.pack("<I", value)


def test_wire_fields_decode_every_wire_type():
    data = int_field(1, 150) + int_field(2, -5) + double_field(3, 2.5) + fixed32_field(4, 7) + len_field(5, "hé")
    decoded = xplane.fields(data)
    assert [(n, w) for n, w, _ in decoded] == [(1, 0), (2, 0), (3, 1), (4, 5), (5, 2)]
    assert decoded[0][2] == 150 and varint(150) == b"\x96\x01"  # The spec's own example.
    assert xplane.signed(decoded[1][2]) == -5
    assert struct.unpack("<d", struct.pack("<Q", decoded[2][2]))[0] == 2.5
    assert decoded[3][2] == 7 and bytes(decoded[4][2]).decode() == "hé"
    with pytest.raises((ValueError, IndexError)):
        xplane.fields(len_field(1, "abc")[:-1])  # Truncated.


def _space() -> bytes:
    """An XSpace: a GPU plane with two kernels on a stream line, a derived line, stats by value and by ref."""
    stat_meta = lambda i, name: len_field(5, int_field(1, i) + len_field(2, int_field(1, i) + len_field(2, name)))  # noqa: E731
    event_meta = lambda i, name: len_field(4, int_field(1, i) + len_field(2, int_field(1, i) + len_field(2, name)))  # noqa: E731
    stat_str = len_field(4, int_field(1, 1) + len_field(5, "fusion.3"))  # XEvent.stats: hlo_op = "fusion.3"
    stat_ref = len_field(4, int_field(1, 2) + int_field(7, 3))  # hlo_module -> stat metadata 3's name
    stat_int = len_field(4, int_field(1, 4) + int_field(4, -9))
    kernel_a = int_field(1, 10) + int_field(2, 1_000_000) + int_field(3, 3_000_000) + stat_str + stat_ref + stat_int
    kernel_b = int_field(1, 11) + int_field(2, 9_000_000) + int_field(3, 2_000_000) + int_field(99, 1)  # unknown field
    stream = int_field(1, 7) + len_field(2, "Stream #7(Compute)") + int_field(3, 100) + len_field(4, kernel_a) + len_field(
        4, kernel_b) + int_field(9, 123)
    derived = int_field(1, 8) + len_field(2, "XLA Ops") + int_field(3, 101) + len_field(4, int_field(1, 10) + int_field(3, 5))
    plane = (int_field(1, 2) + len_field(2, "/device:GPU:0") + len_field(3, stream) + len_field(3, derived)
             + event_meta(10, "loop_add_fusion_3") + event_meta(11, "nvjet_hsh_gemm")
             + stat_meta(1, "hlo_op") + stat_meta(2, "hlo_module") + stat_meta(3, "jit_step") + stat_meta(4, "n"))
    host = len_field(2, "/host:CPU") + len_field(3, len_field(2, "python") + len_field(4, int_field(1, 1) + int_field(3, 5)))
    return len_field(1, host) + len_field(1, plane) + len_field(2, "an error string")


def test_xspace_decoder_on_hand_encoded_planes():
    planes = xplane.parse_xspace(_space())
    assert [p["name"] for p in planes] == ["/host:CPU", "/device:GPU:0"]
    gpu = planes[1]
    stream, derived = gpu["lines"]
    assert (stream["name"], stream["timestamp_ns"], derived["name"]) == ("Stream #7(Compute)", 100, "XLA Ops")
    a, b = stream["events"]
    assert (a["name"], a["start_ps"], a["duration_ps"]) == ("loop_add_fusion_3", 1_000_000, 3_000_000)
    assert a["stats"] == {"hlo_op": "fusion.3", "hlo_module": "jit_step", "n": -9}
    assert (b["name"], b["start_ps"], b["duration_ps"]) == ("nvjet_hsh_gemm", 9_000_000, 2_000_000)
    assert derived["events"][0]["start_ps"] == 1000  # Its line starts 1 ns later on the plane's one clock.
    only_gpu = xplane.parse_xspace(_space(), keep=lambda name: name.startswith("/device:GPU"))
    assert [p["name"] for p in only_gpu] == ["/device:GPU:0"]

    # The device timeline takes the stream line only (the derived line would double count).
    name, events, _ = gpu_profile.device_events(planes)
    assert name == "/device:GPU:0" and len(events) == 2
    summary = gpu_profile.summarize_profile(events, 1, {"fusion.3": {"opcode": "fusion", "target": "kLoop"}}, 5)
    t = summary["timeline"]
    assert t["busy_ms_per_step"] == pytest.approx(0.005) and t["idle_ms_per_step"] == pytest.approx(0.005)
    assert summary["categories"]["gemm"]["ms_per_step"] == pytest.approx(0.002)
    assert summary["categories"]["fusion"]["ms_per_step"] == pytest.approx(0.003)
    assert summary["mapped_by"] == {"hlo_op": 1, "none": 1}
    # An hlo_op naming no instruction (a CUDA graph's command buffer): XLA's kernel name gives the instruction.
    by_name = gpu_profile.summarize_profile(events, 1, {"loop_add_fusion.3": {"opcode": "fusion", "target": "kLoop"}}, 5)
    assert by_name["mapped_by"] == {"kernel_name": 1, "none": 1}
    assert by_name["top_op_groups"][0]["example"] == "loop_add_fusion.3"


def test_decoder_agrees_with_jax_profile_data(tmp_path):
    """Every event of a real CPU trace: the same names and durations as jax.profiler.ProfileData reads."""
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        f(x).block_until_ready()
    path = glob.glob(f"{tmp_path}/**/*.xplane.pb", recursive=True)[0]
    ours = {
        (p["name"], line["name"]): sorted((e["name"], e["duration_ps"] // 1000) for e in line["events"])
        for p in xplane.parse_xspace(pathlib.Path(path).read_bytes()) for line in p["lines"]
    }
    theirs = {
        (p.name, line.name): sorted((e.name, int(e.duration_ns)) for e in line.events)
        for p in jax.profiler.ProfileData.from_file(path).planes for line in p.lines
    }
    assert ours == theirs
    _, events, _ = gpu_profile.device_events(xplane.parse_xspace(pathlib.Path(path).read_bytes()))
    assert events and all(e["name"] and "hlo_op" in e["stats"] for e in events)


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
