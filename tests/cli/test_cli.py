"""The `axcore` command: help, config (golden files), plugins, compile, errors, plugin commands."""

import os
import pathlib
import subprocess
import sys

import pytest

from axcore.cli import COMMANDS, main
from axcore.experiment import builtin_experiments
from axcore.plugin.commands import BUILTIN_COMMANDS

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
# Fixed so the golden files do not depend on how many devices this machine has.
FIXED_MESH = ["--set", "mesh.instance_type=cpu-1"]
# Vocabulary of the built-in experiments shaped like published models (the others are byte-level).
MODEL_VOCAB = {"llama2_7b": "32000", "llama3_70b": "128256"}


def _axcore(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "axcore.cli", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )


def test_help_is_fast_and_imports_no_jax():
    code = "import sys; from axcore.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\nprint('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "train" in out.stdout and out.stdout.strip().endswith("False")
    assert "plugins can add commands" in " ".join(out.stdout.split())  # And how to list them.


def test_builtin_command_names_are_reserved_for_plugins():
    assert tuple(COMMANDS) == BUILTIN_COMMANDS


@pytest.mark.parametrize("name", builtin_experiments())
def test_config_matches_golden_file(name, capsys, request):
    assert main(["config", name, *FIXED_MESH]) == 0
    text = capsys.readouterr().out
    golden = GOLDEN / f"{name}.txt"
    if request.config.getoption("--update-goldens"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run pytest --update-goldens"
    assert text == golden.read_text(), f"resolved config of {name} changed; review and run pytest --update-goldens"
    # Semantic checks beside the golden text (goldens alone would freeze bugs).
    lines = dict(line.split(": ", 1) for line in text.splitlines())
    assert lines["model.type"] == "causal_lm" and lines["model.vocab_size"] == MODEL_VOCAB.get(name, "256")
    assert lines["model.decoder.layer.self_attention.causal"] == "true"
    assert lines["mesh.rule"] == "default"
    source = {"sft": "chat"}.get(name, "prepared" if name.startswith("llama") else "embedded_corpus")
    assert lines["input.source.type"] == source
    assert lines["trainer.learner.optimizer.type"] == "adamw" and lines["trainer.learner.schedule.type"] == "cosine"
    assert lines["trainer.learner.optimizer.moment_dtype"] == "null"  # Moments in the parameter dtype.
    assert lines["trainer.checkpoint.backend"] == "orbax" and lines["trainer.checkpoint.backend_settings"] == "{}"
    assert lines["trainer.metrics_writers[0].type"] == "jsonl" and lines["trainer.metrics_writers[1].type"] == "tensorboard"
    assert lines["tokenizer.type"] == "bytes"


def test_bad_override_is_one_line_and_exit_2():
    result = _axcore("train", "--set", "model.num_layres=2")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "num_layers" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "argv,pattern",
    [
        (["config", "missing.yaml"], "neither a file nor a built-in"),
        (["config", "default", "--set", "trainer.max_steps"], "PATH=VALUE"),
        (["config", "default", "--set", "plugins=[nosuch]"], "Unknown plugin 'nosuch'"),
        (["frobnicate"], "invalid choice"),
        (["tran"], "did you mean 'train'"),
        (["config", "default", "--set", "trainer.learner.optimizer.type=adamww"], "did you mean 'adamw'"),
        (["config", "default", "--set", "trainer.checkpoint.backend_settings.compres=true"], "did you mean 'compress'"),
        (["config"], "required"),
    ],
)
def test_errors_exit_2_with_one_line(argv, pattern, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and pattern in err


def test_plugins_lists_builtins(capsys):
    assert main(["plugins", "--all"]) == 0
    out = capsys.readouterr().out
    assert "axcore.layers.plugin" in out and "axcore_register_layers" in out and "built-in" in out
    assert "axcore.learning.plugin" in out and "axcore_register_optimizers" in out
    assert "axcore.trainer.plugin" in out and "axcore_register_loop_hooks" in out
    assert "plugin adds commands" in out or "Commands added by plugins" in out


@pytest.mark.slow
def test_compile_reports_cost(capsys):
    argv = ["compile", "default", "--set", "model.num_layers=1", "--set", "model.dim=32",
            "--set", "model.decoder.layer.feed_forward.hidden_dim=64", "--set", "input.seq_len=16"]
    assert main(argv) == 0
    # `key: value  (explanation)`: the value is the first word.
    lines = {k: v.split()[0] for k, v in (line.split(": ", 1) for line in capsys.readouterr().out.splitlines())}
    assert int(lines["parameters"]) > 0 and float(lines["compile_seconds"]) > 0
    assert int(lines["flops_per_step"]) > 0 and int(lines["peak_bytes_per_device"]) > 0
