"""Trainer configs checked against the registries: component kinds and checkpoint backend settings."""

import pytest

import axcore
from axcore.errors import ConfigError, ConfigTypeError, UnknownComponentError, UnknownFieldError
from axcore.experiment import load_experiment
from axcore.placement.backend import CheckpointConfig, backend_arguments, make_checkpoint_backend


class RecordingBackends:
    """A checkpoint backend whose factory records the arguments it was called with."""

    calls = []

    @staticmethod
    def factory(
        directory, *, keep_last_n: int | None = 3, async_save: bool = True, level: int = 1, codec: str = "raw"
    ):
        RecordingBackends.calls.append(dict(directory=directory, keep_last_n=keep_last_n, async_save=async_save,
                                            level=level, codec=codec))
        return "backend"

    @axcore.hookimpl
    def axcore_register_checkpoint_backends(self, register):
        register("recording", self.factory)


def test_backend_settings_reach_the_factory_whole(tmp_path, registries):
    RecordingBackends.calls.clear()
    regs = axcore.create_plugin_manager(["rec"], objects={"rec": RecordingBackends()}).registries
    cfg = CheckpointConfig(backend="recording", backend_settings={"level": 7, "codec": "zstd"}, keep_last_n=None,
                           async_save=False)
    assert make_checkpoint_backend(cfg, regs, tmp_path) == "backend"
    assert RecordingBackends.calls == [dict(directory=tmp_path, keep_last_n=None, async_save=False, level=7, codec="zstd")]


def test_orbax_compress_is_reachable_from_the_experiment(tmp_path):
    exp = load_experiment(None, ["trainer.checkpoint.backend_settings={compress: true}"])
    backend = make_checkpoint_backend(exp.config.trainer.checkpoint, exp.registries, tmp_path)
    try:
        assert backend.compress is True
    finally:
        backend.close()
    assert "trainer.checkpoint.backend_settings: {compress: true}" in exp.flat()


@pytest.mark.parametrize(
    "backend,settings,error,pattern",
    [
        ("orbax", {"compres": True}, UnknownFieldError,
         r"backend 'orbax' takes no setting 'compres' \('trainer\.checkpoint\.backend_settings\.compres'\) "
         r"\(did you mean 'compress'\?\); its settings are: compress"),
        ("tensorstore", {"compress": True}, UnknownFieldError, "its settings are: none"),
        ("orbax", {"keep_last_n": 1}, ConfigError, r"set 'trainer\.checkpoint\.keep_last_n' instead"),
        ("orbax", {"compress": 3}, ConfigTypeError, r"'trainer\.checkpoint\.backend_settings\.compress' expects bool"),
        ("orbaks", {}, UnknownComponentError, r"No checkpoint backend named 'orbaks' \(did you mean 'orbax'\?\)"),
    ],
)
def test_bad_backend_settings_name_the_key(registries, backend, settings, error, pattern):
    with pytest.raises(error, match=pattern):
        backend_arguments(CheckpointConfig(backend=backend, backend_settings=settings), registries)


def test_bad_settings_are_caught_when_the_experiment_loads():
    with pytest.raises(UnknownFieldError, match="compres"):
        load_experiment(None, ["trainer.checkpoint.backend_settings.compres=true"])


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("trainer.learner.optimizer.type=linear", r"'trainer\.learner\.optimizer' builds 'Linear', which is not an "
                                                  r"optimizer.*\(adafactor, adamw, lion, sgd\)"),
        ("trainer.learner.schedule.type=adamw", r"'trainer\.learner\.schedule' builds 'AdamW'.*registered schedule"),
        ("trainer.metrics_writers=[{type: cosine}]",
         r"'trainer\.metrics_writers\[0\]' builds 'Cosine'.*\(jsonl, tensorboard\)"),
        ("tokenizer.type=jsonl", r"'tokenizer' builds 'JsonlWriterFactory', which is not a tokenizer.*\(bytes\)"),
        ("trainer.log_every=0", r"'trainer\.log_every' must be > 0"),
    ],
)
def test_components_of_the_wrong_kind_are_refused_at_load(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_experiment(None, [override])


def test_sgd_override_and_typo_suggestion():
    exp = load_experiment(None, ["trainer.learner.optimizer.type=sgd", "trainer.learner.optimizer.momentum=0.9"])
    assert exp.registries.name_of(exp.config.trainer.learner.optimizer.target) == "sgd"
    assert exp.config.trainer.learner.optimizer.momentum == 0.9
    with pytest.raises(UnknownComponentError, match="did you mean 'adamw'"):
        load_experiment(None, ["trainer.learner.optimizer.type=adamww"])
    with pytest.raises(UnknownFieldError, match="did you mean 'moment_dtype'"):
        load_experiment(None, ["trainer.learner.optimizer.moment_dtyp=bfloat16"])
