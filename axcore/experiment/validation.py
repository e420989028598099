"""Checks of a resolved experiment, all at once, before anything is created on disk.

`validate_experiment` is the last step of `load_experiment`: every field's declared
range (`axcore.config.constraints`), every plugin's settings, the checks across
sections (a position table as long as a sequence, microbatches dividing the batch,
a tokenizer that fits the vocabulary), safe names and run directories, the
components the registries must know, and finally a dry build of the model (its
parameter shapes, nothing allocated) whose parameter bytes must fit the int64 range.
Every problem found is one line naming its config path;
`ConfigValidationError.problems` holds them all.

Sizes come first: `check_sizes` runs before the plugins' config transforms, so no
code sees a size past its declared bound (`axcore.config.Size`); everything that
is built in proportion to a size (configs per layer, the module tree, parameter
shapes) is built only after that.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from axcore.config import (
    ConfigBase,
    ConfigValidationError,
    InstantiableConfig,
    config_problems,
    setting_problems,
    size_problems,
    walk,
)
from axcore.errors import AxcoreError, did_you_mean, one_line
from axcore.params import ParameterSpec
from axcore.platform.mesh import instance_platform

# Directories a run directory may never be put under (kernel interfaces, not storage).
_FORBIDDEN_ROOTS = ("/proc", "/sys", "/dev")


# The largest byte count NumPy, JAX and XLA can hold (int64).
_MAX_BYTES = 2**63 - 1


def check_sizes(config: ConfigBase, settings: Mapping[str, ConfigBase | None]) -> None:
    """Raises ConfigValidationError if a size of the experiment or of a plugin's settings is out of bounds.

    What must hold before any code builds in proportion to a value (the plugins' config
    transforms): the `Size` bounds and the int64 range (`axcore.config.size_problems`).
    If one fails, the error lists every field problem of the untransformed tree
    (`config_problems`, no allocation), so the other bad values are not left for later.
    """
    trees = [(config, "")] + [(s, name) for name, s in settings.items() if s is not None]
    if any(size_problems(tree, path) for tree, path in trees):
        raise ConfigValidationError([p for tree, path in trees for p in config_problems(tree, path)])



def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def run_dir_problem(run_dir: str, path: str = "trainer.run_dir") -> str | None:
    """Why `run_dir` cannot hold a run, or None: a file, a kernel filesystem, no write access."""
    if "\x00" in run_dir or not run_dir.strip():
        return f"'{path}' must be a directory path, got {run_dir!r}."
    resolved = pathlib.Path(os.path.abspath(os.path.expanduser(run_dir)))
    if any(resolved == pathlib.Path(root) or pathlib.Path(root) in resolved.parents for root in _FORBIDDEN_ROOTS):
        return f"'{path}' ({run_dir}) lies under {', '.join(_FORBIDDEN_ROOTS)}; choose a directory on real storage."
    try:
        if resolved.exists() and not resolved.is_dir():
            return f"'{path}' ({run_dir}) exists and is not a directory; choose another path."
        existing = next((p for p in (resolved, *resolved.parents) if p.exists()), None)
    except OSError as e:  # E.g. a component longer than the filesystem allows (ENAMETOOLONG).
        return f"'{path}' ({_short(run_dir)}) is not a usable path ({e.strerror}); choose another path."
    if existing is None or not existing.is_dir():
        return f"'{path}' ({run_dir}): '{existing}' is not a directory; choose another path."
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"'{path}' ({run_dir}): no permission to write in '{existing}'; choose a writable directory."
    return None


def _cross_section_problems(config: Any, *, check_required: bool = True) -> list[str]:
    """Checks across the experiment's sections (each field's own range is checked before)."""
    problems = setting_problems(config, "model")  # Fields declared AtLeastSetting (e.g. a position table's max_len).
    for section in ("input", "tokenizer", "trainer") if check_required else ():  # Model fields: parents set some.
        for path, node in walk(getattr(config, section), section):
            if isinstance(node, InstantiableConfig) and node.missing_required():
                missing = ", ".join(f"'{path}.{name}'" for name in node.missing_required())
                problems.append(f"{missing} must be set ({node._label()} requires it).")
    micro = config.trainer.microbatches
    if micro >= 1 and config.input.batch_size >= 1 and config.input.batch_size % micro:
        problems.append(
            f"'input.batch_size' ({config.input.batch_size}) must be divisible by 'trainer.microbatches' ({micro})."
        )
    if config.trainer.run_dir is not None:
        problem = run_dir_problem(config.trainer.run_dir)
        if problem:
            problems.append(problem)
    return problems


def _kernel_problems(config: Any, registries: Any) -> list[str]:
    """Kernels forced by name (`kernels: {op: name}`, an attention layer's `kernel`) must be registered."""
    from axcore.config import is_config_of
    from axcore.layers.attention import MultiheadAttention

    kernels = registries.kernels
    problems = []
    for path, node in walk(config.model, "model"):
        if not isinstance(node, ConfigBase):
            continue
        forced = dict(node.kernels or {}) if "kernels" in node.keys() else {}
        if is_config_of(node, MultiheadAttention) and node.kernel is not None:
            forced[("attention", "kernel")] = node.kernel
        for key, name in forced.items():
            op, field = key if isinstance(key, tuple) else (key, f"kernels.{key}")
            try:
                names = sorted(k.name for k in kernels.candidates(op))
            except AxcoreError as e:
                problems.append(f"'{path}.{field}': {one_line(e)}")
                continue
            if name not in names:
                problems.append(
                    f"'{path}.{field}' names no '{op}' kernel '{name}'{did_you_mean(str(name), names)}; kernels: "
                    f"{', '.join(names)}. Enable the plugin that provides it in `plugins:`."
                )
    return problems


def _tokenizer_problem(config: Any) -> str | None:
    vocab = config.model.vocab_size if "vocab_size" in config.model.keys() else None
    tokenizer = config.tokenizer.instantiate()
    if isinstance(vocab, int) and tokenizer.vocab_size > vocab:
        return (
            f"'model.vocab_size' ({vocab}) is smaller than the tokenizer's {tokenizer.vocab_size} token ids "
            f"({type(tokenizer).__name__}); set model.vocab_size to at least {tokenizer.vocab_size}."
        )
    return None


def _dry_build(config: Any, registries: Any) -> str | None:
    """Builds the model and its parameter shapes (nothing allocated, JAX's backend not started);
    returns why its parameters cannot be held (`_parameter_bytes_problem`), or None.

    The op environment names the experiment's platform (from its instance type), so
    kernels asked about the problems of parameters (e.g. a kernel's state) answer for it.
    """
    from axcore.kernels import op_environment

    instance_type = config.mesh.instance_type
    platform = instance_platform(instance_type)
    with op_environment(None, config.mesh.axis_rules, platform=platform, instance_type=instance_type, stand_in=False):
        specs = config.model.instantiate(name="model", registries=registries).parameter_specs()
    return _parameter_bytes_problem(specs)


def _parameter_bytes_problem(specs: Any) -> str | None:
    """Why the parameters of `specs` (shapes and dtypes) cannot be held at all, or None.

    Counted in Python ints, which never overflow: every array's bytes and their sum must
    fit the int64 range. Whether they fit this machine is the trainer's memory check
    (`axcore.trainer.memory_check`); `axcore config` and `axcore compile` may describe a
    model for a larger one.
    """
    total, largest = 0, (0, "")
    for key_path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParameterSpec))[0]:
        size = math.prod(int(dim) for dim in spec.shape) * np.dtype(spec.dtype).itemsize
        total += size
        largest = max(largest, (size, jax.tree_util.keystr(key_path, simple=True, separator=".")))
    if total <= _MAX_BYTES:
        return None
    return (
        f"'model': its parameters need {total} bytes (the largest parameter, '{largest[1]}', {largest[0]}), more than the "
        f"int64 range ({_MAX_BYTES}) can count; lower model.dim, model.num_layers, model.vocab_size or the "
        f"widths of its layers."
    )


def validate_experiment(
    config: Any,
    settings: Mapping[str, ConfigBase | None],
    registries: Any,
    check_components: Callable[[], None],
) -> None:
    """Raises ConfigValidationError listing every problem of a resolved experiment.

    Args:
        config: the resolved `ExperimentConfig` (transformed, laid out on its mesh).
        settings: each enabled plugin's settings; problems name them `<plugin>.<field>`.
        registries: the plugin manager's registries (to build the model).
        check_components: raises an AxcoreError if a component the registries must
            know is wrong (optimizer, schedule, writers, checkpoint backend).
    """
    problems: list[str] = []
    # Problems raised as errors, by line: one problem alone is raised as its own error (its type kept).
    raised: dict[str, AxcoreError] = {}
    try:  # First: a component of the wrong kind makes its other problems noise.
        check_components()
        components_ok = True
    except AxcoreError as e:
        problems.append(one_line(e))
        raised[problems[-1]] = e
        components_ok = False
    problems += config_problems(config)
    for name, plugin_settings in settings.items():
        if plugin_settings is not None:
            problems += config_problems(plugin_settings, name)
    problems += _cross_section_problems(config, check_required=components_ok)
    problems += _kernel_problems(config, registries)
    if not problems:  # Building needs sane values: only once every field is in range.
        try:
            problem = _tokenizer_problem(config)
            if problem:
                problems.append(problem)
            problem = _dry_build(config, registries)
            if problem:
                problems.append(problem)
        except ConfigValidationError as e:
            problems += e.problems
        except AxcoreError as e:
            problems.append(one_line(e))
            raised[problems[-1]] = e
    if len(problems) == 1 and problems[0] in raised:
        raise raised[problems[0]]
    if problems:
        raise ConfigValidationError(problems)
