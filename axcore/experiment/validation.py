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

import logging
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
    config_warnings,
    setting_problems,
    size_problems,
    walk,
)
from axcore.config.traversal import find, get_path, split_path
from axcore.data.mixture import check_components
from axcore.errors import AxcoreError, did_you_mean, one_line
from axcore.layers.pipeline import STAGE_AXIS
from axcore.layers.transformer import RepeatedTransformer
from axcore.params import ParameterSpec
from axcore.platform.mesh import CONTEXT_AXIS, DEFAULT_RULE, InstanceType, instance_platform
from axcore.platform.sharding import resolve_rules
from axcore.plugin.instance_probe import HARDWARE_PLATFORMS

logger = logging.getLogger(__name__)

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


def _mixture_problems(config: Any) -> list[str]:
    """An empty mixture, a component without a name or source, empty or repeated names (`check_components`)."""
    if config.input.mixture is None:
        return []
    try:
        check_components(config.input.mixture)
    except AxcoreError as e:
        return [one_line(e)]
    return []


def _instance_type_problem(config: Any) -> str | None:
    """An instance type of no known platform (cpu, gpu, tpu, neuron) that only the catch-all `default`
    mesh rule matched: a typo, or a platform whose hardware plugin is not installed."""
    instance_type = config.mesh.instance_type
    platform = instance_platform(instance_type)
    if platform is None or platform in ("cpu", *HARDWARE_PLATFORMS) or config.mesh.rule != DEFAULT_RULE.name:
        return None
    return (
        f"'mesh.instance_type' ('{instance_type}') names no known platform '{platform}'{did_you_mean(platform, ['cpu', *HARDWARE_PLATFORMS])}; "
        f"instance types read <platform>[-<device kind>]-<device count>, e.g. cpu-8, gpu-h100-8, tpu-v5p-64 "
        f"(platforms: cpu, {', '.join(HARDWARE_PLATFORMS)}, or one whose hardware plugin is installed)."
    )


def _mesh_sizes(config: Any) -> tuple[dict[str, int] | None, list[str]]:
    """`({axis: size}, [])` of the mesh on the instance type's devices (`cpu-8`: 8), or `(None, [problem])`
    when `mesh.mesh_shape` needs more devices than the type has (or a -1 cannot take the rest); `(None, [])`
    when the type names no device count. A shape of fewer devices passes: a program may lay the mesh over
    some of them (`Trainer(devices=...)`), and `axcore train` refuses it before compiling."""
    mesh = config.mesh
    count = InstanceType.parse(mesh.instance_type).count if mesh.instance_type else None
    if count is None or mesh.mesh_shape is None or mesh.mesh_axis_names is None:
        return None, []
    shape = list(mesh.mesh_shape)
    known = math.prod(d for d in shape if d != -1)
    if (-1 in shape and count % known) or (-1 not in shape and known > count):
        needs = f"a multiple of {known}" if -1 in shape else str(known)
        return None, [
            f"'mesh.mesh_shape' {list(mesh.mesh_shape)} needs {needs} devices, but instance type "
            f"'{mesh.instance_type}' has {count}; set mesh.mesh_shape to a shape of {count} devices (one -1 takes "
            f"the rest), or mesh.instance_type to the machine it is for."
        ]
    if -1 in shape:
        shape[shape.index(-1)] = count // known
    return dict(zip(mesh.mesh_axis_names, shape)), []


def _set_or_inherited(root: Any, path: str, field: str) -> int | None:
    """The int `field` of the node at `path` under `root`, else of its nearest ancestor that sets it (a parent
    fills its children's unset fields of the same name, e.g. a model's num_layers its decoder's), else None."""
    parts = split_path(path)
    for depth in range(len(parts), -1, -1):
        node = get_path(root, "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts[:depth]).lstrip("."))
        value = getattr(node, field, None) if isinstance(node, ConfigBase) and field in node.keys() else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _layout_problems(config: Any) -> list[str]:
    """What the mesh, batch, microbatches, pipelines and context axis must divide, on the instance type's devices.

    The batch is split over its mesh axes (logical axis `batch`), each device holding
    `rows = input.batch_size / shards` rows. Under a pipeline, gradient accumulation cuts
    every device's rows into `trainer.microbatches` and the schedule cuts the rows of each
    of those into its own `microbatches`, both per device (the split keeps each device's
    rows, `axcore.layers.pipeline.split_microbatches`; XLA's SPMD partitioner aborts on any
    other: 8 rows over data=2 x fsdp=2 into 4 microbatches does, into 2 trains). Without
    a pipeline, XLA reshards accumulation microbatches that do not divide the rows. A
    pipeline needs its stacked units to split into stages x repeats; the sequence is split
    over the `context` axis.
    """
    sizes, problems = _mesh_sizes(config)
    if sizes is None:
        return problems
    batch, accumulation = config.input.batch_size, config.trainer.microbatches
    axes = [a for a in resolve_rules(config.mesh.axis_rules).get("batch") or () if a in sizes]
    shards = math.prod(sizes[a] for a in axes)
    named = " x ".join(f"{a}={sizes[a]}" for a in axes) or "none"
    stages = sizes.get(STAGE_AXIS, 1)
    for path, node in find(config.model, RepeatedTransformer) if stages > 1 else ():
        if node.pipeline is None:
            continue
        if batch % shards:  # The train step refuses it before compiling (`check_batch_size`), with or without a pipeline.
            break
        rows = batch // shards
        if rows % accumulation:  # XLA reshards such accumulation microbatches, but not a pipeline's split of them.
            return [
                f"'trainer.microbatches' ({accumulation}) does not divide the {rows} rows each device holds "
                f"(input.batch_size {batch} / batch axes {named}), which a pipeline needs; use a divisor of {rows}, "
                f"or a batch size that is a multiple of {shards * accumulation}."
            ]
        rows //= accumulation
        where = f"model.{path}.pipeline" if path else "model.pipeline"
        schedule = node.pipeline.instantiate()
        micro, repeats = schedule.microbatches, schedule.repeats
        unit = node.layer.num_layers if "num_layers" in node.layer.keys() and isinstance(node.layer.num_layers, int) else 1
        layers = _set_or_inherited(config.model, path, "num_layers")
        units = layers // unit if layers is not None else None
        problems += [f"'{where}': {p} ({type(schedule).__name__}); change the schedule or the stage count."
                     for p in schedule.problems(stages)]
        if units is not None and units % (stages * repeats):
            problems.append(
                f"'{where}': the {units} stacked units do not split into {stages} stages ({STAGE_AXIS}={stages}) x "
                f"{repeats} repeats; use a layer count that is a multiple of {stages * repeats * unit}."
            )
        if rows % micro:
            problems.append(
                f"'{where}.microbatches' ({micro}) does not divide the {rows} rows each device holds per step "
                f"(input.batch_size {batch} / trainer.microbatches {accumulation} / batch axes {named}); use a "
                f"divisor of {rows}, or a batch size that is a multiple of {shards * accumulation * micro}."
            )
    context = sizes.get(CONTEXT_AXIS, 1)
    if config.input.seq_len % context:
        problems.append(
            f"'input.seq_len' ({config.input.seq_len}) is not divisible by the {CONTEXT_AXIS} axis ({context}) the "
            f"sequence is split over; use a multiple of {context} or change mesh.mesh_shape."
        )
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
    returns why its parameters cannot be held (`parameter_bytes_problem`), or None.

    The op environment names the experiment's platform (from its instance type), so
    kernels asked about the problems of parameters (e.g. a kernel's state) answer for it.
    """
    from axcore.kernels import op_environment

    instance_type = config.mesh.instance_type
    platform = instance_platform(instance_type)
    with op_environment(None, config.mesh.axis_rules, platform=platform, instance_type=instance_type, stand_in=False):
        specs = config.model.instantiate(name="model", registries=registries).parameter_specs()
    return parameter_bytes_problem(specs)


def parameter_bytes_problem(specs: Any) -> str | None:
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
    problems += _mixture_problems(config)
    problems += [p for p in [_instance_type_problem(config)] if p]
    problems += _kernel_problems(config, registries)
    if not problems:  # Divisibilities of sane values only.
        problems += _layout_problems(config)
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
    for warning in config_warnings(config):
        logger.warning("%s", warning)
