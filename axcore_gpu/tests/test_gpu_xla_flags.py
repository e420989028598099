"""The GPU plugin's XLA flags and its probe of the machine, which must not start JAX."""

import os
import subprocess
import sys

import pytest

import axcore.experiment.loading
from axcore.experiment import load_experiment

import axcore_gpu.plugin
import axcore_gpu.xla_flags as gpu_flags
from axcore_gpu.xla_flags import gpu_xla_flags, probe_nvidia_instance_type

GiB = 1 << 30


def test_one_gpu_gets_the_latency_hiding_scheduler_only():
    assert gpu_xla_flags("gpu-h100-1") == {"xla_gpu_enable_latency_hiding_scheduler": "true"}


@pytest.mark.parametrize("count", [2, 8, 64])
def test_many_gpus_get_collective_flags_scaled_by_the_device_count(count):
    flags = gpu_xla_flags(f"gpu-a100-{count}")
    assert flags["xla_gpu_all_reduce_combine_threshold_bytes"] == str(GiB)
    assert flags["xla_gpu_all_gather_combine_threshold_bytes"] == str(GiB // count)
    assert flags["xla_gpu_reduce_scatter_combine_threshold_bytes"] == str(GiB // (2 * count))
    assert flags["xla_gpu_enable_command_buffer"] == ""
    assert flags["xla_gpu_enable_latency_hiding_scheduler"] == "true"


@pytest.mark.parametrize("instance_type", ["cpu-8", "tpu-v5p-64", "gpu-h100", "gpu-h100-x"])
def test_other_instance_types_get_no_flags(instance_type):
    assert gpu_xla_flags(instance_type) is None


def _start_backend_with(flags):
    code = "import jax; print(float(jax.numpy.ones(3).sum()))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_every_recommended_flag_is_known_to_this_jaxlib():
    # XLA aborts on an unknown flag in XLA_FLAGS when any backend starts (its GPU flags are
    # parsed on CPU too), so a renamed or removed flag fails here rather than on a cluster.
    flags = gpu_xla_flags("gpu-h100-16")
    out = _start_backend_with(axcore.platform.xla_flags.format_xla_flags(flags))
    assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr[-1000:]
    bogus = _start_backend_with("--xla_gpu_no_such_flag_for_axcore=true")
    assert bogus.returncode != 0 and "Unknown flag" in bogus.stderr


def _driver_tree(root, models):
    for index, model in enumerate(models):
        folder = root / f"0000:{index:02x}:00.0"
        folder.mkdir(parents=True)
        (folder / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t GPU-{index}\n")


def test_probe_reads_the_driver_files_and_honours_cuda_visible_devices(tmp_path):
    _driver_tree(tmp_path, ["NVIDIA H100 80GB HBM3"] * 8)
    assert probe_nvidia_instance_type(tmp_path, {}) == "gpu-h100-8"
    assert probe_nvidia_instance_type(tmp_path, {"CUDA_VISIBLE_DEVICES": "0,3"}) == "gpu-h100-2"
    assert probe_nvidia_instance_type(tmp_path, {"CUDA_VISIBLE_DEVICES": "GPU-1,GPU-2,GPU-5"}) == "gpu-h100-3"
    assert probe_nvidia_instance_type(tmp_path, {"CUDA_VISIBLE_DEVICES": ""}) is None
    assert probe_nvidia_instance_type(tmp_path / "missing", {}) is None
    a100 = tmp_path / "a100"
    _driver_tree(a100, ["NVIDIA A100-SXM4-80GB"])
    assert probe_nvidia_instance_type(a100, {}) == "gpu-a100-1"


def test_probe_needs_jax_with_cuda(monkeypatch):
    monkeypatch.setattr(gpu_flags, "probe_nvidia_instance_type", lambda: "gpu-h100-8")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(gpu_flags, "jax_cuda_installed", lambda: False)
    assert axcore_gpu.plugin.axcore_probe_instance_type() is None
    monkeypatch.setattr(gpu_flags, "jax_cuda_installed", lambda: True)
    assert axcore_gpu.plugin.axcore_probe_instance_type() == "gpu-h100-8"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert axcore_gpu.plugin.axcore_probe_instance_type() is None


def test_probing_starts_no_backend():
    # A host device count set after the probe still takes effect only if no backend started.
    code = (
        "import os, jax, axcore_gpu.plugin\n"
        "axcore_gpu.plugin.axcore_probe_instance_type()\n"
        "jax.config.update('jax_platforms', 'cpu')\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=3'\n"
        "print(len(jax.devices()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(XLA_FLAGS="", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr[-1000:]


def test_gpu_experiment_lists_the_plugins_flags_and_the_users_override():
    objects = {"gpu": axcore_gpu.plugin}
    overrides = ["mesh.instance_type=gpu-h100-8", "xla_flags={xla_gpu_enable_command_buffer: null}"]
    flags = load_experiment("default", overrides, objects=objects).config.xla_flags
    assert flags["xla_gpu_enable_latency_hiding_scheduler"] == "true"
    assert "xla_gpu_enable_command_buffer" not in flags
    assert flags["xla_gpu_all_gather_combine_threshold_bytes"] == str(GiB // 8)


def test_train_on_a_probed_gpu_sets_the_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: "gpu-h100-1")
    load_experiment("default", ["mesh.instance_type=gpu-h100-1"], objects={"gpu": axcore_gpu.plugin}, apply_xla_flags=True)
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=true"


def test_train_on_a_probed_gpu_scales_the_cuda_launch_queues_unless_the_user_did(monkeypatch):
    # Why 4x: the host blocked in cuGraphLaunch on a full launch queue (benchmarks/README.md).
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delenv("CUDA_SCALE_LAUNCH_QUEUES", raising=False)
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: "gpu-h100-1")
    overrides, objects = ["mesh.instance_type=gpu-h100-1"], {"gpu": axcore_gpu.plugin}
    load_experiment("default", overrides, objects=objects, apply_xla_flags=True)
    assert os.environ["CUDA_SCALE_LAUNCH_QUEUES"] == "4x"
    monkeypatch.setenv("CUDA_SCALE_LAUNCH_QUEUES", "2x")
    load_experiment("default", overrides, objects=objects, apply_xla_flags=True)
    assert os.environ["CUDA_SCALE_LAUNCH_QUEUES"] == "2x"
    # Resolving a GPU experiment on another machine sets nothing.
    monkeypatch.delenv("CUDA_SCALE_LAUNCH_QUEUES")
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: "cpu-1")
    load_experiment("default", overrides, objects=objects, apply_xla_flags=True)
    assert "CUDA_SCALE_LAUNCH_QUEUES" not in os.environ
    assert gpu_flags.gpu_runtime_environment("tpu-v5p-8") is None
