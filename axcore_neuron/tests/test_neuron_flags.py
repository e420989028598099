"""The neuron plugin's compiler flags (NEURON_CC_FLAGS) and its probe of the machine, which must not start JAX."""

import os

import pytest

import axcore.experiment.loading
from axcore.experiment import load_experiment

import axcore_neuron.instance_types as instance_types
import axcore_neuron.plugin
from axcore_neuron import (
    KINDS,
    flags_environment,
    format_neuron_cc_flags,
    neuron_cc_flags,
    parse_instance_type,
    probe_neuron_instance_type,
)

OBJECTS = {"neuron": axcore_neuron.plugin}
COMMON = {"model-type": "transformer", "auto-cast": "none", "enable-mixed-precision-accumulation": "", "optlevel": "1"}



def test_trn1_flags_target_trn1_for_distributed_llm_training():
    assert neuron_cc_flags("neuron-trn1-32") == {"target": "trn1", "distribution-strategy": "llm-training", **COMMON}
    assert neuron_cc_flags("neuron-v2-64") == neuron_cc_flags("neuron-trn1-2")


@pytest.mark.parametrize("instance_type, lnc", [("neuron-trn2-16", "2"), ("neuron-v3d-64", "2"), ("neuron-v3-128", "1")])
def test_trn2_flags_name_the_logical_core_configuration(instance_type, lnc):
    assert neuron_cc_flags(instance_type) == {"target": "trn2", "logical-nc-config": lnc, **COMMON}


@pytest.mark.parametrize("instance_type", ["cpu-8", "gpu-h100-8", "tpu-v5p-64", "neuron-trn2", "neuron-inf2-2", "neuron-trn2-x", "neuron-trn2-0"])
def test_other_instance_types_get_no_flags(instance_type):
    assert neuron_cc_flags(instance_type) is None and parse_instance_type(instance_type) is None


def test_flags_go_to_neuron_cc_flags_with_switches_written_bare():
    assert flags_environment("neuron-trn2-64") == "NEURON_CC_FLAGS" and flags_environment("neuron-inf2-2") == "NEURON_CC_FLAGS"
    assert flags_environment("gpu-h100-8") is None and flags_environment("cpu-1") is None
    text = format_neuron_cc_flags(neuron_cc_flags("neuron-trn2-64"))
    assert text == (
        "--target=trn2 --model-type=transformer --logical-nc-config=2 --auto-cast=none "
        "--enable-mixed-precision-accumulation --optlevel=1"
    )


def test_kinds_know_their_node_sizes():
    assert {name: (k.target, k.cores_per_node, k.lnc) for name, k in KINDS.items()} == {
        "trn1": ("trn1", 32, None), "v2": ("trn1", 32, None),
        "trn2": ("trn2", 64, 2), "v3d": ("trn2", 64, 2), "v3": ("trn2", 128, 1),
    }


def test_experiment_lists_the_plugins_flags_and_the_users_override():
    overrides = ["mesh.instance_type=neuron-trn1-32", "xla_flags={optlevel: 2, auto-cast: null}"]
    flags = load_experiment("default", overrides, objects=OBJECTS).config.xla_flags
    assert flags["optlevel"] == "2" and "auto-cast" not in flags
    assert flags["target"] == "trn1" and flags["enable-mixed-precision-accumulation"] == ""


def _fake_host(tmp_path, chips, product="trn2.48xlarge\n"):
    dev = tmp_path / "dev"
    dev.mkdir(parents=True)
    for i in range(chips):
        (dev / f"neuron{i}").touch()
    (dev / "neuron_extra").touch()  # Not a device node: ignored.
    (dev / "null").touch()
    dmi = tmp_path / "product_name"
    if product is not None:
        dmi.write_text(product)
    return dev, dmi


def test_probe_counts_logical_cores_from_device_nodes_and_the_ec2_instance_type(tmp_path):
    dev, dmi = _fake_host(tmp_path, 16)
    assert probe_neuron_instance_type(dev, dmi, {}) == "neuron-trn2-64"
    assert probe_neuron_instance_type(dev, dmi, {"NEURON_LOGICAL_NC_CONFIG": "1"}) == "neuron-v3-128"
    assert probe_neuron_instance_type(dev, dmi, {"NEURON_RT_VISIBLE_CORES": "0-15"}) == "neuron-trn2-16"
    assert probe_neuron_instance_type(dev, dmi, {"NEURON_RT_VISIBLE_CORES": "0,1,4-5"}) == "neuron-trn2-4"
    assert probe_neuron_instance_type(dev, dmi, {"NEURON_RT_NUM_CORES": "8"}) == "neuron-trn2-8"
    assert probe_neuron_instance_type(dev, dmi, {"AXCORE_NEURON_INSTANCE_TYPE": "trn1n.32xlarge"}) == "neuron-trn1-32"
    dmi.write_text("trn1.2xlarge\n")
    assert probe_neuron_instance_type(dev, dmi, {}) == "neuron-trn1-32"  # Counted from the device nodes.
    with pytest.raises(ValueError, match="NEURON_RT_VISIBLE_CORES"):
        probe_neuron_instance_type(dev, dmi, {"NEURON_RT_VISIBLE_CORES": "all"})


def test_probe_answers_none_off_trainium(tmp_path):
    dev, dmi = _fake_host(tmp_path, 0)
    assert probe_neuron_instance_type(dev, dmi, {}) is None  # No device nodes.
    assert probe_neuron_instance_type(tmp_path / "missing", dmi, {}) is None
    dev2, dmi2 = _fake_host(tmp_path / "inf2", 1, product="inf2.xlarge\n")
    assert probe_neuron_instance_type(dev2, dmi2, {}) is None  # Neuron devices, but not Trainium.
    dev3, dmi3 = _fake_host(tmp_path / "nodmi", 16, product=None)
    assert probe_neuron_instance_type(dev3, dmi3, {}) is None  # The family is unknown.


def test_probe_needs_jax_with_the_neuron_plugin(monkeypatch):
    monkeypatch.setattr(instance_types, "probe_neuron_instance_type", lambda: "neuron-trn2-64")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(instance_types, "jax_neuron_installed", lambda: False)
    assert axcore_neuron.plugin.axcore_probe_instance_type() is None
    monkeypatch.setattr(instance_types, "jax_neuron_installed", lambda: True)
    assert axcore_neuron.plugin.axcore_probe_instance_type() == "neuron-trn2-64"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert axcore_neuron.plugin.axcore_probe_instance_type() is None
    monkeypatch.setenv("JAX_PLATFORMS", "neuron,cpu")
    assert axcore_neuron.plugin.axcore_probe_instance_type() == "neuron-trn2-64"



def test_a_probed_trainium_host_gets_the_flags_in_neuron_cc_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--optlevel=2")  # The user's flag wins over the plugin's.
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: "neuron-trn2-64")
    exp = load_experiment("default", ["mesh.instance_type=neuron-trn2-64"], objects=OBJECTS, apply_xla_flags=True)
    assert exp.flags_variable == "NEURON_CC_FLAGS" and os.environ["XLA_FLAGS"] == ""
    written = os.environ["NEURON_CC_FLAGS"].split()
    assert written[0] == "--optlevel=2" and "--optlevel=1" not in written
    assert {"--target=trn2", "--model-type=transformer", "--logical-nc-config=2", "--auto-cast=none"} <= set(written)
