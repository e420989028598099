"""Config trees to and from YAML, flat `path: value` dumps, and `path=value` overrides.

Components are written by their registered names (`type: linear`), never as import
paths; reading resolves names through a `Resolver` (the plugin manager's registries
implement it). YAML is read with a hardened `yaml.SafeLoader` only (`safe_load`,
see `axcore.config.safe_yaml`).

Reading merges onto a base tree: a mapping updates the fields it names and keeps
the rest, and a `type:` that differs from the base's starts from that component's
default config. A full dump read back onto nothing gives an equal tree.
"""

from __future__ import annotations

import enum
import inspect
import math
import types
import typing
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import yaml

from axcore.config import safe_yaml
from axcore.config.base import (
    REQUIRED,
    ConfigBase,
    InstantiableConfig,
    coerce,
    default_config_for,
)
from axcore.config.traversal import join_path, split_path
from axcore.errors import ConfigError, UnknownFieldError, did_you_mean

__all__ = [
    "Resolver",
    "apply_overrides",
    "dump_flat",
    "flatten",
    "from_dict",
    "from_yaml",
    "parse_override",
    "to_dict",
    "to_yaml",
]

TYPE_KEY = "type"


def safe_load(source: str | bytes, label: str = "<yaml>") -> Any:
    """Parses YAML with the hardened safe loader (no Python object construction).

    See `axcore.config.safe_yaml`: size, depth and alias-expansion limits, strict
    UTF-8 for bytes, duplicate keys refused, `1e-4` read as a float.

    Raises:
        YAMLInputError (a ConfigError): one line, `<label>: <problem>`.
    """
    return safe_yaml.load(source, label)


class Resolver(Protocol):
    """Maps registered component names to targets (classes/functions) and back."""

    def lookup(self, name: str, *, path: str | None = None, like: Any = None) -> Any:
        """The target registered as `name`; raises UnknownComponentError naming `path` and listing the names
        of the family of `like` (what the node built before), else every name."""

    def name_of(self, target: Any) -> str | None:
        """The name `target` is registered under, or None."""


def _name_of(node: InstantiableConfig, resolver: Resolver, path: str) -> str:
    name = resolver.name_of(node.target)
    if name is None:
        raise ConfigError(
            f"Config '{path or '<root>'}' builds {getattr(node.target, '__qualname__', node.target)}, "
            f"which is not a registered component; register it through a plugin hook to "
            f"write it to YAML."
        )
    return name


def _to_plain(value: Any, resolver: Resolver, path: str) -> Any:
    if isinstance(value, ConfigBase):
        return to_dict(value, resolver, path)
    if isinstance(value, (list, tuple)):
        return [_to_plain(v, resolver, join_path(path, i)) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _to_plain(v, resolver, join_path(path, k)) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, np.dtype):
        return value.name
    if value is REQUIRED:
        return "REQUIRED"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value) and resolver.name_of(value) is not None:
        return resolver.name_of(value)
    raise ConfigError(f"Config field '{path}' holds {value!r}, which cannot be written to YAML.")


def to_dict(cfg: ConfigBase, resolver: Resolver, path: str = "") -> dict[str, Any]:
    """The tree as plain YAML-safe data; instantiable nodes carry `type: <name>`.

    Fields still REQUIRED are omitted (a parent usually sets them, e.g. input_dim).
    """
    out: dict[str, Any] = {}
    if isinstance(cfg, InstantiableConfig):
        out[TYPE_KEY] = _name_of(cfg, resolver, path)
    for name, value in cfg.items():
        if value is not REQUIRED:  # Unset required fields are left out; reading keeps them unset.
            out[name] = _to_plain(value, resolver, join_path(path, name))
    return out


def to_yaml(cfg: ConfigBase, resolver: Resolver) -> str:
    """YAML text of the tree (field declaration order)."""
    return yaml.safe_dump(to_dict(cfg, resolver), sort_keys=False, width=math.inf)


def _config_classes(tp: Any) -> list[type]:
    """ConfigBase subclasses an annotation admits (through Optional, unions, lists)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType or origin in (list, tuple, Sequence):
        return [c for a in typing.get_args(tp) for c in _config_classes(a)]
    if inspect.isclass(tp) and issubclass(tp, ConfigBase):
        return [tp]
    return []


def from_dict(
    data: Any,
    resolver: Resolver,
    base: ConfigBase | None = None,
    *,
    path: str = "",
    annotation: Any = None,
    errors: list[ConfigError] | None = None,
) -> ConfigBase:
    """Builds a config from `data`, merged onto a copy of `base` if given.

    With `errors`, a field that cannot be merged (unknown, wrong type, unknown
    component, at any depth) appends its error there and leaves the field as it was,
    and the merge goes on with the next one, so one pass finds every bad key of a
    file; `axcore.config.raise_collected(errors)` then raises them together.

    Raises:
        UnknownFieldError / ConfigTypeError / UnknownComponentError: naming the
            dotted path of the offending entry (the first one, unless `errors` is given).
    """
    where = path or "<root>"
    if not isinstance(data, dict):
        raise ConfigError(f"Config '{where}' must be a mapping, got {type(data).__name__} {data!r}.")
    data = dict(data)
    type_name = data.pop(TYPE_KEY, None)
    if type_name is not None:
        if not isinstance(type_name, str):
            raise ConfigError(f"Config '{where}.type' must be a registered name, got {type_name!r}.")
        target = resolver.lookup(type_name, path=where, like=getattr(base, "target", None))
        if isinstance(base, InstantiableConfig) and base.target is target:
            node = base.clone()
        else:
            node = default_config_for(target)
    elif base is not None:
        node = base.clone()
    else:
        concrete = [c for c in _config_classes(annotation) if not issubclass(c, InstantiableConfig)]
        if len(concrete) != 1:
            raise ConfigError(
                f"Config '{where}' needs a 'type:' naming a registered component."
            )
        node = concrete[0]()
    for key, value in data.items():
        try:
            _merge_field(node, key, value, resolver, join_path(path, key), errors)
        except ConfigError as e:
            if errors is None:
                raise
            errors.append(e)
    return node


def _merge_field(
    node: ConfigBase, key: Any, value: Any, resolver: Resolver, path: str, errors: list[ConfigError] | None
) -> None:
    fields = node.keys()
    if key not in fields:
        raise UnknownFieldError(
            f"Unknown config field '{path}'{did_you_mean(str(key), fields)}; "
            f"{node._label()} has: {', '.join(fields)}."
        )
    annotation = type(node).field_types()[key]
    current = node.__dict__[key]
    config_like = bool(_config_classes(annotation)) or isinstance(current, ConfigBase)
    if config_like and isinstance(value, dict) and not _is_index_map(value):
        base = current if isinstance(current, ConfigBase) else None
        value = from_dict(value, resolver, base, path=path, annotation=annotation, errors=errors)
    elif config_like and isinstance(value, list):
        value = [
            _list_item(item, current, i, resolver, join_path(path, i), annotation, errors)
            for i, item in enumerate(value)
        ]
    elif isinstance(value, dict) and _is_index_map(value) and isinstance(current, (list, tuple)):
        value = _update_items(current, value, resolver, path, annotation, errors)
    object.__setattr__(node, key, coerce(value, annotation, path))


def _is_index_map(value: dict) -> bool:
    return bool(value) and all(isinstance(k, int) and not isinstance(k, bool) for k in value)


def _list_item(item, current, index, resolver, path, annotation, errors):
    if not isinstance(item, dict):
        return item
    if isinstance(current, (list, tuple)) and index < len(current):
        base = current[index]
    else:
        base = current if isinstance(current, ConfigBase) else None
    return from_dict(item, resolver, base, path=path, annotation=_item_annotation(annotation), errors=errors)


def _item_annotation(annotation):
    for arg in typing.get_args(annotation) or ():
        if typing.get_origin(arg) in (list, tuple, Sequence):
            return typing.get_args(arg)[0]
    return annotation


def _update_items(current, updates: dict, resolver, path, annotation, errors):
    items = list(current)
    for index, update in updates.items():
        if not 0 <= index < len(items):
            raise ConfigError(f"Config '{path}[{index}]' is out of range (length {len(items)}).")
        item_path = join_path(path, index)
        if isinstance(update, dict) and isinstance(items[index], ConfigBase):
            items[index] = from_dict(update, resolver, items[index], path=item_path, errors=errors)
        else:
            items[index] = update
    return type(current)(items)


def from_yaml(text: str, resolver: Resolver, base: ConfigBase | None = None) -> ConfigBase:
    """Parses YAML (safe loader) into a config merged onto `base`."""
    try:
        data = safe_load(text)
    except safe_yaml.YAMLInputError as e:
        raise safe_yaml.YAMLInputError("Invalid YAML", e.problem) from None
    return from_dict(data if data is not None else {}, resolver, base)


def flatten(cfg: ConfigBase, resolver: Resolver) -> list[tuple[str, Any]]:
    """`(path, plain value)` for every leaf; instantiable nodes give a `path.type` entry."""
    out: list[tuple[str, Any]] = []

    def visit(path: str, value: Any) -> None:
        if isinstance(value, ConfigBase):
            if isinstance(value, InstantiableConfig):
                out.append((join_path(path, TYPE_KEY), _name_of(value, resolver, path)))
            for name, child in value.items():
                visit(join_path(path, name), child)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, ConfigBase) for v in value):
            for i, child in enumerate(value):
                visit(join_path(path, i), child)
        else:
            out.append((path, _to_plain(value, resolver, path)))

    visit("", cfg)
    return out


def format_value(value: Any) -> str:
    """A leaf as it appears after `path: ` in a flat dump (YAML flow style)."""
    text = yaml.safe_dump([value], default_flow_style=True, width=math.inf).strip()
    return text[1:-1]  # Strip the wrapping list's brackets.


def dump_flat(cfg: ConfigBase, resolver: Resolver) -> str:
    """One `path: value` line per leaf, in declaration order; stable across runs."""
    return "".join(f"{path}: {format_value(value)}\n" for path, value in flatten(cfg, resolver))


def parse_override(text: str) -> tuple[str, Any]:
    """`'model.num_layers=2'` -> `('model.num_layers', 2)`; the value is YAML-typed."""
    path, sep, raw = text.partition("=")
    path = path.strip()
    if not sep or not path:
        raise ConfigError(f"Override '{text}' must look like PATH=VALUE, e.g. model.num_layers=2.")
    value = safe_load(raw, label=f"--set {path}") if raw.strip() else None
    return path, value


def nest_path(path: str, value: Any) -> dict:
    """`('a.b[1]', v)` -> `{'a': {'b': {1: v}}}` (the form `from_dict` merges)."""
    try:
        tokens = split_path(path)
    except ValueError as e:
        raise ConfigError(f"Override path '{path}' is malformed; use a.b[0].c.") from e
    nested: Any = value
    for token in reversed(tokens):
        nested = {token: nested}
    return nested


def apply_overrides(cfg: ConfigBase, overrides: Sequence[str], resolver: Resolver) -> ConfigBase:
    """Returns a new tree with `PATH=VALUE` overrides applied, validated like YAML."""
    for text in overrides:
        path, value = parse_override(text)
        cfg = from_dict(nest_path(path, value), resolver, cfg)
    return cfg
