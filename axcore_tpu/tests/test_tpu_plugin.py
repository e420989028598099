"""The `tpu` plugin: its package, mesh rules resolved on CPU, compiler flags, the probe, host-offload
remat, and a golden file of the default experiment resolved for `tpu-v5p-64`."""

import os
import pathlib
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.cli import main
from axcore.data import Split
from axcore.errors import ConfigError
from axcore.experiment import load_experiment
from axcore.experiment.builtins import create_plugin_manager
from axcore.layers.base import checkpoint_policy
from axcore.testing import TINY_OVERRIDES

import axcore_tpu.plugin
from axcore_tpu.instance_types import (
    TpuInstance,
    instance_type_from_accelerator_type,
    parse_instance_type,
    probe_instance_type,
)
from axcore_tpu.mesh_rules import tpu_mesh_rules, tpu_slices
from axcore_tpu.remat import OFFLOAD_POLICY, offload_policy, remat_offload
from axcore_tpu.xla_flags import tpu_xla_flags

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = pathlib.Path(__file__).parent / "golden"
OBJECTS = {"tpu": axcore_tpu.plugin}
BF16 = np.dtype("bfloat16")


def resolve(*overrides, source=None):
    """The experiment resolved with the tpu plugin given as an object; a `tpu-*` instance type
    loads it as the platform plugin, as an installed one would be."""
    return load_experiment(source, list(overrides), objects=OBJECTS)


# -- The package --------------------------------------------------------------------------------


def test_distribution_declares_both_entry_points_and_libtpu_as_an_extra():
    project = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "axcore-tpu"
    assert project["entry-points"]["axcore"] == {"tpu": "axcore_tpu.plugin", "int8": "axcore_tpu.int8_plugin"}
    assert "axcore" in project["dependencies"] and not any("tpu" in d for d in project["dependencies"])
    assert project["optional-dependencies"]["tpu"] == ["jax[tpu]>=0.7"]
    assert (PACKAGE_ROOT / "README.md").is_file()


def test_import_and_tpu_resolution_probe_no_device():
    """With an unknown JAX platform, any backend initialization would raise; nothing may initialize one."""
    code = (
        "import axcore_tpu.plugin\n"
        "from axcore.experiment.loading import load_experiment\n"
        "exp = load_experiment(None, ['mesh.instance_type=tpu-v5p-64'], objects={'tpu': axcore_tpu.plugin})\n"
        "print(exp.config.mesh.rule, exp.config.model.compute_dtype)\n"
        "import jax\n"
        "try:\n"
        "    jax.devices()\n"
        "except RuntimeError:\n"
        "    print('no backend')\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="axcore_no_such_platform", PYTHONPATH=str(PACKAGE_ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["tpu-v5p", "bfloat16", "no", "backend"]


def test_plugin_registers_kernels_rules_and_modifiers():
    registries = create_plugin_manager(["tpu"], objects=OBJECTS).registries
    # The built-in context-parallel kernels rank between the TPU kernels and the reference.
    assert [k.name for k in registries.kernels.candidates("attention")] == [
        "splash", "pallas_tpu", "context_all_gather", "context_ring", "xla"
    ]
    tpu_rules = sorted(r for r in registries.mesh_rules if r.startswith("tpu"))
    assert tpu_rules == ["tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"]
    assert {"remat_offload", "int8_dot"} <= set(registries.config_modifiers.names())


# -- Instance types and mesh rules ---------------------------------------------------------------


@pytest.mark.parametrize(
    "instance_type, expected",
    [
        ("tpu-v5p-64", TpuInstance("v5p", 64, 1)),
        ("tpu-v5p-64x2", TpuInstance("v5p", 64, 2)),
        ("tpu-v5litepod-16", TpuInstance("v5e", 16, 1)),
        ("tpu-v6-8", TpuInstance("v6e", 8, 1)),  # JAX's device kind "TPU v6 lite".
        ("tpu-v5-32", TpuInstance("v5", 32, 1)),  # "TPU v5" or "TPU v5 lite".
        ("tpu-v4-8x4", TpuInstance("v4", 8, 4)),
        ("tpu-v3-8", None),
        ("tpu-v5p", None),
        ("tpu-v5p-0", None),
        ("gpu-h100-8", None),
    ],
)
def test_instance_type_grammar(instance_type, expected):
    assert parse_instance_type(instance_type) == expected


@pytest.mark.parametrize(
    "instance_type, rule",
    [("tpu-v5p-64", "tpu-v5p"), ("tpu-v5e-256", "tpu-v5e"), ("tpu-v5litepod-16", "tpu-v5e"), ("tpu-v6e-8", "tpu-v6e"),
     ("tpu-v6-8", "tpu-v6e"), ("tpu-v4-16", "tpu-v4"), ("tpu-v5-32", "tpu-v5p")],
)
def test_tpu_instance_types_get_fsdp_bfloat16_and_matmul_remat(instance_type, rule):
    config = resolve(f"mesh.instance_type={instance_type}").config
    assert config.mesh.rule == rule
    assert tuple(config.mesh.mesh_shape) == (1, -1, 1)
    assert tuple(config.mesh.mesh_axis_names) == ("data", "fsdp", "tensor")
    assert config.mesh.axis_rules == {"batch": ["data", "fsdp"], "embed": "fsdp"}
    assert config.model.compute_dtype == BF16 and config.model.param_dtype is None  # float32 master weights.
    assert config.model.decoder.layer.remat_policy == "dots_with_no_batch_dims_saveable"


def test_multislice_puts_the_slices_on_data_over_dcn():
    config = resolve("mesh.instance_type=tpu-v5p-64x4").config
    assert config.mesh.rule == "tpu-v5p" and tuple(config.mesh.mesh_shape) == (4, -1, 1)
    # An explicit mesh shape of the experiment still wins.
    config = resolve("mesh.instance_type=tpu-v5p-64x4", "mesh.mesh_shape=[2, -1, 2]").config
    assert tuple(config.mesh.mesh_shape) == (2, -1, 2)


def test_the_experiments_own_choices_are_kept():
    config = resolve("mesh.instance_type=tpu-v6e-8", "model.compute_dtype=float32").config
    assert config.model.compute_dtype == np.dtype("float32")
    scan = resolve("mesh.instance_type=tpu-v6e-8", "model.decoder.remat_policy=nothing_saveable", source="scan").config
    assert scan.model.decoder.remat_policy == "nothing_saveable" and scan.model.decoder.layer.remat_policy is None


def test_scanned_decoder_gets_remat_per_scanned_layer():
    config = resolve("mesh.instance_type=tpu-v5e-16", source="scan").config
    assert config.model.decoder.remat_policy is None
    assert config.model.decoder.layer.remat_policy == "dots_with_no_batch_dims_saveable"


def test_other_instance_types_fall_back_to_the_default_rule():
    for instance_type in ("tpu-v3-8", "cpu-8"):
        config = resolve(f"mesh.instance_type={instance_type}", "plugins=[tpu]").config
        assert config.mesh.rule == "default" and config.model.compute_dtype is None


def test_rules_can_force_the_attention_kernel_and_skip_remat():
    rule = tpu_mesh_rules(remat_policy=None, attention_kernel="splash")[0]
    names = [getattr(m, "name", getattr(m, "__name__", "")) for m in rule.config_modifiers]
    assert names == ["tpu_slices", "compute_dtype", "attention_kernel"]


def test_slices_modifier_refuses_a_non_tpu_instance_type():
    config = resolve("mesh.instance_type=cpu-1").config
    with pytest.raises(ConfigError, match="tpu_slices"):
        tpu_slices(config)


# -- Compiler flags and the probe -----------------------------------------------------------------

CF = {"xla_tpu_enable_async_collective_fusion", "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
      "xla_tpu_enable_async_collective_fusion_multiple_steps", "xla_tpu_overlap_compute_collective_tc",
      "xla_enable_async_all_gather"}
DP = {"xla_tpu_enable_data_parallel_all_reduce_opt", "xla_tpu_data_parallel_opt_different_sized_ops"}
DCN = {"xla_tpu_enable_megascale_barrier", "xla_tpu_enable_sunk_dcn_allreduce_done_with_host_reduction"}


def test_flags_per_generation_and_for_multislice():
    assert set(tpu_xla_flags("tpu-v5p-64")) == CF | DP
    assert set(tpu_xla_flags("tpu-v5e-256")) == CF | DP
    assert tpu_xla_flags("tpu-v6e-8") == {**dict.fromkeys(CF | DP, "true"), "xla_tpu_scoped_vmem_limit_kib": "98304"}
    v4 = {"xla_enable_async_all_gather", "xla_enable_async_collective_permute"}
    assert tpu_xla_flags("tpu-v4-8") == dict.fromkeys(sorted(v4), "true")
    assert set(tpu_xla_flags("tpu-v5p-64x2")) == CF | DP | DCN
    assert set(tpu_xla_flags("tpu-v4-8x2")) == v4 | DP | DCN
    for other in ("cpu-8", "gpu-h100-8", "tpu-v3-8"):
        assert tpu_xla_flags(other) is None


def test_flags_go_to_libtpu_init_args_and_the_user_overrides_them():
    assert axcore_tpu.plugin.axcore_flags_environment("tpu-v5p-64") == "LIBTPU_INIT_ARGS"
    assert axcore_tpu.plugin.axcore_flags_environment("gpu-h100-8") is None
    overrides = ["mesh.instance_type=tpu-v6e-8",
                 "xla_flags={xla_tpu_scoped_vmem_limit_kib: 81920, xla_enable_async_all_gather: null}"]
    flags = resolve(*overrides).config.xla_flags
    assert flags["xla_tpu_scoped_vmem_limit_kib"] == "81920" and "xla_enable_async_all_gather" not in flags
    assert flags["xla_tpu_overlap_compute_collective_tc"] == "true"


def test_accelerator_types_convert_to_instance_types():
    assert instance_type_from_accelerator_type("v5p-128") == "tpu-v5p-64"  # Cloud counts v5p TensorCores.
    assert instance_type_from_accelerator_type("v4-8") == "tpu-v4-4"
    assert instance_type_from_accelerator_type("v5litepod-16") == "tpu-v5e-16"
    assert instance_type_from_accelerator_type("v6e-8", slices=2) == "tpu-v6e-8x2"
    assert instance_type_from_accelerator_type("v3-8") is None and instance_type_from_accelerator_type("h100") is None


def test_probe_reads_the_environment_and_dev_only(tmp_path):
    env = {"TPU_ACCELERATOR_TYPE": "v5p-128", "MEGASCALE_NUM_SLICES": "2"}
    assert probe_instance_type(env, tmp_path, libtpu=True) is None  # No TPU device files.
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "0").touch()
    assert probe_instance_type(env, tmp_path, libtpu=True) == "tpu-v5p-64x2"
    assert probe_instance_type(env, tmp_path, libtpu=False) is None  # JAX cannot use them without libtpu.
    assert probe_instance_type({**env, "JAX_PLATFORMS": "cpu"}, tmp_path, libtpu=True) is None
    assert probe_instance_type({}, tmp_path, libtpu=True) is None
    (tmp_path / "accel0").touch()
    assert probe_instance_type({"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, tmp_path, libtpu=True) == "tpu-v5e-8"
    # This machine: no TPU.
    assert axcore_tpu.plugin.axcore_probe_instance_type() is None


# -- Host-offload remat ----------------------------------------------------------------------------

OFFLOAD_RULE = "mesh_rules=[{name: offload, instance_type: '.*', priority: 100, modifiers: [{type: remat_offload}]}]"


def test_remat_offload_sets_the_offloading_policy_on_tpu():
    for source in (None, "scan"):
        config = resolve("mesh.instance_type=tpu-v5p-64", OFFLOAD_RULE, source=source).config
        assert config.model.decoder.layer.remat_policy == OFFLOAD_POLICY
        assert config.model.remat_policy is None and config.model.decoder.remat_policy is None


def test_remat_offload_declines_on_cpu_with_the_reason():
    with pytest.raises(ConfigError, match="a CPU device's memory is host memory, so there is nothing to offload"):
        resolve("mesh.instance_type=cpu-1", "plugins=[tpu]", OFFLOAD_RULE)


def test_offload_policy_string_resolves_to_jax_offloading_policy():
    policy = checkpoint_policy(OFFLOAD_POLICY)
    x, w1, w2 = jnp.ones((8, 16)), jnp.full((16, 16), 0.1), jnp.full((16, 4), 0.1)

    def f(x, w1, w2):
        return jnp.sum(jnp.cos(jnp.sin(x @ w1) @ w2))

    for candidate in (policy, offload_policy()):
        jaxpr = str(jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=candidate), argnums=(1, 2)))(x, w1, w2))
        # Both weight-matmul outputs are saved in host memory, then brought back for the backward pass.
        assert jaxpr.count("f32<host>[8,16]") >= 1 and jaxpr.count("f32<host>[8,4]") >= 1
        assert "MemorySpace.Host" in jaxpr and "MemorySpace.Device" in jaxpr
    grads = jax.grad(jax.checkpoint(f, policy=policy), argnums=(1, 2))(x, w1, w2)
    for got, want in zip(grads, jax.grad(f, argnums=(1, 2))(x, w1, w2)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_layers_run_under_the_offloading_policy_string():
    """The policy string through axcore's layers (the layer a scan repeats): the backward pass of the
    train loss saves the layer's matmul outputs in host memory (traced, not compiled). The `xla` dot
    kernel, as on a TPU: XLA:CPU's `xla_cpu` kernel has a custom VJP, whose dots no policy sees."""
    overrides = [
        "mesh.instance_type=cpu-1", "model.kernels={dot: xla}", f"model.decoder.layer.remat_policy={OFFLOAD_POLICY}"
    ]
    exp = load_experiment("scan", [*TINY_OVERRIDES, *overrides])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = jax.eval_shape(model.initialize, jax.random.key(0))
    batch = next(exp.config.input.make_iterator(Split.TRAIN))
    loss = lambda p: axcore.functional(model, p, (batch,), None, True)[0][0]  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
    assert "MemorySpace.Host" in jaxpr and "f32<host>" in jaxpr


def test_remat_offload_refuses_a_bad_pattern():
    with pytest.raises(ConfigError, match="not a regular expression"):
        remat_offload("decoder(")


# -- The golden file -------------------------------------------------------------------------------


def test_resolved_tpu_v5p_64_config_matches_golden_file(request, capsys):
    assert main(["config", "default", "--mesh-selector", "tpu-v5p-64"], objects=OBJECTS) == 0
    output = capsys.readouterr().out
    # The golden holds the config; the kernel lines depend on the machine (checked below).
    text = "".join(line for line in output.splitlines(True) if not line.startswith("# kernel"))
    golden = GOLDEN / "default_tpu_v5p_64.txt"
    if request.config.getoption("--update-goldens"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run pytest --update-goldens"
    assert text == golden.read_text(), "resolved tpu-v5p-64 config changed; review and run pytest --update-goldens"
    lines = dict(line.split(": ", 1) for line in output.splitlines() if ": " in line)
    assert lines["mesh.rule"] == "tpu-v5p" and lines["mesh.instance_type"] == "tpu-v5p-64"
    assert lines["model.compute_dtype"] == "bfloat16" and lines["model.param_dtype"] == "null"
    assert lines["plugins"] == "[]"  # Loaded for the selected platform, not listed.
    assert "# xla_flags go to LIBTPU_INIT_ARGS" in output.splitlines()
    # The attention problems of a TPU target: splash supports them (causal, lengths of 256).
    assert lines["# kernel attention"] == "splash (4 sites)"
