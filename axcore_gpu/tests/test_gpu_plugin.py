"""The `gpu` plugin: its package, its mesh rules resolved into experiments, and a golden file."""

import os
import pathlib
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from axcore.cli import main
from axcore.errors import ConfigError
from axcore.experiment import ExperimentConfig, load_experiment

import axcore_gpu.plugin
from axcore_gpu import bfloat16_compute, gpu_mesh_rules

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = pathlib.Path(__file__).parent / "golden"
OBJECTS = {"gpu": axcore_gpu.plugin}
BF16 = np.dtype("bfloat16")


def resolve(*overrides, source=None):
    """The experiment resolved with the gpu plugin given as an object (no install needed); a `gpu-*`
    instance type loads it as the platform plugin, as an installed one would be."""
    return load_experiment(source, list(overrides), objects=OBJECTS).config


def test_distribution_declares_the_gpu_entry_point_and_cuda_as_extras():
    project = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "axcore-gpu"
    assert project["entry-points"]["axcore"] == {"gpu": "axcore_gpu.plugin", "fp8": "axcore_gpu.fp8_plugin"}
    assert "axcore" in project["dependencies"]
    assert not any("cuda" in d for d in project["dependencies"])  # Installs without CUDA.
    assert project["optional-dependencies"]["cuda12"] == ["jax[cuda12]>=0.7"]
    assert (PACKAGE_ROOT / "README.md").is_file()


def test_import_and_gpu_resolution_probe_no_device():
    """With an unknown JAX platform, any backend initialization would raise; nothing may initialize one."""
    code = (
        "import axcore_gpu.plugin\n"
        "from axcore.experiment.loading import load_experiment\n"
        "exp = load_experiment(None, ['mesh.instance_type=gpu-h100-8'], objects={'gpu': axcore_gpu.plugin})\n"
        "print(exp.config.mesh.rule, exp.config.model.compute_dtype)\n"
        "import jax\n"
        "try:\n"
        "    jax.devices()\n"
        "except RuntimeError:\n"
        "    print('no backend')\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="axcore_no_such_platform", PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The last line proves the probe above would have failed had anything touched a backend.
    assert proc.stdout.split() == ["gpu-h100", "bfloat16", "no", "backend"]


def test_plugin_registers_one_rule_per_gpu_kind():
    rules = {rule.name: rule for rule in gpu_mesh_rules()}
    assert sorted(rules) == ["gpu-a100", "gpu-b200", "gpu-h100", "gpu-h200"]
    assert rules["gpu-h100"].matches("gpu-h100-8") and rules["gpu-h100"].matches("gpu-h100-256")
    assert not rules["gpu-h100"].matches("gpu-h100") and not rules["gpu-h100"].matches("gpu-h200-8")


@pytest.mark.parametrize(
    "instance_type, rule",
    [("gpu-h100-8", "gpu-h100"), ("gpu-h200-1", "gpu-h200"), ("gpu-a100-16", "gpu-a100"), ("gpu-b200-64", "gpu-b200")],
)
def test_gpu_instance_types_get_data_parallel_bfloat16(instance_type, rule):
    config = resolve(f"mesh.instance_type={instance_type}")
    assert config.mesh.rule == rule
    assert tuple(config.mesh.mesh_shape) == (-1,) and tuple(config.mesh.mesh_axis_names) == ("data",)
    assert config.mesh.axis_rules == {"batch": "data"}
    assert config.model.compute_dtype == BF16
    assert config.model.param_dtype is None  # float32 master weights (the root default).


def test_other_instance_types_fall_back_to_the_default_rule():
    for instance_type in ("gpu-t4-1", "cpu-8"):
        config = resolve(f"mesh.instance_type={instance_type}")
        assert config.mesh.rule == "default" and config.model.compute_dtype is None


def test_a_compute_dtype_set_by_the_experiment_is_kept():
    config = resolve("mesh.instance_type=gpu-h100-8", "model.compute_dtype=float32")
    assert config.model.compute_dtype == np.dtype("float32")


def test_remat_is_left_as_configured():
    config = load_experiment("scan", ["plugins=[remat]", "mesh.instance_type=gpu-h100-8"], objects=OBJECTS).config
    assert config.model.decoder.remat_policy == "nothing_saveable" and config.model.compute_dtype == BF16
    default = load_experiment("scan", ["mesh.instance_type=gpu-h100-8"], objects=OBJECTS).config
    assert default.model.decoder.remat_policy is None


def test_modifier_returns_a_new_config_and_leaves_its_input_alone():
    config = ExperimentConfig()
    new = bfloat16_compute(config)
    assert new is not config and new.model.compute_dtype == BF16 and config.model.compute_dtype is None
    assert bfloat16_compute(new) is new  # Already set: kept as is.


def test_modifier_refuses_a_model_without_a_compute_dtype():
    config = ExperimentConfig()
    config.model = ExperimentConfig().tokenizer  # Any config without compute_dtype.
    with pytest.raises(ConfigError, match="compute_dtype"):
        bfloat16_compute(config)


def test_resolved_gpu_h100_8_config_matches_golden_file(request, capsys):
    assert main(["config", "default", "--mesh-selector", "gpu-h100-8"], objects=OBJECTS) == 0
    output = capsys.readouterr().out
    # The golden holds the config; the kernel lines depend on the machine (checked below).
    text = "".join(line for line in output.splitlines(True) if not line.startswith("# kernel"))
    golden = GOLDEN / "default_gpu_h100_8.txt"
    if request.config.getoption("--update-goldens"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run pytest --update-goldens"
    assert text == golden.read_text(), "resolved gpu-h100-8 config changed; review and run pytest --update-goldens"
    # Semantic checks beside the golden text.
    lines = dict(line.split(": ", 1) for line in output.splitlines())
    assert lines["mesh.rule"] == "gpu-h100" and lines["mesh.instance_type"] == "gpu-h100-8"
    assert lines["model.compute_dtype"] == "bfloat16" and lines["model.param_dtype"] == "null"
    assert lines["plugins"] == "[]"  # Loaded for the selected platform, not listed.
    # Kernels are chosen for the selected target (an H100: compute capability 9.0), also on a CPU host.
    # Packed batches (segment ids): cuDNN declines them, Pallas takes them (see test_kernel_decisions_...).
    assert lines["# kernel attention"] == "pallas (4 sites)"
    assert lines["# kernel dot"] == "xla (25 sites)"  # xla_cpu declines: the platform is gpu.


def test_plugin_registers_cudnn_then_pallas_then_the_reference():
    from axcore.experiment.builtins import create_plugin_manager

    kernels = create_plugin_manager(["gpu"], objects={"gpu": axcore_gpu.plugin}).registries.kernels
    order = [kernel.name for kernel in kernels.candidates("attention")]
    assert order == ["cudnn", "pallas", "context_all_gather", "context_ring", "xla"]  # The context kernels are built in.


def test_kernel_decisions_for_a_gpu_selector_name_the_declines():
    overrides = ["mesh.instance_type=gpu-h100-8", "model.compute_dtype=float32"]
    decisions = load_experiment("default", overrides, objects=OBJECTS).kernel_decisions()
    attention = {(d.kernel, d.declined) for d in decisions if d.op == "attention"}
    assert attention == {("pallas", (("cudnn", "dtype float32: cuDNN flash attention takes bfloat16 or float16"),))}
    bf16 = load_experiment("default", ["mesh.instance_type=gpu-a100-8"], objects=OBJECTS).kernel_decisions()
    # Batches pack documents: cuDNN declines segment ids (jax.nn.dot_product_attention takes none), Pallas takes them.
    [(kernel, declined)] = {(d.kernel, d.declined) for d in bf16 if d.op == "attention"}
    assert kernel == "pallas" and [k for k, _ in declined] == ["cudnn"] and "segment ids" in declined[0][1]
