"""Typed config nodes: declaration, validated assignment, instantiation.

A config class declares its fields as annotated class attributes; the default is
the class attribute's value, `REQUIRED` marks a field the user must set:

    class Linear(Configurable):
        class Config(Configurable.Config):
            # Input feature dimension.
            input_dim: int = REQUIRED
            # Whether to add a bias.
            bias: bool = True

Assignment validates against the annotation (unknown names get a "did you mean"
suggestion, wrong types name the field). Defaults are deep-copied per instance, so
a sub-config default is never shared between two configs.
"""

from __future__ import annotations

import collections.abc
import copy
import enum
import functools
import inspect
import types
import typing
from typing import Any, ClassVar

import numpy as np

from axcore.errors import ConfigTypeError, MissingRequiredError, UnknownFieldError, did_you_mean

__all__ = [
    "REQUIRED",
    "CallableConfig",
    "ClassConfig",
    "ConfigBase",
    "Configurable",
    "DType",
    "InstantiableConfig",
    "config_for_class",
    "config_for_function",
    "default_config_for",
]


class _Required:
    """Sentinel type of `REQUIRED`."""

    _instance: ClassVar[_Required | None] = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REQUIRED"

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_Required, ())


REQUIRED: Any = _Required()


class DType:
    """Annotation marker for a dtype field: accepts `jnp.float32`, `"bfloat16"`, ...

    Values are normalized to `numpy.dtype` (bfloat16 through ml_dtypes) and written
    to YAML by name.
    """


# Kinds of dtype a DType field accepts: floats (bfloat16 and float8 too), signed and unsigned ints, bool.
_DTYPE_KINDS = "fiub"


def _to_dtype(value: Any) -> np.dtype:
    import jax.numpy as jnp  # Deferred: building configs must not require JAX at import.

    if isinstance(value, str) and not value.isidentifier():
        raise TypeError(value)  # Type codes like '<U4' or 'O': names only.
    dtype = np.dtype(jnp.dtype(value))
    if dtype.kind not in _DTYPE_KINDS and not _is_ml_dtype(dtype):
        raise TypeError(value)
    return dtype


def _is_ml_dtype(dtype: np.dtype) -> bool:
    """bfloat16 and the float8 types (ml_dtypes' numpy kind is 'V')."""
    import ml_dtypes

    return dtype.kind == "V" and dtype.name in ml_dtypes.__all__ and "complex" not in dtype.name


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Validates `value` against annotation `tp` and returns it, normalized.

    Normalizations: int -> float for float fields, list -> tuple for tuple fields,
    enum value or name -> enum member, dtype-like -> numpy dtype.

    Raises:
        ConfigTypeError: naming `path` when the value does not fit.
    """
    if value is REQUIRED or tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:  # Range constraints are checked by axcore.config.constraints.
        return coerce(value, typing.get_args(tp)[0], path)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        # Exact matches first, so `int | float` keeps an int an int.
        for member in sorted(args, key=lambda a: not _exact_match(value, a)):
            try:
                return coerce(value, member, path)
            except ConfigTypeError:
                continue
        raise ConfigTypeError(
            f"Config field '{path}' expects {_describe(tp)}, got {type(value).__name__} {value!r}."
        )
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigTypeError(f"Config field '{path}' must be one of {list(args)}, got {value!r}.")
    if tp is type(None):
        if value is None:
            return None
    elif tp is DType:
        try:
            return _to_dtype(value)
        except TypeError:
            pass
    elif tp is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
    elif tp is int:
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            return float(value)
    elif inspect.isclass(tp) and issubclass(tp, enum.Enum):
        return _to_enum(value, tp, path)
    elif origin in (list, tuple, collections.abc.Sequence) or tp in (list, tuple):
        if isinstance(value, (list, tuple)):
            return _coerce_sequence(value, origin or tp, args, path)
    elif origin in (dict, collections.abc.Mapping) or tp is dict:
        if isinstance(value, dict):
            key_tp, val_tp = args if args else (Any, Any)
            return {
                coerce(k, key_tp, f"{path}.<key>"): coerce(v, val_tp, f"{path}.{k}")
                for k, v in value.items()
            }
    elif origin is collections.abc.Callable or tp is collections.abc.Callable:
        if callable(value):
            return value
    elif origin is type:
        if inspect.isclass(value) and (not args or issubclass(value, args[0])):
            return value
    elif inspect.isclass(tp):
        if isinstance(value, tp):
            return value
    else:
        return value  # An annotation we cannot check (TypeVar, Protocol alias, ...).
    raise ConfigTypeError(
        f"Config field '{path}' expects {_describe(tp)}, got {type(value).__name__} {value!r}."
    )


def _exact_match(value: Any, tp: Any) -> bool:
    return inspect.isclass(tp) and type(value) is tp


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _describe(typing.get_args(tp)[0])
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if inspect.isclass(tp) and issubclass(tp, enum.Enum):
        return f"one of {[m.value for m in tp]}"
    if tp is type(None):
        return "None"
    return _type_name(tp)


def _to_enum(value: Any, tp: type[enum.Enum], path: str) -> enum.Enum:
    if isinstance(value, tp):
        return value
    for member in tp:
        if value == member.value or (isinstance(value, str) and value == member.name):
            return member
    choices = [m.value for m in tp]
    hint = did_you_mean(str(value), [str(c) for c in choices])
    raise ConfigTypeError(f"Config field '{path}' must be one of {choices}, got {value!r}{hint}.")


def _coerce_sequence(value, container, args, path):
    if container is tuple and len(args) == 2 and args[1] is Ellipsis:
        items = [coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    elif container is tuple and args:
        if len(args) != len(value):
            raise ConfigTypeError(
                f"Config field '{path}' expects {len(args)} items, got {len(value)}: {value!r}."
            )
        items = [coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
    else:
        elem = args[0] if args else Any
        items = [coerce(v, elem, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if container is tuple else list(items)


class ConfigBase:
    """A typed, validated config node. Subclasses declare fields as annotations."""

    # Field name -> declared default, in declaration order (base classes first).
    _field_defaults: ClassVar[dict[str, Any]] = {}
    # Resolved annotations, filled lazily (annotations may be forward references).
    _field_types_cache: ClassVar[dict[str, Any] | None] = None
    _validated_defaults_cache: ClassVar[dict[str, Any] | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        defaults: dict[str, Any] = {}
        for base in reversed(cls.__mro__[1:]):
            defaults.update(getattr(base, "_field_defaults", {}))
        own = cls.__dict__.get("__annotations__", {})
        for name, annotation in own.items():
            if name.startswith("_") or "ClassVar" in str(annotation):
                continue
            defaults[name] = cls.__dict__.get(name, REQUIRED)
        cls._field_defaults = defaults
        cls._field_types_cache = None
        cls._validated_defaults_cache = None

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        """Field name -> resolved annotation."""
        if cls.__dict__.get("_field_types_cache") is None:
            hints: dict[str, Any] = {}
            for klass in reversed(cls.__mro__):
                if "__annotations__" not in klass.__dict__ or not issubclass(klass, ConfigBase):
                    continue
                module = inspect.getmodule(klass)
                globalns = dict(vars(module)) if module else {}
                localns = {"DType": DType, "REQUIRED": REQUIRED}
                for outer in _enclosing_classes(klass):
                    localns.update(vars(outer))
                for name, annotation in klass.__dict__["__annotations__"].items():
                    if name in cls._field_defaults:
                        if isinstance(annotation, str):
                            annotation = eval(annotation, globalns, localns)
                        hints[name] = annotation
            cls._field_types_cache = hints
        return cls._field_types_cache

    @classmethod
    def _validated_defaults(cls) -> dict[str, Any]:
        """Declared defaults, validated and normalized once per class."""
        if cls.__dict__.get("_validated_defaults_cache") is None:
            types_ = cls.field_types()
            cls._validated_defaults_cache = {
                name: coerce(default, types_[name], f"{cls.__qualname__}.{name}")
                for name, default in cls._field_defaults.items()
            }
        return cls._validated_defaults_cache

    def __init__(self, **kwargs):
        for name, default in type(self)._validated_defaults().items():
            object.__setattr__(self, name, copy.deepcopy(default))
        self.set(**kwargs)

    def _label(self) -> str:
        return type(self).__qualname__

    def __setattr__(self, name: str, value: Any) -> None:
        fields = type(self)._field_defaults
        if name not in fields:
            raise UnknownFieldError(
                f"{self._label()} has no field '{name}'{did_you_mean(name, fields)}; "
                f"fields are: {', '.join(fields)}."
            )
        value = coerce(value, type(self).field_types()[name], f"{self._label()}.{name}")
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails, i.e. for unknown names.
        if name.startswith("__"):
            raise AttributeError(name)
        fields = type(self)._field_defaults
        raise UnknownFieldError(
            f"{self._label()} has no field '{name}'{did_you_mean(name, fields)}; "
            f"fields are: {', '.join(fields)}."
        )

    def set(self, **kwargs) -> ConfigBase:
        """Sets fields (validated) and returns self, for chaining."""
        for name, value in kwargs.items():
            setattr(self, name, value)
        return self

    def clone(self, **kwargs) -> ConfigBase:
        """Returns a deep copy with `kwargs` set."""
        return copy.deepcopy(self).set(**kwargs)

    def keys(self) -> list[str]:
        return list(type(self)._field_defaults)

    def items(self) -> list[tuple[str, Any]]:
        """(field, value) pairs in declaration order."""
        return [(name, self.__dict__[name]) for name in type(self)._field_defaults]

    def check_fields(self) -> list[tuple[str, str]]:
        """Checks across this node's fields: `(field, problem)` pairs, e.g.
        `("head_dim", "must be set when num_heads does not divide input_dim (3 into 64)")`.

        Called by `axcore.config.constraints.validate_config` after every field's own
        range; the default finds nothing. Subclasses extend it.
        """
        return []

    def missing_required(self) -> list[str]:
        """Names of this node's fields (not descendants') still REQUIRED."""
        return [name for name, value in self.items() if value is REQUIRED]

    def __eq__(self, other: Any) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        return self._identity() == other._identity() and self.items() == other.items()

    __hash__ = None  # Mutable.

    def _identity(self) -> Any:
        return None

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.items())
        return f"{self._label()}({body})"


def _enclosing_classes(klass: type) -> list[type]:
    """The classes whose bodies lexically enclose `klass` (for nested Config types)."""
    module = inspect.getmodule(klass)
    out, obj = [], module
    for part in klass.__qualname__.split(".")[:-1]:
        obj = getattr(obj, part, None)
        if obj is None or not inspect.isclass(obj):
            break
        out.append(obj)
    return out


class InstantiableConfig(ConfigBase):
    """A config that builds an object. `target` is the class or function it builds."""

    @property
    def target(self) -> Any:
        raise NotImplementedError

    def _identity(self) -> Any:
        return self.target

    def check_required(self, path: str = "") -> None:
        missing = self.missing_required()
        if missing:
            where = f"'{path}'" if path else self._label()
            raise MissingRequiredError(
                f"Config {where} has required field(s) {missing} unset; set them in the "
                f"experiment file or with --set."
            )

    def instantiate(self, **kwargs) -> Any:
        raise NotImplementedError


class ClassConfig(InstantiableConfig):
    """Config of a `Configurable` class; `klass` is the class it instantiates."""

    def __init__(self, klass: type | None = None, **kwargs):
        object.__setattr__(self, "klass", klass)
        super().__init__(**kwargs)

    @property
    def target(self) -> Any:
        return self.klass

    def _label(self) -> str:
        klass = self.__dict__.get("klass")
        return f"{klass.__name__}.Config" if klass is not None else type(self).__qualname__

    def instantiate(self, **kwargs) -> Any:
        """Builds `klass(self, **kwargs)` after checking required fields."""
        if self.klass is None:
            raise MissingRequiredError(f"{self._label()} has no klass; use X.default_config().")
        self.check_required()
        return self.klass(self, **kwargs)


class Configurable:
    """Base class of objects built from configs ("configure instances, not types")."""

    class Config(ClassConfig):
        """Configures Configurable."""

    @classmethod
    def default_config(cls) -> ClassConfig:
        """A fresh config whose `klass` is `cls`."""
        return cls.Config(klass=cls)

    def __init__(self, cfg: ClassConfig):
        cfg.check_required()
        self._config = cfg.clone()

    @property
    def config(self) -> ClassConfig:
        """A copy of the config this object was built from."""
        return self._config.clone()


class CallableConfig(InstantiableConfig):
    """Config wrapping a plain function or a third-party class; fields are its arguments."""

    # The wrapped callable; set on the generated subclass.
    _target: ClassVar[Any] = None

    @property
    def target(self) -> Any:
        return type(self)._target

    def _label(self) -> str:
        return f"config_for({getattr(self.target, '__qualname__', self.target)})"

    def instantiate(self, **kwargs) -> Any:
        """Calls the target with the configured arguments plus `kwargs`."""
        self.check_required()
        return self.target(**dict(self.items()), **kwargs)


@functools.cache
def _callable_config_class(target: Any) -> type[CallableConfig]:
    signature = inspect.signature(target)
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # Unresolvable annotations in third-party code: fall back to Any.
        hints = {}
    annotations, namespace = {}, {"_target": target}
    for name, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotations[name] = hints.get(name, Any)
        namespace[name] = REQUIRED if param.default is param.empty else param.default
    namespace["__annotations__"] = annotations
    name = f"{getattr(target, '__name__', 'callable')}Config"
    return types.new_class(name, (CallableConfig,), exec_body=lambda ns: ns.update(namespace))


def config_for_function(fn: Any, **kwargs) -> CallableConfig:
    """Wraps `fn` as a config whose fields are its parameters; instantiate() calls it."""
    return _callable_config_class(fn)(**kwargs)


def config_for_class(cls: type, **kwargs) -> CallableConfig:
    """Wraps a (third-party) class as a config whose fields are its constructor's arguments."""
    return _callable_config_class(cls)(**kwargs)


def default_config_for(target: Any) -> InstantiableConfig:
    """The default config of a Configurable class, or a wrapping config for any callable."""
    if inspect.isclass(target) and issubclass(target, Configurable):
        return target.default_config()
    return config_for_function(target)
