"""Config modifiers: the edits a mesh rule makes to an experiment's config.

A modifier is a callable `modifier(config) -> new config` over the experiment's
config (`ExperimentConfig`); it never edits its input, and it raises a
`ConfigError` (`NoMatchError` when its target matches nothing) naming itself and its
target. A mesh rule applies its modifiers in order, after the plugins' config
transforms (see `axcore.platform.mesh`). Modifiers set what they name over what the
experiment set (they are the layout's decisions), with two exceptions: explicit
`mesh.*` fields of the experiment win over the rule and its modifiers, and
`compute_dtype(..., override=False)` keeps dtypes the experiment set.

The built-in modifiers, by registered name (in YAML, `{type: NAME, ...arguments}`
entries of an experiment's `mesh_rules[i].modifiers`):

- `mesh_shape(shape, axis_names=None)`: `mesh.mesh_shape` (and the axis names).
- `remat(policy, paths)`: `remat_policy` of the layers whose module path matches
  `paths` (the outermost ones; for `none`, all): `none` (save every activation),
  `full` (`nothing_saveable`: keep only each layer's inputs) or `save_matmul_outputs`
  (`dots_with_no_batch_dims_saveable`: keep the outputs of weight matmuls and
  recompute the rest, attention scores included, since their matmuls are batched) or
  `offload_matmul_outputs` (`offload_dot_with_no_batch_dims(device,pinned_host)`: the
  same outputs, moved to host memory (`pinned_host`) after the forward pass and back
  for the backward; device memory as `full`, the recomputation as `save_matmul_outputs`;
  the backend must have a `pinned_host` memory kind: GPU and TPU do).
- `microbatches(count)`: `trainer.microbatches` (gradient accumulation).
- `attention_kernel(kernel, paths=".*")`: `kernels: {attention: KERNEL}` on the
  attention layers whose module path matches; KERNEL must be a registered
  attention kernel.
- `pipeline(schedule="gpipe", microbatches=4, repeats=None)`: `pipeline` of every
  scanned layer stack (`repeated_transformer`): the registered pipeline schedule
  `schedule` over the mesh's `stage` axis (`axcore.layers.pipeline`); `repeats` is
  the circular schedule's layer groups per stage.
- `chunked_loss(chunk_len)`: `model.loss_chunk_len` (the head and cross-entropy
  `chunk_len` positions at a time, never the `[batch, seq, vocab]` float32 logits).
- `compute_dtype(compute="bfloat16", params=None, override=True)`: the model's
  compute dtype; `params=None` leaves the parameter dtype (float32 master weights
  unless the experiment chose another).

`paths` is a regular expression that must fully match a module path such as
`model.decoder.layer0.feed_forward`, with or without the leading `model.`. One
config node builds every module of its kind (one `decoder.layer` config builds
layer0, layer1, ...), so a pattern must match all or none of the modules built from
one config. Plugins add modifiers with `axcore_register_config_modifiers` (a name
and a factory taking the YAML arguments); Python mesh rules put modifiers in
`MeshRule.config_modifiers`, e.g. `compute_dtype("bfloat16", override=False)`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from axcore.config import ConfigBase, DType, config_for_function, from_dict, get_path, walk
from axcore.config.base import coerce
from axcore.errors import AxcoreError, ConfigError, NoMatchError, UnknownComponentError, did_you_mean
from axcore.markers import hookimpl

# `remat` policy -> jax.checkpoint_policies name or factory call (`axcore.layers.base.checkpoint_policy`;
# None: no rematerialization).
REMAT_POLICIES = {
    "none": None,
    "full": "nothing_saveable",
    "save_matmul_outputs": "dots_with_no_batch_dims_saveable",
    "offload_matmul_outputs": "offload_dot_with_no_batch_dims(device,pinned_host)",
}
# Tags the config nodes of a probe copy of the model with their paths, so built modules lead back to them.
_ORIGIN = "_axcore_config_origin"


def _format(value: Any) -> str:
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_format(v) for v in value) + "]"
    return str(value)


@dataclasses.dataclass(frozen=True, eq=False)
class Modifier:
    """A named config modifier: `modifier(config, registries=None)` returns the new config."""

    # Registered name, e.g. "remat".
    name: str
    # Its arguments (for messages and `axcore config`).
    arguments: Mapping[str, Any]
    # fn(modifier, config, registries) -> the new config.
    fn: Callable[[Modifier, Any, Any], Any] | None = None

    def __str__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={_format(v)}' for k, v in self.arguments.items())})"

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, config: Any, registries: Any = None) -> Any:
        return self.fn(self, config, registries)


def apply_modifier(modifier: Callable[[Any], Any], config: Any, registries: Any = None) -> Any:
    """`modifier(config)`, giving a `Modifier` the registries (for kernel names and building the model)."""
    return modifier(config, registries) if isinstance(modifier, Modifier) else modifier(config)


def describe_modifier(modifier: Callable[[Any], Any]) -> str:
    """`remat(policy='full', paths='.*')` for a `Modifier`, else the callable's name."""
    return str(modifier) if isinstance(modifier, Modifier) else getattr(modifier, "__name__", repr(modifier))


def _field(modifier: Modifier, config: Any, path: str) -> Any:
    try:
        return get_path(config, path)
    except (AttributeError, AxcoreError):
        raise ConfigError(
            f"Config modifier {modifier}: the config ({type(config).__name__}) has no '{path}'; modifiers edit "
            f"an experiment config."
        ) from None


def _compile(modifier: Modifier, paths: str) -> re.Pattern:
    try:
        return re.compile(paths)
    except (re.error, TypeError) as e:
        raise ConfigError(f"Config modifier {modifier}: paths '{paths}' is not a regular expression: {e}.") from None


def _builtin_registries() -> Any:
    from axcore.plugin.loading import builtin_registries  # Deferred: the plugin manager imports this module.

    return builtin_registries()


def _modules(module: Any) -> Iterator[Any]:
    yield module
    for child in module.children.values():
        yield from _modules(child)


def _matches(pattern: re.Pattern, module_path: str) -> bool:
    """Whether `pattern` fully matches the path, with or without its root's name (`model.`)."""
    return bool(pattern.fullmatch(module_path) or pattern.fullmatch(module_path.partition(".")[2]))


def matching_configs(
    modifier: Modifier, config: Any, registries: Any, pattern: re.Pattern, kind: type, what: str, *, outermost: bool
) -> list[str]:
    """Config paths (e.g. `model.decoder.layer`) of the `kind` modules of `config.model` whose paths match.

    The model is built (modules hold no arrays) from a copy whose config nodes carry
    their paths, so each module leads back to the config it was built from. The root
    never counts. With `outermost`, a matching module inside another is left out.

    Raises:
        NoMatchError: the pattern matches no module, or no `kind` module.
        ConfigError: it matches some but not all of the modules built from one config.
    """
    probe = _field(modifier, config, "model").clone()
    for path, node in walk(probe, "model"):
        if isinstance(node, ConfigBase):
            object.__setattr__(node, _ORIGIN, path)
    try:
        root = probe.instantiate(name="model", registries=registries)
    except AxcoreError as e:
        raise ConfigError(f"Config modifier {modifier}: the model does not build, so no module path is known: {e}") from None
    modules = list(_modules(root))
    origin = {m.path: m._config.__dict__.get(_ORIGIN) for m in modules}
    matched = [m for m in modules if _matches(pattern, m.path)]
    if not matched:
        some = ", ".join(m.path for m in modules[:8])
        raise NoMatchError(f"Config modifier {modifier}: paths match no module of the model (modules: {some}, ...).")
    chosen = [m for m in matched if isinstance(m, kind) and m.parent is not None]
    if not chosen:
        kinds = [m.path for m in modules if isinstance(m, kind) and m.parent is not None][:4]
        raise NoMatchError(
            f"Config modifier {modifier}: paths match {', '.join(m.path for m in matched[:4])}, but no {what}"
            f"{' (' + what + 's: ' + ', '.join(kinds) + ', ...)' if kinds else '; the model has none'}."
        )
    if outermost:
        paths = {m.path for m in chosen}
        chosen = [m for m in chosen if not any(m.path.startswith(p + ".") for p in paths)]
    selected = {m.path for m in chosen}
    targets: list[str] = []
    for module in chosen:
        source = origin[module.path]
        if source is None:
            raise ConfigError(
                f"Config modifier {modifier}: module {module.path} is built by its parent, not from a config "
                f"of the experiment; match its parent instead."
            )
        siblings = [p for p, o in origin.items() if o == source]
        missing = [p for p in siblings if p not in selected]
        if missing:
            raise ConfigError(
                f"Config modifier {modifier}: paths match {module.path} but not {missing[0]}, built from the same "
                f"config '{source}'; match all of them (e.g. layer\\d+) or give each its own config (a list)."
            )
        if source not in targets:
            targets.append(source)
    return targets


# -- The built-in modifiers ---------------------------------------------------------------


def mesh_shape(shape: Sequence[int], axis_names: Sequence[str] | None = None) -> Modifier:
    """Sets `mesh.mesh_shape` (one -1 = all remaining devices) and, if given, `mesh.mesh_axis_names`."""
    arguments = {"shape": list(shape)} | ({} if axis_names is None else {"axis_names": list(axis_names)})
    this = Modifier("mesh_shape", arguments)
    shape = tuple(shape)
    if not shape or shape.count(-1) > 1 or any(d < 1 and d != -1 for d in shape):
        raise ConfigError(f"Config modifier {this}: shape must be positive sizes with at most one -1.")
    if axis_names is not None and len(axis_names) != len(shape):
        raise ConfigError(f"Config modifier {this}: shape and axis_names differ in length.")

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        mesh = _field(self, config, "mesh")
        names = tuple(axis_names) if axis_names is not None else mesh.mesh_axis_names
        if names is not None and len(names) != len(shape):
            raise ConfigError(
                f"Config modifier {self}: the mesh has axes {list(names)}, one per dimension of the shape; "
                f"give axis_names too."
            )
        new = config.clone()
        new.mesh.mesh_shape = shape
        if axis_names is not None:
            new.mesh.mesh_axis_names = tuple(axis_names)
        return new

    return dataclasses.replace(this, fn=fn)


def remat(policy: Literal["none", "full", "save_matmul_outputs", "offload_matmul_outputs"], paths: str) -> Modifier:
    """Sets `remat_policy` on the layers whose module path matches `paths` (see the module docstring)."""
    this = Modifier("remat", {"policy": policy, "paths": paths})
    if policy not in REMAT_POLICIES:
        raise ConfigError(f"Config modifier {this}: policy must be one of {list(REMAT_POLICIES)}{did_you_mean(str(policy), REMAT_POLICIES)}.")
    pattern = _compile(this, paths)
    value = REMAT_POLICIES[policy]

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        from axcore.layers.base import BaseLayer

        registries = registries if registries is not None else _builtin_registries()
        targets = matching_configs(self, config, registries, pattern, BaseLayer, "layer", outermost=value is not None)
        new = config.clone()
        for path in targets:
            get_path(new, path).remat_policy = value
        return new

    return dataclasses.replace(this, fn=fn)


def microbatches(count: int) -> Modifier:
    """Sets `trainer.microbatches`: each batch is split in `count` and their gradients accumulated."""
    this = Modifier("microbatches", {"count": count})
    if not isinstance(count, int) or count < 1:
        raise ConfigError(f"Config modifier {this}: count must be a positive integer.")

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        trainer = _field(self, config, "trainer")
        if "microbatches" not in trainer.keys():
            raise ConfigError(f"Config modifier {self}: the trainer config has no microbatches field.")
        batch_size = _field(self, config, "input.batch_size")
        if batch_size % count:
            raise ConfigError(
                f"Config modifier {self}: input.batch_size {batch_size} is not divisible into {count} microbatches."
            )
        new = config.clone()
        new.trainer.microbatches = count
        return new

    return dataclasses.replace(this, fn=fn)


def attention_kernel(kernel: str, paths: str = ".*") -> Modifier:
    """Forces attention kernel `kernel` (`kernels: {attention: ...}`) on the attention layers matching `paths`."""
    this = Modifier("attention_kernel", {"kernel": kernel, "paths": paths})
    pattern = _compile(this, paths)

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        from axcore.layers.attention import MultiheadAttention

        registries = registries if registries is not None else _builtin_registries()
        names = sorted(k.name for k in registries.kernels.candidates("attention"))
        if kernel not in names:
            raise UnknownComponentError(
                f"Config modifier {self}: no attention kernel named '{kernel}'{did_you_mean(kernel, names)}; "
                f"registered: {', '.join(names)}. Enable the plugin that provides it."
            )
        targets = matching_configs(self, config, registries, pattern, MultiheadAttention, "attention layer", outermost=False)
        new = config.clone()
        for path in targets:
            node = get_path(new, path)
            node.kernels = {**(node.kernels or {}), "attention": kernel}
            if "kernel" in node.keys() and node.kernel is not None:  # The layer's own `kernel` field would win over `kernels`.
                node.kernel = kernel
        return new

    return dataclasses.replace(this, fn=fn)


def pipeline(schedule: str = "gpipe", microbatches: int = 4, repeats: int | None = None) -> Modifier:
    """Sets `pipeline` of every scanned layer stack to the registered schedule `schedule` (module docstring)."""
    arguments = {"schedule": schedule, "microbatches": microbatches} | ({} if repeats is None else {"repeats": repeats})
    this = Modifier("pipeline", arguments)

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        from axcore.config.traversal import find
        from axcore.layers.transformer import RepeatedTransformer

        registries = registries if registries is not None else _builtin_registries()
        if schedule not in registries.pipeline_schedules:
            names = list(registries.pipeline_schedules)
            raise UnknownComponentError(
                f"Config modifier {self}: no pipeline schedule named '{schedule}'{did_you_mean(schedule, names)}; "
                f"registered: {', '.join(names)}."
            )
        stacks = [path for path, _ in find(_field(self, config, "model"), RepeatedTransformer)]
        if not stacks:
            raise NoMatchError(f"Config modifier {self}: the model has no scanned layer stack (repeated_transformer).")
        sched = registries.pipeline_schedules[schedule].default_config().set(microbatches=microbatches)
        if repeats is not None:
            if "repeats" not in sched.keys():
                raise ConfigError(f"Config modifier {self}: schedule '{schedule}' takes no repeats.")
            sched.repeats = repeats
        new = config.clone()
        for path in stacks:
            get_path(new.model, path).pipeline = sched.clone()
        return new

    return dataclasses.replace(this, fn=fn)


def chunked_loss(chunk_len: int) -> Modifier:
    """Sets `model.loss_chunk_len`: the model's head and cross-entropy computed `chunk_len` positions at a time."""
    this = Modifier("chunked_loss", {"chunk_len": chunk_len})
    if not isinstance(chunk_len, int) or isinstance(chunk_len, bool) or chunk_len < 1:
        raise ConfigError(f"Config modifier {this}: chunk_len must be a positive integer.")

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        model = _field(self, config, "model")
        if "loss_chunk_len" not in model.keys():
            raise ConfigError(
                f"Config modifier {self}: model config {model._label()} has no loss_chunk_len field; use a "
                f"causal_lm or drop this modifier."
            )
        new = config.clone()
        new.model.loss_chunk_len = chunk_len
        return new

    return dataclasses.replace(this, fn=fn)


def compute_dtype(compute: str = "bfloat16", params: str | None = None, override: bool = True) -> Modifier:
    """Sets `model.compute_dtype` (and `model.param_dtype` if `params`); override=False keeps ones the experiment set."""
    arguments = {"compute": compute} | ({} if params is None else {"params": params}) | ({} if override else {"override": False})
    this = Modifier("compute_dtype", arguments)
    try:
        dtypes = {"compute_dtype": coerce(compute, DType, "compute")}
        if params is not None:
            dtypes["param_dtype"] = coerce(params, DType, "params")
    except ConfigError as e:
        raise ConfigError(f"Config modifier {this}: {e}") from None

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        model = _field(self, config, "model")
        for name in dtypes:
            if name not in model.keys():
                raise ConfigError(
                    f"Config modifier {self}: model config {model._label()} has no {name} field; build the model "
                    f"from axcore layers or drop this modifier."
                )
        new = config.clone()
        for name, dtype in dtypes.items():
            if override or getattr(new.model, name) is None:
                setattr(new.model, name, dtype)
        return new

    return dataclasses.replace(this, fn=fn)


BUILTIN_MODIFIERS = {
    "mesh_shape": mesh_shape,
    "remat": remat,
    "microbatches": microbatches,
    "attention_kernel": attention_kernel,
    "chunked_loss": chunked_loss,
    "compute_dtype": compute_dtype,
    "pipeline": pipeline,
}


@hookimpl
def axcore_register_config_modifiers(register):
    for name, factory in BUILTIN_MODIFIERS.items():
        register(name, factory)


def build_modifier(spec: Any, registries: Any, path: str) -> Callable[[Any], Any]:
    """The modifier of a YAML entry `{type: NAME, ...arguments}`; every error names `path`.

    Arguments are checked against the registered factory's signature and annotations
    (an unknown one gets a "did you mean"), then the factory builds the modifier.
    """
    if not isinstance(spec, Mapping) or not isinstance(spec.get("type"), str):
        raise ConfigError(
            f"'{path}' must be a mapping whose 'type:' names a config modifier, e.g. "
            f"{{type: remat, policy: full, paths: '.*'}}; got {spec!r}."
        )
    family = registries.config_modifiers
    name = spec["type"]
    if name not in family:
        raise UnknownComponentError(
            f"'{path}.type': no config modifier named '{name}'{did_you_mean(name, family.names())}; registered: "
            f"{', '.join(family.names())}. Enable the plugin that provides it in `plugins:`."
        )
    factory = family[name]
    cfg = from_dict({k: v for k, v in spec.items() if k != "type"}, registries, config_for_function(factory), path=path)
    cfg.check_required(path)
    try:
        modifier = cfg.instantiate()
    except AxcoreError as e:
        raise ConfigError(f"'{path}': {e}") from None
    if not callable(modifier):
        raise ConfigError(f"'{path}': config modifier '{name}' built {modifier!r}, which is not callable.")
    return modifier
