"""Typed registries that registration hooks fill.

Every entry remembers the plugin and distribution that registered it, so a name
conflict names both. A later registration with `override=True` replaces an earlier
one; two registrations of one name without exactly one override is an error.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from axcore.errors import DuplicateComponentError, PluginLoadError, UnknownComponentError, did_you_mean

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Who registered something: the plugin name and its distribution."""

    plugin: str
    distribution: str

    def __str__(self) -> str:
        return f"plugin '{self.plugin}' (distribution {self.distribution})"


@dataclasses.dataclass(frozen=True)
class Registration(Generic[T]):
    name: str
    value: T
    provenance: Provenance
    override: bool


class Registry(Generic[T]):
    """Name -> component of one kind (layers, checkpoint backends, ...)."""

    def __init__(self, kind: str, validate: Callable[[str, Any], str | None] | None = None):
        # Human-readable kind, e.g. "layer".
        self.kind = kind
        # Returns an error message if a value is not acceptable for this registry.
        self._validate = validate
        self._entries: dict[str, Registration[T]] = {}

    def register(self, name: str, value: T, provenance: Provenance, override: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise PluginLoadError(f"{provenance} registered a {self.kind} with invalid name {name!r}.")
        problem = self._validate(name, value) if self._validate else None
        if problem:
            raise PluginLoadError(f"{provenance} registered {self.kind} '{name}': {problem}.")
        new = Registration(name, value, provenance, override)
        old = self._entries.get(name)
        if old is not None:
            if old.override == override:
                raise DuplicateComponentError(
                    f"Two {self.kind}s named '{name}': one from {old.provenance}, one from "
                    f"{new.provenance}. Remove one plugin from `plugins:`, or have one pass "
                    f"override=True."
                )
            if old.override:
                return  # The explicit override stays.
        self._entries[name] = new

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, name: str) -> Registration[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownComponentError(
                f"No {self.kind} named '{name}'{did_you_mean(name, self._entries)}; "
                f"registered: {', '.join(self.names()) or 'none'}. Enable the plugin that "
                f"provides it in `plugins:`."
            ) from None

    def __getitem__(self, name: str) -> T:
        return self.entry(name).value

    def name_of(self, value: Any) -> str | None:
        for name, reg in self._entries.items():
            if reg.value is value:
                return name
        return None


def module_class_validator(base: type) -> Callable[[str, Any], str | None]:
    def validate(name: str, value: Any) -> str | None:
        if not (inspect.isclass(value) and issubclass(value, base)):
            return f"expected a subclass of {base.__name__}, got {value!r}"
        return None

    return validate


def instance_validator(kind: type) -> Callable[[str, Any], str | None]:
    def validate(name: str, value: Any) -> str | None:
        return None if isinstance(value, kind) else f"expected a {kind.__name__}, got {value!r}"

    return validate


class Registries:
    """All registries of one plugin manager. Also the config name `Resolver`.

    Configs can name components of the `layers`, `position_embeddings` and
    `data_sources` registries; one name may not appear in two of them.
    """

    def __init__(self):
        from axcore.config import Configurable
        from axcore.kernels.registry import KernelRegistry  # Cycle: kernels use the registry.
        from axcore.layers.position import PositionEmbedding
        from axcore.mesh import MeshRule
        from axcore.module import Module

        self.layers: Registry[type] = Registry("layer", module_class_validator(Module))
        self.position_embeddings: Registry[type] = Registry(
            "position embedding", module_class_validator(PositionEmbedding)
        )
        self.kernels = KernelRegistry()
        self.mesh_rules: Registry[Any] = Registry("mesh rule", instance_validator(MeshRule))
        self.checkpoint_backends: Registry[Any] = Registry("checkpoint backend", _callable)
        self.data_sources: Registry[type] = Registry("data source", module_class_validator(Configurable))

    def _component_registries(self) -> list[Registry]:
        return [self.layers, self.position_embeddings, self.data_sources]

    def lookup(self, name: str) -> Any:
        """The class a config's `type: <name>` refers to."""
        for registry in self._component_registries():
            if name in registry:
                return registry[name]
        names = sorted(n for r in self._component_registries() for n in r)
        raise UnknownComponentError(
            f"No component named '{name}'{did_you_mean(name, names)}; registered: "
            f"{', '.join(names)}. Enable the plugin that provides it in `plugins:`."
        )

    def name_of(self, target: Any) -> str | None:
        for registry in self._component_registries():
            name = registry.name_of(target)
            if name is not None:
                return name
        return None

    def check_component_names(self) -> None:
        """Raises if one config name is registered in two component registries."""
        registries = self._component_registries()
        for i, first in enumerate(registries):
            for second in registries[i + 1 :]:
                for name in sorted(set(first) & set(second)):
                    a, b = first.entry(name), second.entry(name)
                    raise DuplicateComponentError(
                        f"'{name}' is registered both as a {first.kind} by {a.provenance} and "
                        f"as a {second.kind} by {b.provenance}; config names must be unique."
                    )


def _callable(name: str, value: Any) -> str | None:
    return None if callable(value) else f"expected a callable factory, got {value!r}"
