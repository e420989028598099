"""XLA flags: plugins' recommendations, the experiment's overrides, the environment's
precedence, listing in the resolved config, and being set before JAX's backend starts."""

import logging
import os
import pathlib
import subprocess
import sys
import types

import pytest

import axcore
import axcore.experiment.loading
import axcore.plugin.instance_probe
from axcore.errors import ConfigError, PluginConflictError, PluginLoadError
from axcore.experiment import load_experiment
from axcore.platform.xla_flags import apply_xla_flags, format_xla_flags, resolve_xla_flags
from axcore.plugin.loading import probe_instance_type
from axcore.testing import TINY_OVERRIDES


class FlagPlugin:
    """Recommends `flags` for instance types starting with `prefix`."""

    def __init__(self, prefix, flags):
        self.prefix, self.flags = prefix, flags

    @axcore.hookimpl
    def axcore_xla_flags(self, instance_type):
        return self.flags if instance_type.startswith(self.prefix) else None


def test_experiment_overrides_plugin_flags_and_null_removes_one():
    recommended = {"xla_a": "true", "xla_b": "1", "xla_c": "x"}
    resolved = resolve_xla_flags(recommended, {"xla_b": 2, "xla_c": None, "xla_d": False})
    assert resolved == {"xla_a": "true", "xla_b": "2", "xla_d": "false"}
    assert list(resolved) == sorted(resolved)
    assert format_xla_flags(resolved) == "--xla_a=true --xla_b=2 --xla_d=false"


@pytest.mark.parametrize(
    "overrides, phrase",
    [
        ({"--xla_a": 1}, "xla_flags.--xla_a: '--xla_a' is not an XLA flag name"),
        ({"xla_a=1": 1}, "is not an XLA flag name"),
        ({"xla_a": "two words"}, "xla_flags.xla_a: value 'two words' contains whitespace"),
        ({"xla_a": [1, 2]}, "xla_flags.xla_a: value [1, 2] must be a string, number or boolean"),
    ],
)
def test_malformed_experiment_flags_name_their_path(overrides, phrase):
    with pytest.raises(ConfigError, match=None) as raised:
        resolve_xla_flags({}, overrides)
    assert phrase in str(raised.value)


def test_flags_already_in_the_environment_win():
    environ = {"XLA_FLAGS": "--xla_a=env --xla_keep"}
    added = apply_xla_flags({"xla_a": "ours", "xla_b": "1"}, environ)
    assert added == {"xla_b": "1"}
    assert environ["XLA_FLAGS"] == "--xla_a=env --xla_keep --xla_b=1"
    empty = {}
    assert apply_xla_flags({}, empty) == {} and empty == {}
    assert apply_xla_flags({"xla_c": ""}, empty) == {"xla_c": ""} and empty["XLA_FLAGS"] == "--xla_c="


def test_plugins_flags_are_merged_and_conflicts_name_both_plugins():
    objects = {"one": FlagPlugin("gpu", {"xla_a": "true"}), "two": FlagPlugin("gpu", {"xla_b": 3})}
    manager = axcore.create_plugin_manager(["one", "two"], objects=objects)
    assert manager.xla_flags("gpu-h100-8") == {"xla_a": "true", "xla_b": "3"}
    assert manager.xla_flags("cpu-1") == {}
    objects["three"] = FlagPlugin("gpu", {"xla_a": "false"})
    manager = axcore.create_plugin_manager(["one", "three"], objects=objects)
    with pytest.raises(PluginConflictError, match="Plugins 'one' and 'three' set XLA flag xla_a to 'true' and 'false'"):
        manager.xla_flags("gpu-h100-8")


def test_a_plugin_answering_something_else_than_a_mapping_is_named():
    class Bad:
        @axcore.hookimpl
        def axcore_xla_flags(self, instance_type):
            return "--xla_a=true"

    manager = axcore.create_plugin_manager(["bad"], objects={"bad": Bad()})
    with pytest.raises(PluginLoadError, match="Plugin 'bad' .*returned str"):
        manager.xla_flags("cpu-1")


# Real XLA flags (the experiment's flags are checked against the installed XLA): two booleans and an integer.
LHS, PAG, ARC = ("xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_enable_pipelined_all_gather",
                 "xla_gpu_all_reduce_combine_threshold_bytes")


def test_resolved_config_lists_plugin_flags_with_the_experiments_overrides():
    objects = {"flags": FlagPlugin("gpu-h100", {LHS: "true", PAG: "true"})}
    overrides = ["plugins=[flags]", "mesh.instance_type=gpu-h100-8", f"xla_flags={{{PAG}: null, {ARC}: 7}}"]
    experiment = load_experiment("default", overrides, objects=objects)
    assert experiment.config.xla_flags == {LHS: "true", ARC: "7"}
    assert f"xla_flags: {{{ARC}: '7', {LHS}: 'true'}}" in experiment.flat()
    # Another instance type: the plugin recommends nothing; the experiment's own flag stays.
    overrides[1] = "mesh.instance_type=gpu-a100-8"
    assert load_experiment("default", overrides, objects=objects).config.xla_flags == {ARC: "7"}


def test_flags_are_applied_only_for_this_machines_platform(monkeypatch, caplog):
    objects = {"flags": FlagPlugin("gpu", {LHS: "true"})}
    overrides = ["plugins=[flags]", "mesh.instance_type=gpu-h100-8"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_keep=1")
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: "gpu-h100-8")
    load_experiment("default", overrides, objects=objects, apply_xla_flags=True)
    assert os.environ["XLA_FLAGS"] == f"--xla_keep=1 --{LHS}=true"
    # Resolving a GPU experiment on a CPU machine lists the flags but never sets them here.
    monkeypatch.setenv("XLA_FLAGS", "--xla_keep=1")
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: "cpu-1")
    with caplog.at_level(logging.WARNING, logger="axcore.experiment.loading"):
        experiment = load_experiment("default", overrides, objects=objects, apply_xla_flags=True)
    assert experiment.config.xla_flags == {LHS: "true"}
    assert os.environ["XLA_FLAGS"] == "--xla_keep=1"
    assert "XLA flags for gpu-h100-8 not applied: this machine was probed as cpu-1" in caplog.text


def test_probe_reads_jax_platforms_then_asks_installed_plugins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3")
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", probe_instance_type)
    monkeypatch.setattr("axcore.plugin.instance_probe._jax_platforms", lambda: "cpu")
    assert probe_instance_type() == "cpu-3"

    calls = []

    def entry_point(module):
        return types.SimpleNamespace(load=lambda: calls.append(module) or module)

    def axcore_probe_instance_type():
        return "gpu-h100-2"

    silent = types.SimpleNamespace()  # A plugin without a probe.
    gpu = types.SimpleNamespace(axcore_probe_instance_type=axcore_probe_instance_type)
    broken = types.SimpleNamespace(axcore_probe_instance_type=lambda: 1 / 0)
    other = types.SimpleNamespace(axcore_probe_instance_type=lambda: "never-asked-1")  # Not a hardware name.
    found = {"tpu": [entry_point(silent)], "gpu": [entry_point(broken)], "neuron": [entry_point(gpu)], "rope": [entry_point(other)]}
    monkeypatch.setattr("axcore.plugin.instance_probe._jax_platforms", lambda: "")
    monkeypatch.setattr(axcore.plugin.instance_probe, "installed_entry_points", lambda: found)
    assert probe_instance_type() == "gpu-h100-2"  # The broken plugin is skipped with a warning.
    assert calls == [broken, silent, gpu]  # gpu, tpu, neuron; never the feature plugin.
    monkeypatch.setenv("AXCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert probe_instance_type() is None


ROOT = pathlib.Path(__file__).resolve().parents[2]


def _train_instance_type(tmp_path, flags_override, env_flags):
    """The instance type `axcore train` recorded, in a fresh process (JAX_PLATFORMS=cpu)."""
    run_dir = tmp_path / "run"
    args = [*TINY_OVERRIDES, "trainer.max_steps=1", "trainer.eval_every=0", f"trainer.run_dir={run_dir}", flags_override]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": env_flags}
    command = [sys.executable, "-m", "axcore.cli", "train", "default"]
    for override in args:
        command += ["--set", override]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    config = (run_dir / "config.yaml").read_text()
    return next(line.split(":", 1)[1].strip() for line in config.splitlines() if "instance_type:" in line), out.stderr


def test_train_sets_the_experiments_flags_before_jax_starts(tmp_path):
    # The host device count only takes effect if XLA_FLAGS is set before the CPU backend starts.
    instance_type, stderr = _train_instance_type(tmp_path, "xla_flags={xla_force_host_platform_device_count: 4}", "")
    assert instance_type == "cpu-4"
    assert "XLA_FLAGS: --xla_force_host_platform_device_count=4" in stderr


def test_a_flag_in_the_environment_beats_the_experiments(tmp_path):
    env_flags = "--xla_force_host_platform_device_count=2"
    instance_type, _ = _train_instance_type(tmp_path, "xla_flags={xla_force_host_platform_device_count: 4}", env_flags)
    assert instance_type == "cpu-2"


class LibtpuPlugin(FlagPlugin):
    """Recommends flags for tpu-* and says they go to LIBTPU_INIT_ARGS."""

    def __init__(self, variable="LIBTPU_INIT_ARGS"):
        super().__init__("tpu", {"xla_tpu_example": "true"})
        self.variable = variable

    @axcore.hookimpl
    def axcore_flags_environment(self, instance_type):
        return self.variable if instance_type.startswith("tpu") else None


def test_a_plugin_sends_the_flags_to_another_variable(monkeypatch):
    objects = {"tpu_flags": LibtpuPlugin()}
    overrides = ["plugins=[tpu_flags]", "mesh.instance_type=tpu-v5p-8"]
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_keep=1")
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: "tpu-v5p-8")
    experiment = load_experiment("default", overrides, objects=objects, apply_xla_flags=True)
    assert experiment.flags_variable == "LIBTPU_INIT_ARGS"
    assert "# xla_flags go to LIBTPU_INIT_ARGS" in experiment.flat()
    assert os.environ["LIBTPU_INIT_ARGS"] == "--xla_keep=1 --xla_tpu_example=true"
    assert os.environ["XLA_FLAGS"] == ""
    # Other instance types keep XLA_FLAGS, and the listing says nothing more.
    cpu = load_experiment("default", ["plugins=[tpu_flags]", "mesh.instance_type=cpu-1"], objects=objects)
    assert cpu.flags_variable == "XLA_FLAGS" and "go to" not in cpu.flat()


def test_two_plugins_naming_different_variables_are_a_conflict():
    objects = {"one": LibtpuPlugin(), "two": LibtpuPlugin("OTHER_FLAGS")}
    manager = axcore.create_plugin_manager(["one", "two"], objects=objects)
    with pytest.raises(PluginConflictError, match="Plugins 'one' and 'two' want the compiler flags of tpu-v5p-8"):
        manager.flags_environment("tpu-v5p-8")
    assert manager.flags_environment("cpu-1") == "XLA_FLAGS"


def test_other_compilers_get_bare_switches_for_empty_values():
    flags = {"model-type": "transformer", "enable-switch": ""}
    assert format_xla_flags(flags, "NEURON_CC_FLAGS") == "--model-type=transformer --enable-switch"
    assert format_xla_flags({"xla_gpu_enable_command_buffer": ""}) == "--xla_gpu_enable_command_buffer="
    environ = {}
    apply_xla_flags(flags, environ, "NEURON_CC_FLAGS")
    assert environ == {"NEURON_CC_FLAGS": "--model-type=transformer --enable-switch"}


class EnvironmentPlugin:
    """Asks for `values` in the runtime's environment on gpu instance types."""

    def __init__(self, values):
        self.values = values

    @axcore.hookimpl
    def axcore_runtime_environment(self, instance_type):
        return self.values if instance_type.startswith("gpu") else None


def test_runtime_environment_is_set_before_the_backend_on_its_platform_only(monkeypatch):
    objects = {"env": EnvironmentPlugin({"AXCORE_TEST_QUEUE": "4x", "AXCORE_TEST_KEPT": 1})}
    overrides = ["plugins=[env]", "mesh.instance_type=gpu-h100-8"]
    monkeypatch.setenv("AXCORE_TEST_KEPT", "user")
    monkeypatch.delenv("AXCORE_TEST_QUEUE", raising=False)
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: "cpu-1")
    load_experiment("default", overrides, objects=objects, apply_xla_flags=True)
    assert "AXCORE_TEST_QUEUE" not in os.environ  # Probed as another platform: nothing set.
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: "gpu-h100-8")
    load_experiment("default", overrides, objects=objects, apply_xla_flags=False)
    assert "AXCORE_TEST_QUEUE" not in os.environ  # Only when asked to apply (axcore train, compile).
    load_experiment("default", overrides, objects=objects, apply_xla_flags=True)
    assert os.environ["AXCORE_TEST_QUEUE"] == "4x"
    assert os.environ["AXCORE_TEST_KEPT"] == "user"  # The user's own value is never changed.


def test_runtime_environment_conflicts_and_bad_names_name_the_plugin():
    manager = axcore.create_plugin_manager(
        ["one", "two"], objects={"one": EnvironmentPlugin({"Q": "4x"}), "two": EnvironmentPlugin({"Q": "2x"})}
    )
    with pytest.raises(PluginConflictError, match="Plugins 'one' and 'two' set environment variable Q to '4x' and '2x'"):
        manager.runtime_environment("gpu-h100-1")
    assert manager.runtime_environment("cpu-1") == {}
    bad = axcore.create_plugin_manager(["bad"], objects={"bad": EnvironmentPlugin({"NOT A NAME": "1"})})
    with pytest.raises(ConfigError, match="environment variable NOT A NAME of plugin 'bad'"):
        bad.runtime_environment("gpu-h100-1")
    listed = axcore.create_plugin_manager(["bad"], objects={"bad": EnvironmentPlugin(["Q"])})
    with pytest.raises(PluginLoadError, match="Plugin 'bad' .*axcore_runtime_environment returned list"):
        listed.runtime_environment("gpu-h100-1")


def _config(tmp_path, *overrides):
    command = [sys.executable, "-m", "axcore.cli", "config", "default", *[a for o in overrides for a in ("--set", o)]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.parametrize(
    "flags, line",
    [
        ("{foo: 1}", "axcore: error: 'xla_flags.foo' is not a flag the installed XLA (jaxlib) knows"),
        ("{xla_cpu_enable_fast_math: maybe}",
         "axcore: error: 'xla_flags.xla_cpu_enable_fast_math': XLA cannot read 'maybe' as the value of this flag "
         "(type bool); use true or false."),
    ],
)
def test_config_refuses_a_flag_xla_would_abort_on_in_one_line(tmp_path, flags, line):
    # Today XLA aborts `axcore train` with a fatal C++ line (a bad boolean prints the usage of every flag).
    out = _config(tmp_path, f"xla_flags={flags}")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), out.stderr
    assert list((tmp_path / "cache" / "axcore" / "xla_flags").glob("*.json"))  # The verdict is kept.


def test_a_flag_verdict_is_cached_per_flag_set(tmp_path, monkeypatch):
    from axcore.platform import xla_flags

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probes = []
    monkeypatch.setattr(xla_flags, "_run_probe", lambda text: probes.append(text) or "Unknown flag in XLA_FLAGS: --xla_x=1")
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"'xla_flags.xla_x' is not a flag"):
            xla_flags.check_xla_flags({"xla_x": "1"})
    xla_flags.check_xla_flags({"xla_x": "1"}, variable="LIBTPU_INIT_ARGS")  # Another compiler's: not XLA's to judge.
    assert probes == ["--xla_x=1"]  # Probed once; the second check read the cached verdict.
