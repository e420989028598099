"""`axcore new-plugin NAME --kind KIND`: write a complete, installable plugin package.

The package (directory `axcore-NAME` with each `_` of NAME written `-`, the
distribution's name, e.g. `axcore-my-feature` for `my_feature`, unless given) holds a `pyproject.toml` with the
`axcore` entry point `NAME = "axcore_NAME.plugin"`, the module `axcore_NAME/plugin.py`
with the hook implementations of its kind, a README, and tests that run axcore's
conformance suites and fixtures (`axcore.testing`). Kinds:

- feature: settings and a config transform (a working example to replace: a sliding
  attention window on every attention layer);
- hardware: a mesh rule and XLA flags for `NAME-N` instance types;
- kernel: an `attention` kernel, forced by name (`kernel: NAME` on an attention layer);
- checkpoint: a checkpoint backend, `trainer.checkpoint.backend: NAME`;
- objective: a training objective, `trainer.objective: {type: NAME}` (a working example
  to replace: label-smoothed cross-entropy);
- data_source: a data source, `input.source: {type: NAME}` (a working example to
  replace: arithmetic exercises made up from a seed).

Freshly generated, `pip install -e DIR` and `pytest DIR` pass as they are. Nothing in
the package says what the plugin is for: its one-line description (in
`pyproject.toml`, the README and the package docstring) is a TODO built from the
name, which the README tells the author to fill.
"""

from __future__ import annotations

import keyword
import os
import re
import string

from axcore.cli.new_plugin_training import TRAINING_PLUGINS
from axcore.errors import AxcoreError

KINDS = ("feature", "hardware", "kernel", "checkpoint", "objective", "data_source")
_NAME = re.compile(r"[a-z][a-z0-9_]*")


class ScaffoldError(AxcoreError):
    """`axcore new-plugin` cannot write the package (bad name, existing directory)."""


PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "$summary"
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["axcore"]

[project.optional-dependencies]
test = ["pytest>=8"]

[project.entry-points.axcore]
$name = "$package.plugin"

[tool.setuptools]
packages = ["$package"]

[tool.pytest.ini_options]
testpaths = ["tests"]
# The plugin under test for axcore's pytest fixtures (axcore_plugin_manager, ...).
axcore_plugin = "$name"
"""

README = """\
# $dist

$summary

TODO: replace the line above with what the plugin does, in one line (it is also the
`description` in `pyproject.toml` and the docstring of `$package/__init__.py`).

An axcore plugin of kind `$kind`. Install it next to axcore and list it in an
experiment:

```bash
pip install -e .
$usage
```

Test it with axcore's conformance suites and fixtures (`axcore.testing`):

```bash
pytest
```
"""

INIT = '''\
"""$summary"""
'''

PLUGINS = {
    "feature": (
        "$Title: an axcore feature plugin (TODO: say what it does, in one line).",
        "printf 'plugins: [$name]\\n$name: {window: 16}\\n' > exp.yaml && axcore train exp.yaml",
        '''\
"""The `$name` plugin. TODO: say what it does.

The code below is a working example to replace: a setting, and a config transform
that puts it into every attention layer (here, a sliding attention window of
`window` tokens). Settings (`$name:` in an experiment file) are the fields of
`Settings`:

    plugins: [$name]
    $name: {window: 16}
"""

from __future__ import annotations

from typing import Annotated

from axcore import ConfigBase, hookimpl
from axcore.config import Positive, replace
from axcore.layers import MultiheadAttention


class Settings(ConfigBase):
    """Settings of the $name plugin (the experiment's `$name:` section)."""

    # Example setting: tokens each query attends to (itself and the ones before it).
    window: Annotated[int, Positive] = 16


@hookimpl
def axcore_settings_config():
    """Declares the `$name:` section of an experiment file."""
    return Settings()


@hookimpl
def axcore_transform_config(config, settings):
    """Sets `sliding_window` on every attention layer; applying it twice gives the same config."""
    return replace(config, MultiheadAttention, lambda _path, attention: attention.set(sliding_window=settings.window))
''',
        '''\
"""The $name plugin against axcore's config-transform suite, and a few training steps."""

from axcore.config import find
from axcore.layers import MultiheadAttention
from axcore.testing import ConfigTransformConformance


class TestTransform(ConfigTransformConformance):
    plugin = "$name"
    targets = MultiheadAttention


def test_settings_reach_every_attention_layer(axcore_tiny_experiment):
    experiment = axcore_tiny_experiment(["$name.window=5"])
    layers = find(experiment.config, MultiheadAttention)
    assert layers and all(attention.sliding_window == 5 for _, attention in layers)


def test_trains(axcore_tiny_experiment, axcore_train_steps):
    losses = axcore_train_steps(axcore_tiny_experiment(), steps=3)
    assert losses[-1] < losses[0]
''',
    ),
    "hardware": (
        "Mesh rules and XLA flags for $name-N instance types.",
        "axcore config default --mesh-selector $name-8 --set plugins=[$name]",
        '''\
"""The `$name` hardware plugin: a mesh rule and XLA flags for `$name-N` instance types.

Register kernels for the hardware here too (`axcore_register_attention_kernels`,
`axcore_register_kernels`), and say in `axcore_probe_instance_type` whether this
machine has it, so the plugin autoloads there.
"""

from __future__ import annotations

import re

from axcore import hookimpl
from axcore.platform.mesh import MeshRule

# Instance types of this hardware: `$name-8` is 8 devices.
INSTANCE_TYPE = r"$name-\\d+"


def mesh_rules() -> list[MeshRule]:
    """Data parallelism over every device: the batch split over mesh axis `data`."""
    return [MeshRule("$name", INSTANCE_TYPE, (-1,), ("data",), {"batch": "data"}, priority=10)]


@hookimpl
def axcore_register_mesh_rules(register):
    """Registers the rules of `mesh_rules()`."""
    for rule in mesh_rules():
        register(rule)


@hookimpl
def axcore_xla_flags(instance_type):
    """XLA flags for this hardware's instance types (None for others)."""
    if re.fullmatch(INSTANCE_TYPE, instance_type) is None:
        return None
    return {"xla_cpu_enable_fast_math": "false"}


@hookimpl
def axcore_probe_instance_type():
    """This machine's instance type if it has the hardware (read files, never start JAX); None here."""
    return None
''',
        '''\
"""The $name hardware plugin: its mesh rule and flags, through a plugin manager with just it."""

from $package.plugin import INSTANCE_TYPE


def test_mesh_rule_matches_its_instance_types(axcore_registries):
    rule = axcore_registries.mesh_rules["$name"]
    assert rule.instance_type == INSTANCE_TYPE
    assert rule.matches("$name-8") and not rule.matches("cpu-8")


def test_xla_flags_only_for_its_instance_types(axcore_plugin_manager):
    assert axcore_plugin_manager.xla_flags("$name-8") == {"xla_cpu_enable_fast_math": "false"}
    assert axcore_plugin_manager.xla_flags("cpu-8") == {}
''',
    ),
    "kernel": (
        "An attention kernel in jax.numpy, chosen with `kernel: $name` on an attention layer.",
        "axcore train --set model.decoder.layer.self_attention.kernel=$name --set plugins=[$name]",
        '''\
"""The `$name` plugin: an `attention` kernel (layouts in `axcore.kernels.attention`).

Registered below the reference kernel's priority (0), so it runs where a layer names
it (`kernel: $name` on an attention layer, or `kernels: {attention: $name}`); raise
the priority once it is faster than the reference where it supports a problem.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axcore import hookimpl
from axcore.kernels import SUPPORTED, Support, causal_mask, sliding_window_mask, unknown_extras


class ${Class}Attention:
    """softmax(scale q.k, masked) v with GQA, causal and sliding-window masks and key padding."""

    name = "$name"
    priority = -1

    def is_supported(self, problem) -> Support:
        """Declines, with the reason, every capability this kernel does not implement."""
        if problem.num_heads % problem.num_kv_heads:
            return Support(False, "num_heads must be a multiple of num_kv_heads")
        declined = [
            (problem.has_segment_ids, "segment ids"),
            (problem.softcap is not None, "logit soft-capping"),
            (problem.dropout_rate > 0.0, "attention dropout"),
            (problem.bias_slopes is not None or problem.bias_fn is not None, "position biases"),
            (problem.has_bias, "a dense bias"),
        ]
        for present, what in declined:
            if present:
                return Support(False, f"does not implement {what}")
        support = unknown_extras(problem)
        return support if not support else SUPPORTED

    def __call__(self, problem, q, k, v, *, kv_mask=None, **unused):
        """q `[b, t, n, h]`, k and v `[b, s, kv, h]`, kv_mask `[b, s]` -> `[b, t, n, h]` in q's dtype."""
        group = problem.num_heads // problem.num_kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # Head n reads kv head n // group.
        logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * problem.scale
        allowed = jnp.ones((1, 1, problem.q_len, problem.kv_len), bool)
        if problem.causal:
            allowed = allowed & causal_mask(problem.q_len, problem.kv_len)
        if problem.sliding_window is not None:
            allowed = allowed & sliding_window_mask(problem.q_len, problem.kv_len, problem.sliding_window)
        if kv_mask is not None:
            allowed = allowed & kv_mask[:, None, None, :].astype(bool)
        logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.einsum("bnts,bsnh->btnh", probs, v)


@hookimpl
def axcore_register_attention_kernels(register):
    """Registers the kernel for the `attention` op."""
    register(${Class}Attention())
''',
        '''\
"""The $name kernel against axcore's attention suite (the formula in float64, forward and gradients)."""

from axcore.testing import AttentionKernelConformance

from $package.plugin import ${Class}Attention


class TestKernel(AttentionKernelConformance):
    kernel = ${Class}Attention()


def test_is_registered_for_the_attention_op(axcore_registries):
    assert "$name" in [k.name for k in axcore_registries.kernels.candidates("attention")]
''',
    ),
    "checkpoint": (
        "A checkpoint backend, selected with `trainer.checkpoint.backend: $name`.",
        "axcore train --set trainer.checkpoint.backend=$name --set plugins=[$name]",
        '''\
"""The `$name` plugin: a checkpoint backend (the protocol: `axcore.checkpoint.CheckpointBackend`).

It starts as axcore's tensorstore backend with its own name and defaults; replace
`factory`'s body with your own backend. Whatever it writes, a step must count only
once its commit marker exists (`COMMIT_MARKER`, which the tests remove to simulate an
interrupted save).
"""

from __future__ import annotations

import os

from axcore import hookimpl
from axcore.checkpoint import CheckpointBackend, TensorStoreBackend

# A step's commit marker, relative to the checkpoint directory.
COMMIT_MARKER = "step_{step:08d}/COMMITTED"


def factory(directory: str | os.PathLike, *, keep_last_n: int | None = 3, async_save: bool = True) -> CheckpointBackend:
    """A backend writing checkpoints of one run under `directory`."""
    return TensorStoreBackend(directory, keep_last_n=keep_last_n, async_save=async_save)


@hookimpl
def axcore_register_checkpoint_backends(register):
    """Registers `factory` as backend `$name`."""
    register("$name", factory)
''',
        '''\
"""The $name backend against axcore's checkpoint suite."""

from axcore.testing import CheckpointBackendConformance

from $package.plugin import COMMIT_MARKER


class TestBackend(CheckpointBackendConformance):
    backend = "$name"
    plugins = ["$name"]
    commit_marker = COMMIT_MARKER
''',
    ),
    **TRAINING_PLUGINS,
}


def check_name(name: str) -> None:
    """Raises ScaffoldError unless `name` is a lowercase Python identifier (the entry-point name)."""
    if not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise ScaffoldError(
            f"Plugin name {name!r} is not a lowercase Python identifier (letters, digits, '_', starting "
            f"with a letter, e.g. 'my_feature'); choose another name."
        )


def default_directory(name: str) -> str:
    """The directory `new_plugin` writes into by default: the distribution's name, `axcore-my-feature` for `my_feature`."""
    return "axcore-" + name.replace("_", "-")


def new_plugin(name: str, kind: str = "feature", directory: str | os.PathLike | None = None) -> list[str]:
    """Writes the package of plugin `name` of `kind` into `directory` (default `default_directory(name)`).

    Returns the paths written. Raises ScaffoldError for a bad name or kind, or an
    existing directory (nothing is overwritten).
    """
    check_name(name)
    if kind not in PLUGINS:
        raise ScaffoldError(f"Unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}.")
    dist = default_directory(name)
    root = os.path.abspath(directory if directory is not None else dist)
    if os.path.exists(root):
        raise ScaffoldError(f"{root} exists already; choose a new directory (--directory) or remove it.")
    summary, usage, plugin, tests = PLUGINS[kind]
    fields = {
        "name": name,
        "dist": dist,
        "kind": kind,
        "package": f"axcore_{name}",
        "Class": "".join(part.capitalize() for part in name.split("_")),
        "Title": name.replace("_", " ").capitalize(),
    }
    fields["summary"] = string.Template(summary).substitute(fields)
    fields["usage"] = string.Template(usage).substitute(fields)
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"axcore_{name}/__init__.py": INIT,
        f"axcore_{name}/plugin.py": plugin,
        f"tests/test_{name}.py": tests,
    }
    written = []
    for relative, template in files.items():
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(string.Template(template).substitute(fields))
        written.append(path)
    return written


def run(args) -> int:
    for path in new_plugin(args.name, args.kind, args.directory):
        print(path)
    return 0
