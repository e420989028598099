"""The `neuron` plugin: its package, its mesh rules resolved into experiments, the kernel it leaves
to the reference, and a golden file of the default experiment under neuron-trn2-16."""

import os
import pathlib
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from axcore.cli import main
from axcore.errors import ConfigError, NoMatchError
from axcore.experiment import ExperimentConfig, load_experiment
from axcore.experiment.builtins import create_plugin_manager
from axcore.experiment.config_modifiers import build_modifier

import axcore_neuron.plugin
from axcore_neuron import neuron_mesh_rules, remat_transformer_layers, tensor_parallel

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = pathlib.Path(__file__).parent / "golden"
OBJECTS = {"neuron": axcore_neuron.plugin}
BF16 = np.dtype("bfloat16")



def resolve(*overrides, source=None):
    """The experiment resolved with the neuron plugin given as an object (no install needed); a `neuron-*`
    instance type loads it as the platform plugin, as an installed one would be."""
    return load_experiment(source, list(overrides), objects=OBJECTS)


def with_instance_type(instance_type, **model):
    """An ExperimentConfig laid out by hand for `instance_type`, to call a modifier directly."""
    config = ExperimentConfig()
    config.mesh.set(instance_type=instance_type, mesh_shape=(-1, 64), mesh_axis_names=("fsdp", "tensor"), axis_rules={})
    config.model.set(**model)
    return config


def test_distribution_declares_the_neuron_entry_point_and_no_neuron_sdk():
    project = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "axcore-neuron"
    assert project["entry-points"]["axcore"] == {"neuron": "axcore_neuron.plugin"}
    assert "axcore" in project["dependencies"] and any(d.startswith("jax") for d in project["dependencies"])
    assert not any("neuron" in d for d in project["dependencies"])  # Installs without AWS's index.
    readme = (PACKAGE_ROOT / "README.md").read_text()
    assert "No NKI kernel yet" in readme and "pip.repos.neuron.amazonaws.com" in readme


def test_import_probe_and_neuron_resolution_start_no_backend():
    """With an unknown JAX platform any backend initialization would raise; nothing may initialize one."""
    code = (
        "import axcore_neuron.plugin as plugin\n"
        "from axcore_neuron.instance_types import probe_neuron_instance_type\n"
        "assert probe_neuron_instance_type() is None and plugin.axcore_probe_instance_type() is None\n"
        "from axcore.experiment.loading import load_experiment\n"
        "exp = load_experiment(None, ['mesh.instance_type=neuron-trn2-16'], objects={'neuron': plugin})\n"
        "print(exp.config.mesh.rule, exp.config.model.compute_dtype, *exp.config.mesh.mesh_shape)\n"
        "import jax\n"
        "try:\n"
        "    jax.devices()\n"
        "except RuntimeError:\n"
        "    print('no backend')\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="axcore_no_such_platform", PYTHONPATH=str(PACKAGE_ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The last line proves the probe and resolution above would have failed had anything touched a backend.
    assert proc.stdout.split() == ["neuron-trn2", "bfloat16", "-1", "4", "no", "backend"]


def test_rules_match_the_trainium_kinds_in_both_spellings():
    rules = {rule.name: rule for rule in neuron_mesh_rules()}
    assert sorted(rules) == ["neuron-trn1", "neuron-trn2", "neuron-trn2-lnc1"]
    assert all(rules["neuron-trn1"].matches(t) for t in ("neuron-trn1-32", "neuron-trn1-2", "neuron-v2-64"))
    assert all(rules["neuron-trn2"].matches(t) for t in ("neuron-trn2-16", "neuron-trn2-64", "neuron-v3d-512"))
    assert rules["neuron-trn2-lnc1"].matches("neuron-v3-128") and not rules["neuron-trn2"].matches("neuron-v3-128")
    for rule in rules.values():
        assert not any(rule.matches(t) for t in ("neuron-trn2", "neuron-inf2-2", "gpu-h100-8", "cpu-8"))
        assert rule.mesh_axis_names == ("fsdp", "tensor") and rule.axis_rules["kv_heads"] == "tensor"


@pytest.mark.parametrize(
    "instance_type, rule, degree",
    [("neuron-trn2-16", "neuron-trn2", 4), ("neuron-trn1-32", "neuron-trn1", 4), ("neuron-trn1-2", "neuron-trn1", 2),
     ("neuron-v3-128", "neuron-trn2-lnc1", 4)],
)
def test_default_model_gets_tensor_parallelism_bfloat16_and_remat(instance_type, rule, degree):
    exp = resolve(f"mesh.instance_type={instance_type}")
    config = exp.config
    assert config.mesh.rule == rule and exp.mesh_rule == f"{rule} (plugin neuron)"
    # The default model has 4 heads: the tensor degree stops there (or at N).
    assert tuple(config.mesh.mesh_shape) == (-1, degree) and tuple(config.mesh.mesh_axis_names) == ("fsdp", "tensor")
    assert config.mesh.axis_rules["batch"] == "fsdp" and config.mesh.axis_rules["heads"] == "tensor"
    assert config.model.compute_dtype == BF16 and config.model.param_dtype is None  # float32 master weights.
    assert config.model.decoder.layer.remat_policy == "nothing_saveable"
    assert exp.mesh_modifiers == [
        "neuron_tensor_parallel()", "compute_dtype(compute='bfloat16', override=False)", "neuron_remat(policy='full')"
    ]


def test_the_tensor_degree_follows_the_model_and_stays_within_a_node():
    # Llama-3-70B: 64 heads but 8 key/value heads -> 8, however many nodes.
    assert tuple(resolve("mesh.instance_type=neuron-trn2-512", source="llama3_70b").config.mesh.mesh_shape) == (-1, 8)
    # Every tensor dimension divisible by 32: the whole trn1 node, as NeuronX Distributed runs it...
    wide = ["model.decoder.layer.self_attention.num_heads=32", "model.dim=1024", "model.vocab_size=512"]
    assert tuple(resolve("mesh.instance_type=neuron-trn1-64", *wide).config.mesh.mesh_shape) == (-1, 32)
    # ...but never more than N, nor across nodes (24 cores: 8 divides both 24 and a node's 32).
    assert tuple(resolve("mesh.instance_type=neuron-trn1-24", *wide).config.mesh.mesh_shape) == (-1, 8)


def test_explicit_choices_of_the_experiment_are_kept():
    config = resolve(
        "mesh.instance_type=neuron-trn2-64", "model.compute_dtype=float32", "mesh.mesh_shape=[-1, 2]"
    ).config
    assert config.model.compute_dtype == np.dtype("float32") and tuple(config.mesh.mesh_shape) == (-1, 2)
    # A remat policy set anywhere in the model (here by the remat plugin on the scanned stack) is left alone.
    scan = load_experiment("scan", ["plugins=[remat]", "remat.policy=dots_saveable", "mesh.instance_type=neuron-trn2-64"], objects=OBJECTS).config
    assert scan.model.decoder.remat_policy == "dots_saveable" and scan.model.decoder.layer.remat_policy is None
    # Without it, the scanned unit layer is rematerialized.
    assert resolve("mesh.instance_type=neuron-trn2-64", source="scan").config.model.decoder.layer.remat_policy == "nothing_saveable"


def test_an_exact_degree_fails_at_resolution_naming_the_parameter():
    config = with_instance_type("neuron-trn2-64")
    assert tuple(tensor_parallel(4)(config).mesh.mesh_shape) == (-1, 4)
    with pytest.raises(ConfigError, match=r"model\.decoder\.layer0\.self_attention\.\w+ dim \d \('(kv_)?heads'\) of size 4"):
        tensor_parallel(8)(config)
    with pytest.raises(ConfigError, match="one node's 64 NeuronCores"):
        tensor_parallel(128)(with_instance_type("neuron-trn2-256"))
    with pytest.raises(ConfigError, match="not a Trainium one"):
        tensor_parallel()(with_instance_type("gpu-h100-8"))
    with pytest.raises(ConfigError, match="positive integer"):
        tensor_parallel(0)


def test_modifiers_are_registered_for_an_experiments_own_rules(registries):
    manager = create_plugin_manager(["neuron"], objects=OBJECTS)
    modifier = build_modifier({"type": "neuron_tensor_parallel", "degree": 2}, manager.registries, "mesh_rules[0].modifiers[0]")
    assert str(modifier) == "neuron_tensor_parallel(degree=2)"
    assert "neuron_tensor_parallel" not in registries.config_modifiers  # Only with the plugin.
    config = with_instance_type("neuron-trn1-32")
    new = remat_transformer_layers("save_matmul_outputs")(config)
    assert new.model.decoder.layer.remat_policy == "dots_with_no_batch_dims_saveable" and config.model.decoder.layer.remat_policy is None
    assert remat_transformer_layers("none")(config) is config


def test_remat_needs_transformer_layers():
    config = with_instance_type("neuron-trn1-32")
    config.model.decoder.num_layers = 0
    config.model.num_layers = 0
    with pytest.raises(NoMatchError, match="transformer layer"):
        remat_transformer_layers()(config)


def test_the_kernel_registry_keeps_the_xla_reference_for_attention():
    # No NKI kernel is registered (README): attention resolves to the reference under a Trainium layout
    # (the built-in context-parallel kernels decline: no context axis).
    exp = load_experiment(None, ["plugins=[neuron]", "mesh.instance_type=neuron-trn2-16"], objects=OBJECTS)
    assert [k.name for k in exp.registries.kernels.candidates("attention")] == ["context_all_gather", "context_ring", "xla"]
    assert list(exp.kernel_choices()["attention"]) == ["xla"]


def test_resolved_neuron_trn2_16_config_matches_golden_file(request, capsys):
    assert main(["config", "default", "--mesh-selector", "neuron-trn2-16"], objects=OBJECTS) == 0
    output = capsys.readouterr().out
    # The golden holds the config; the kernel lines depend on the machine (checked below).
    text = "".join(line for line in output.splitlines(True) if not line.startswith("# kernel"))
    golden = GOLDEN / "default_neuron_trn2_16.txt"
    if request.config.getoption("--update-goldens"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run pytest --update-goldens"
    assert text == golden.read_text(), "resolved neuron-trn2-16 config changed; review and run pytest --update-goldens"
    lines = dict(line.split(": ", 1) for line in output.splitlines() if ": " in line)
    assert "# xla_flags go to NEURON_CC_FLAGS" in output.splitlines()
    assert lines["mesh.rule"] == "neuron-trn2" and lines["mesh.instance_type"] == "neuron-trn2-16"
    assert lines["model.compute_dtype"] == "bfloat16" and lines["model.param_dtype"] == "null"
    assert lines["plugins"] == "[]"  # Loaded for the selected platform, not listed.
    assert lines["# kernel attention"] == "xla (4 sites)"
