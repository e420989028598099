"""Registry families: typed name -> component maps that registration hooks fill.

A *family* (layers, ops, kernels, optimizers, ...) is declared by the registration
hookspec that fills it: `@registers(Family(...))` on the spec in `axcore/plugin/hookspecs.py`
(or on a plugin's own hookspec, added through `axcore_add_hookspecs`). The plugin
manager builds one `Registries` object per manager from those declarations, so a new
family is a new hookspec and nothing else.

Every entry remembers the plugin and distribution that registered it, so a name
conflict names both. A registration with `override=True` replaces one without; two
registrations of one name without exactly one override is an error.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from axcore.errors import DuplicateComponentError, PluginLoadError, UnknownComponentError, did_you_mean

T = TypeVar("T")

# validate(name, value) -> an error message, or None if `value` is acceptable.
Validator = Callable[[str, Any], "str | None"]


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
    """Name -> component of one family (layers, checkpoint backends, ...)."""

    def __init__(self, kind: str, validate: Validator | None = None):
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

    def register_callback(self, provenance: Provenance) -> Callable[..., None]:
        """The `register` argument a registration hook receives: `register(name, value, *, override=False)`."""

        def register(name: str, value: T, *, override: bool = False) -> None:
            self.register(name, value, provenance, override)

        return register

    def finalize(self, registries: Registries) -> None:
        """Checks entries against other families once every plugin has registered."""

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, name: str) -> Registration[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownComponentError(
                f"No {self.kind} named '{name}'{did_you_mean(str(name), self._entries)}; "
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


class NamedRegistry(Registry[T]):
    """A registry whose values carry their own `name` attribute: `register(value, *, override=False)`."""

    def register_callback(self, provenance: Provenance) -> Callable[..., None]:
        def register(value: T, *, override: bool = False) -> None:
            self.register(getattr(value, "name", None), value, provenance, override)

        return register


@dataclasses.dataclass(frozen=True)
class Family:
    """A registry family, declared on the registration hookspec that fills it."""

    # Attribute name on `Registries`, e.g. "layers".
    name: str
    # Human-readable kind of one entry, e.g. "layer".
    kind: str
    # Checks each registered value; None accepts anything.
    validate: Validator | None = None
    # Whether configs may name entries with `type: <name>` (one namespace across such families).
    config_names: bool = False
    # Builds the empty registry: `registry_class(kind, validate)`.
    registry_class: type[Registry] = Registry

    def create(self) -> Registry:
        return self.registry_class(self.kind, self.validate)


@dataclasses.dataclass(frozen=True)
class FamilyHook:
    """What `@registers` attaches to a registration hookspec."""

    family: Family
    # callback(registry, provenance) -> the `register` argument; None = the registry's own.
    callback: Callable[[Registry, Provenance], Callable[..., None]] | None = None


FAMILY_ATTRIBUTE = "axcore_family"


def registers(family: Family, callback: Callable[[Registry, Provenance], Callable[..., None]] | None = None):
    """Declares that the decorated registration hookspec fills `family`.

    Two hookspecs may fill one family (pass the same `Family` object); `callback`
    adapts the `register` signature for one of them.
    """

    def mark(spec: Callable) -> Callable:
        setattr(spec, FAMILY_ATTRIBUTE, FamilyHook(family, callback))
        return spec

    return mark


def family_hook(spec_function: Any) -> FamilyHook | None:
    """The family declaration of a hookspec function, or None."""
    return getattr(spec_function, FAMILY_ATTRIBUTE, None)


def module_class_validator(base: type) -> Validator:
    """Accepts subclasses of `base`."""

    def validate(name: str, value: Any) -> str | None:
        if not (inspect.isclass(value) and issubclass(value, base)):
            return f"expected a subclass of {base.__name__}, got {value!r}"
        return None

    return validate


def instance_validator(kind: type) -> Validator:
    """Accepts instances of `kind` (a class or a runtime-checkable Protocol)."""

    def validate(name: str, value: Any) -> str | None:
        return None if isinstance(value, kind) else f"expected a {kind.__name__}, got {value!r}"

    return validate


def callable_validator(name: str, value: Any) -> str | None:
    """Accepts any callable."""
    return None if callable(value) else f"expected a callable, got {value!r}"


class Registries:
    """All registry families of one plugin manager. Also the config name `Resolver`.

    `registries.layers`, `registries.kernels`, ... are the families declared by the
    registration hookspecs; `registries.family(name)` is the same by name. Configs
    name components of the families declared with `config_names=True`; one name
    may not appear in two of them.
    """

    def __init__(self, families: Iterable[Family]):
        self._families: dict[str, Family] = {}
        self._registries: dict[str, Registry] = {}
        for family in families:
            if family.name in self._families:
                if self._families[family.name] is not family:
                    raise PluginLoadError(
                        f"Two different registry families are named '{family.name}'; rename one."
                    )
                continue
            self._families[family.name] = family
            self._registries[family.name] = family.create()

    def __getattr__(self, name: str) -> Registry:
        registries = self.__dict__.get("_registries", {})
        if name in registries:
            return registries[name]
        raise AttributeError(
            f"No registry family '{name}'{did_you_mean(name, registries)}; families: {', '.join(sorted(registries))}."
        )

    def family(self, name: str) -> Registry:
        """The registry of family `name`."""
        try:
            return self._registries[name]
        except KeyError:
            raise UnknownComponentError(
                f"No registry family '{name}'{did_you_mean(name, self._registries)}; families: "
                f"{', '.join(sorted(self._registries))}. Install the plugin that declares it."
            ) from None

    def families(self) -> list[Family]:
        return list(self._families.values())

    def finalize(self) -> None:
        """Cross-family checks once every plugin has registered."""
        for registry in self._registries.values():
            registry.finalize(self)
        self.check_component_names()

    def _component_registries(self) -> list[Registry]:
        return [self._registries[f.name] for f in self._families.values() if f.config_names]

    def lookup(self, name: str, *, path: str | None = None, like: Any = None) -> Any:
        """The class or factory a config's `type: <name>` refers to.

        Args:
            name: the registered name.
            path: the config path of the node (errors name `<path>.type`).
            like: what the node built before (its default's target): an unknown name is
                reported among the names of that target's family only (tokenizers for a
                tokenizer), and the error carries the family for the loader's plugin hint.

        Raises:
            UnknownComponentError: no config-nameable family registers `name`.
        """
        for registry in self._component_registries():
            if name in registry:
                return registry[name]
        family = next((f.name for f in self._families.values() if f.config_names and like is not None
                       and self._registries[f.name].name_of(like) is not None), None)
        registries = [self._registries[family]] if family else self._component_registries()
        names = sorted(n for r in registries for n in r)
        kind = registries[0].kind if family else "component"
        where = f"'{path}.type': " if path else ""
        problem = f"{where}{'no' if path else 'No'} {kind} named '{name}'{did_you_mean(name, names)}; {family or 'registered'}: {', '.join(names)}."
        raise UnknownComponentError(
            f"{problem} Enable the plugin that provides it in `plugins:`.", name=name, family=family, problem=problem
        )

    def name_of(self, target: Any) -> str | None:
        for registry in self._component_registries():
            name = registry.name_of(target)
            if name is not None:
                return name
        return None

    def check_component_names(self) -> None:
        """Raises if one config name is registered in two config-nameable families."""
        registries = self._component_registries()
        for i, first in enumerate(registries):
            for second in registries[i + 1 :]:
                for name in sorted(set(first) & set(second)):
                    a, b = first.entry(name), second.entry(name)
                    raise DuplicateComponentError(
                        f"'{name}' is registered both as a {first.kind} by {a.provenance} and "
                        f"as a {second.kind} by {b.provenance}; config names must be unique."
                    )
