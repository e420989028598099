"""The order of `load_experiment`'s steps where it matters: XLA flags are in the environment before the
multi-process job is joined, and the job is joined before anything asks JAX's backend (which starts it)."""

import os

import pytest

import axcore
import axcore.experiment.loading
from axcore.experiment import load_experiment
from axcore.module import deep_merge


class CpuFlags:
    """Recommends one XLA flag for CPU instance types."""

    @axcore.hookimpl
    def axcore_xla_flags(self, instance_type):
        return {"xla_cpu_enable_fast_math": "true"} if instance_type.startswith("cpu") else None


@pytest.fixture
def events(monkeypatch):
    """Records, in order, joining the job (with XLA_FLAGS at that moment), asking the backend for its
    platform, and building the plugin manager; none of them is skipped."""
    log = []
    platform, build = axcore.experiment.loading.current_platform, axcore.experiment.loading.create_plugin_manager

    def join(settings):
        log.append(("join", settings, os.environ.get("XLA_FLAGS", "")))

    def current_platform():
        log.append(("backend",))
        return platform()

    def create_plugin_manager(*args, **kwargs):
        log.append(("manager",))
        return build(*args, **kwargs)

    monkeypatch.setattr(axcore.experiment.loading, "initialize_distributed", join)
    monkeypatch.setattr(axcore.experiment.loading, "current_platform", current_platform)
    monkeypatch.setattr(axcore.experiment.loading, "create_plugin_manager", create_plugin_manager)
    return log


def test_known_instance_type_sets_the_flags_then_joins_the_job_once(monkeypatch, events):
    monkeypatch.setenv("XLA_FLAGS", "--xla_keep=1")
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: "cpu-1")
    job = object()
    overrides = ["plugins=[cpu_flags]", "mesh.instance_type=cpu-1"]
    experiment = load_experiment("default", overrides, objects={"cpu_flags": CpuFlags()}, apply_xla_flags=True,
                                 distributed=job)
    assert experiment.config.xla_flags == {"xla_cpu_enable_fast_math": "true"}
    joins = [e for e in events if e[0] == "join"]
    assert joins == [("join", job, "--xla_keep=1 --xla_cpu_enable_fast_math=true")]
    # The platform came from the instance type: the backend was never asked before joining.
    assert ("backend",) not in events[: events.index(joins[0])]


def test_unknown_instance_type_joins_the_job_before_the_backend_is_asked(monkeypatch, events):
    monkeypatch.setattr(axcore.experiment.loading, "probe_instance_type", lambda: None)
    job = object()
    experiment = load_experiment("default", ["trainer.max_steps=3"], distributed=job)
    assert experiment.config.mesh.instance_type  # Detected once the backend started.
    kinds = [e[0] for e in events]
    assert kinds.count("join") == 1 and events[kinds.index("join")][1] is job
    assert kinds.index("join") < kinds.index("backend") < kinds.index("manager")


def test_deep_merge_merges_nested_mappings_and_replaces_everything_else():
    into = {"a": {"b": 1, "c": {"d": 2}}, "e": 1, "f": [1]}
    deep_merge(into, {"a": {"c": {"g": 3}, "b": 4}, "e": {"x": 1}, "f": [2], "h": None})
    assert into == {"a": {"b": 4, "c": {"d": 2, "g": 3}}, "e": {"x": 1}, "f": [2], "h": None}


def test_init_from_merges_onto_a_saved_runs_config_without_its_name_or_run_directory(tmp_path):
    """A base run with only a saved (resolved) config.yaml: its model, plugins and settings are the base, the
    file and overrides win (a plugins override adds to the base's), the base's run_dir and name are not
    inherited, a component of another type (the chat source) replaces the base's, and the saved result loads
    as is."""
    base = tmp_path / "base"
    saved = load_experiment("default", ["plugins=[rope]", "model.dim=48", "trainer.max_steps=7",
                                        f"input.source={{type: text_files, paths: [{tmp_path}], format: jsonl}}",
                                        f"trainer.run_dir={base}", "mesh.instance_type=cpu-1"])
    saved.save(base)
    exp = load_experiment("sft", [f"init_from={base}", "plugins=[swiglu]", "trainer.max_steps=5"])
    config = exp.config
    assert (config.name, config.init_from, config.trainer.run_dir) == ("sft", str(base), None)
    assert config.model.dim == 48 and config.trainer.max_steps == 5 and config.trainer.learner.learning_rate == 2e-5
    assert config.plugins == ["rope", "swiglu"] and type(config.input.source).__qualname__ == "ChatFiles.Config"
    exp.save(tmp_path / "sft")
    again = load_experiment(tmp_path / "sft" / "config.yaml")  # Resolved: not merged a second time.
    assert again.to_dict() == exp.to_dict()
    with pytest.raises(axcore.ConfigError, match=r"init_from must be a run directory"):
        load_experiment("sft", ["init_from=3"])
