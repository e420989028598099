"""`axcore compile`: the report on the Llama-shaped experiments, the scan FLOP correction, --device-memory."""

import pathlib
import subprocess
import sys

import pytest

from axcore.cli import main
from axcore.cli.compile import format_bytes, parse_bytes
from axcore.config.traversal import is_config_of
from axcore.errors import AxcoreError
from axcore.experiment import load_experiment
from axcore.layers.transformer import RepeatedTransformer, StackedTransformer
from axcore.testing import host_devices_env
from axcore.trainer.compile_analysis import compile_step, parameter_counts, scan_corrected_flops, with_layers

# A small decoder (default.yaml's stack unrolled, scan.yaml's scanned): compiles in seconds.
TINY = [
    "model.num_layers=4", "model.dim=32", "model.decoder.layer.self_attention.num_heads=2",
    "model.decoder.layer.feed_forward.hidden_dim=64", "input.seq_len=16",
]


def _report(stdout: str) -> dict[str, str]:
    """`key: value  (explanation)` lines -> {key: value} (the value is the first word)."""
    return {k: v.split()[0] for k, v in (line.split(": ", 1) for line in stdout.splitlines() if ": " in line)}


def _compile_subprocess(*args, devices=8):
    env = host_devices_env(devices)
    return subprocess.run(
        [sys.executable, "-m", "axcore.cli", "compile", *args], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.slow
def test_llama2_7b_report_on_8_cpu_devices():
    cfg = load_experiment("llama2_7b", ["mesh.instance_type=cpu-8"]).config
    attention = cfg.model.decoder.layer.self_attention
    L, d, V = cfg.model.num_layers, cfg.model.dim, cfg.model.vocab_size
    H, h, F = attention.num_heads, attention.head_dim, cfg.model.decoder.layer.feed_forward.hidden_dim
    B, T = cfg.input.batch_size, cfg.input.seq_len
    assert (L, d, V, H, h, F, T) == (32, 4096, 32000, 32, 128, 11008, 4096) and attention.num_kv_heads is None
    assert cfg.model.lm_head is not None  # Untied head.
    # Independently of the report's code: q, k, v, o; gate, up, down; two RMSNorm scales per layer;
    # embedding table, final norm, head.
    n_params = L * (4 * d * H * h + 3 * d * F + 2 * d) + V * d + d + d * V
    tokens = B * T
    expected_flops = 6 * n_params * tokens + 12 * L * H * h * T * tokens  # Dense + full-square attention.

    result = _compile_subprocess("llama2_7b")
    assert result.returncode == 0, result.stderr[-3000:]
    report = _report(result.stdout)
    assert report["devices"] == "8" and report["tokens_per_step"] == str(tokens)
    assert int(report["parameters"]) == n_params
    assert abs(int(report["parameters"]) / 6.74e9 - 1) < 0.01
    assert "(6.74B)" in result.stdout
    flops = int(report["flops_per_step"])
    assert abs(flops / expected_flops - 1) < 0.05, (flops, expected_flops)
    assert int(report["flops_per_device"]) * 8 == flops
    # XLA alone counts the 32 scanned layers once.
    assert int(report["xla_flops_per_device"]) * 8 < 0.2 * flops
    assert abs(int(report["model_flops_per_step"]) / expected_flops - 1) < 0.02
    # Data parallel only: every device holds the float32 parameters and both Adam moments.
    argument = int(report["argument_bytes_per_device"])
    assert argument >= 12 * n_params
    peak = int(report["peak_bytes_per_device"])
    parts = [int(report[f"{k}_bytes_per_device"]) for k in ("argument", "output", "temp", "alias")]
    assert peak == parts[0] + parts[1] + parts[2] - parts[3] > argument


def test_llama3_70b_resolves_and_counts_70_6b_parameters(capsys):
    assert main(["config", "llama3_70b", "--set", "mesh.instance_type=cpu-1"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if not line.startswith("#"))
    assert lines["model.decoder.layer.self_attention.num_kv_heads"] == "8"
    assert lines["model.decoder.layer.self_attention.position_embedding.theta"] == "500000.0"
    counts = parameter_counts(load_experiment("llama3_70b", ["mesh.instance_type=cpu-1"]))
    assert abs(counts["total"] / 70.6e9 - 1) < 0.01
    L, d, V, H, K, h, F = 80, 8192, 128256, 64, 8, 128, 28672
    assert counts["total"] == L * (2 * d * H * h + 2 * d * K * h + 3 * d * F + 2 * d) + 2 * V * d + d
    assert counts["embedding"] == V * d and counts["non_trainable"] == 0


def test_the_131k_long_context_experiment_is_a_1b_llama_with_its_three_rules():
    """benchmarks/README.md's 131k report compiles this file; its shape and rules, without compiling."""
    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "experiments" / "llama3_1b_128k.yaml"
    exp = load_experiment(str(path), ["mesh.instance_type=cpu-8"])
    cfg = exp.config
    assert (cfg.input.batch_size, cfg.input.seq_len, cfg.model.loss_chunk_len) == (1, 131072, 4096)
    assert exp.mesh_rule.startswith("long-context") and tuple(cfg.mesh.mesh_axis_names) == ("data", "context")
    assert cfg.model.decoder.remat_policy == "offload_dot_with_no_batch_dims(device,pinned_host)"
    L, d, V, H, K, h, F = 16, 2048, 128256, 32, 8, 64, 8192  # Llama 3.2 1B; tied head.
    assert parameter_counts(exp)["total"] == L * (2 * d * H * h + 2 * d * K * h + 3 * d * F + 2 * d) + V * d + d
    plain = load_experiment(str(path), ["mesh.instance_type=cpu-8", "mesh.rule=no-context"]).config
    assert plain.mesh.axis_rules["seq"] is None and plain.model.decoder.remat_policy is None
    gspmd = load_experiment(str(path), ["mesh.instance_type=cpu-8", "mesh.rule=sequence-gspmd"]).config
    assert gspmd.mesh.axis_rules["seq"] == "sequence" and tuple(gspmd.mesh.mesh_axis_names) == ("data", "sequence")


@pytest.mark.slow
def test_scan_correction_matches_the_unrolled_stack():
    scanned = load_experiment("scan", [*TINY, "mesh.instance_type=cpu-1"])
    unrolled = load_experiment("default", [*TINY, "mesh.instance_type=cpu-1"])
    assert is_config_of(scanned.config.model.decoder, RepeatedTransformer)
    assert is_config_of(unrolled.config.model.decoder, StackedTransformer)
    corrected = scan_corrected_flops(scanned)
    reference = compile_step(unrolled)
    assert reference.while_loops == 0
    assert abs(corrected["flops"] / reference.flops - 1) < 0.01, (corrected, reference.flops)
    assert corrected["fixed"] > 0 and corrected["per_layer"] > 0 and corrected["inner_while_loops"] == 0


def test_scan_correction_compiles_a_chunked_loss_in_one_chunk():
    chunked = load_experiment("scan", [*TINY, "mesh.instance_type=cpu-1", "model.loss_chunk_len=4"])
    one = with_layers(chunked, 1)
    assert one.config.model.loss_chunk_len == 16 and chunked.config.model.loss_chunk_len == 4
    # No loop left, neither the layers' nor the loss chunks': XLA's FLOP count holds every chunk of the head.
    assert compile_step(one).while_loops == 0


@pytest.mark.slow
def test_device_memory_too_small_exits_2_after_the_report(capsys):
    assert main(["compile", "default", *[a for o in TINY for a in ("--set", o)], "--device-memory", "1MB"]) == 2
    out, err = capsys.readouterr()
    assert int(_report(out)["peak_bytes_per_device"]) > 10**6  # The report is printed first.
    assert err.count("\n") == 1
    assert err.startswith("axcore: error: estimated peak ") and "per device exceeds --device-memory 1.00 MB" in err


@pytest.mark.parametrize("value", ["80XB", "lots", "-5GB", "0", "", "1e999"])
def test_malformed_device_memory_exits_2_naming_the_flag(value, capsys):
    assert main(["compile", "default", f"--device-memory={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device-memory" in err and "80GiB" in err


def test_parse_bytes_units():
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("80gib") == 80 * 2**30
    assert parse_bytes("96e9") == 96 * 10**9 and parse_bytes("1024") == 1024 and parse_bytes("1.5 TiB") == 3 * 2**39
    with pytest.raises(AxcoreError, match="--device-memory"):
        parse_bytes("80 G B")
    assert format_bytes(80 * 10**9) == "80.00 GB = 74.51 GiB"
