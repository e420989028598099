"""Walking, finding and replacing nodes of a config tree by dotted path.

Paths are dotted field names with list indices in brackets, e.g.
`model.decoder.layer[2].self_attention`. The root's path is "".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from axcore.config.base import ConfigBase, InstantiableConfig
from axcore.errors import ConfigError, NoMatchError

__all__ = [
    "find",
    "get_path",
    "is_config_of",
    "remove",
    "replace",
    "walk",
]

# A match is a class (a Configurable class matches configs whose klass subclasses
# it; a ConfigBase class matches its instances) or a predicate `(path, node) -> bool`.
Match = type | Callable[[str, ConfigBase], bool]


def join_path(prefix: str, name: str | int) -> str:
    """Appends a field name or list index to a dotted path."""
    if isinstance(name, int):
        return f"{prefix}[{name}]"
    return f"{prefix}.{name}" if prefix else name


def _children(value: Any) -> list[tuple[str | int, Any]]:
    if isinstance(value, ConfigBase):
        return list(value.items())
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    return []


def walk(cfg: ConfigBase, path: str = "") -> Iterator[tuple[str, Any]]:
    """Yields `(path, value)` for every node (configs, lists and leaves), pre-order."""
    yield path, cfg
    for name, value in _children(cfg):
        child_path = join_path(path, name)
        if isinstance(value, (ConfigBase, list, tuple)):
            yield from walk(value, child_path)
        else:
            yield child_path, value


def is_config_of(node: Any, target: type) -> bool:
    """Whether `node` is a config building `target` (or a subclass of it)."""
    if not isinstance(node, ConfigBase):
        return False
    if issubclass(target, ConfigBase):
        return isinstance(node, target)
    if isinstance(node, InstantiableConfig):
        built = node.target
        return inspect.isclass(built) and issubclass(built, target)
    return False


def _predicate(match: Match) -> Callable[[str, ConfigBase], bool]:
    if inspect.isclass(match):
        return lambda _path, node: is_config_of(node, match)
    return match


def find(cfg: ConfigBase, match: Match) -> list[tuple[str, ConfigBase]]:
    """All `(path, config)` nodes matching `match`, pre-order."""
    pred = _predicate(match)
    return [(p, v) for p, v in walk(cfg) if isinstance(v, ConfigBase) and pred(p, v)]


def replace(
    cfg: ConfigBase,
    match: Match,
    fn: Callable[[str, ConfigBase], ConfigBase],
    *,
    allow_no_match: bool = False,
) -> ConfigBase:
    """Returns a new tree in which every matching node is replaced by `fn(path, node)`.

    `fn` receives a private copy of the node and returns the config to put in its
    place (it may return the node after editing it). Nodes it returns are not
    searched again. The input tree is not modified.

    Raises:
        NoMatchError: if nothing matched and `allow_no_match` is False.
        ConfigError: if `fn` returns something that is not a config.
    """
    pred = _predicate(match)
    count = 0

    def visit(path: str, value: Any) -> Any:
        nonlocal count
        if isinstance(value, ConfigBase):
            if pred(path, value):
                count += 1
                new = fn(path, value)
                if not isinstance(new, ConfigBase):
                    raise ConfigError(
                        f"Replacement for config '{path or '<root>'}' returned "
                        f"{type(new).__name__}, not a config; return the new config."
                    )
                return new
            for name, child in value.items():
                new_child = visit(join_path(path, name), child)
                if new_child is not child:
                    object.__setattr__(value, name, new_child)
            return value
        if isinstance(value, (list, tuple)):
            items = [visit(join_path(path, i), v) for i, v in enumerate(value)]
            if any(a is not b for a, b in zip(items, value)):
                return type(value)(items)
            return value
        return value

    result = visit("", cfg.clone())
    if count == 0 and not allow_no_match:
        raise NoMatchError(
            f"Config replacement matched nothing ({_describe_match(match)}); check the "
            f"model uses the component, or pass allow_no_match=True."
        )
    return result


def remove(cfg: ConfigBase, match: Match, *, allow_no_match: bool = False) -> ConfigBase:
    """Returns a new tree in which every matching node's slot is set to None.

    Use it to empty an optional slot (e.g. drop an input position embedding when a
    feature moves positions into attention). The slot's field must accept None.

    Raises:
        NoMatchError: nothing matched and `allow_no_match` is False.
        ConfigTypeError: a matching node sits in a field that does not accept None.
    """
    pred = _predicate(match)
    result = cfg.clone()
    count = 0
    for path, node in list(walk(result)):
        if not path or not isinstance(node, ConfigBase) or not pred(path, node):
            continue
        parent_path, _, field = path.rpartition(".")
        if field.endswith("]"):
            raise ConfigError(f"Cannot remove list element '{path}'; replace the list instead.")
        parent = get_path(result, parent_path) if parent_path else result
        if getattr(parent, field) is node:  # Not already removed with an ancestor.
            setattr(parent, field, None)
            count += 1
    if count == 0 and not allow_no_match:
        raise NoMatchError(f"Config removal matched nothing ({_describe_match(match)}).")
    return result


def _describe_match(match: Match) -> str:
    return f"configs of {match.__name__}" if inspect.isclass(match) else "predicate"


def get_path(cfg: ConfigBase, path: str) -> Any:
    """The value at dotted `path` (raises UnknownFieldError with a suggestion)."""
    node: Any = cfg
    for token in split_path(path):
        node = node[token] if isinstance(token, int) else getattr(node, token)
    return node


def split_path(path: str) -> list[str | int]:
    """`'a.b[2].c'` -> `['a', 'b', 2, 'c']`."""
    tokens: list[str | int] = []
    for part in path.split(".") if path else []:
        name, _, rest = part.partition("[")
        if not name:
            raise ValueError(f"empty field name in path {path!r}")
        tokens.append(name)
        while rest:
            index, _, rest = rest.partition("]")
            tokens.append(int(index))
            rest = rest.lstrip("[")
    return tokens


