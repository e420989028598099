"""Config declaration, validated assignment, cloning and instantiation."""

import enum

import numpy as np
import pytest

from axcore.config import (
    REQUIRED,
    ConfigBase,
    Configurable,
    DType,
    config_for_class,
    config_for_function,
)
from axcore.errors import ConfigTypeError, MissingRequiredError, UnknownFieldError


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Inner(Configurable):
    class Config(Configurable.Config):
        # Width.
        width: int = REQUIRED
        # A color.
        color: Color = Color.RED
        # A dtype.
        dtype: DType = "float32"

    def __init__(self, cfg, scale=1):
        super().__init__(cfg)
        self.scale = scale


class Outer(Configurable):
    class Config(Configurable.Config):
        # A nested config with a default.
        inner: Inner.Config = Inner.default_config()
        # An optional float.
        rate: float | None = 0.5
        # A tuple of ints.
        shape: tuple[int, ...] = (1, 2)
        # A name.
        label: str = "x"


def test_defaults_are_validated_and_normalized():
    cfg = Outer.default_config()
    assert cfg.inner.dtype == np.dtype("float32") and isinstance(cfg.inner.dtype, np.dtype)
    assert cfg.inner.width is REQUIRED
    assert cfg.inner.klass is Inner


def test_nested_defaults_are_not_shared_between_instances():
    a, b = Outer.default_config(), Outer.default_config()
    a.inner.width = 3
    assert b.inner.width is REQUIRED


def test_unknown_field_suggests_closest_name():
    cfg = Inner.default_config()
    with pytest.raises(UnknownFieldError, match=r"'widht'.*did you mean 'width'"):
        cfg.widht = 3
    with pytest.raises(UnknownFieldError, match="did you mean 'width'"):
        _ = cfg.widht


@pytest.mark.parametrize(
    "field,value",
    [("width", "3"), ("width", 3.5), ("width", True), ("color", "green"), ("dtype", "notadtype")],
)
def test_wrong_type_names_the_field(field, value):
    with pytest.raises(ConfigTypeError, match=rf"Inner\.Config\.{field}"):
        Inner.default_config().set(**{field: value})


def test_coercions():
    cfg = Outer.default_config().set(rate=1, shape=[3, 4])
    assert cfg.rate == 1.0 and isinstance(cfg.rate, float)
    assert cfg.shape == (3, 4)
    cfg.inner.set(color="blue", dtype="bfloat16")
    assert cfg.inner.color is Color.BLUE
    assert cfg.inner.dtype.name == "bfloat16"
    cfg.rate = None
    assert cfg.rate is None


def test_clone_is_deep_and_sets_fields():
    cfg = Outer.default_config()
    copy = cfg.clone(label="y")
    copy.inner.width = 7
    assert cfg.label == "x" and cfg.inner.width is REQUIRED
    assert copy.label == "y"


def test_equality_compares_class_and_fields():
    assert Outer.default_config() == Outer.default_config()
    assert Outer.default_config() != Outer.default_config().set(label="z")

    class Other(Inner):
        pass

    # Same Config class, different klass.
    assert Inner.default_config() != Other.default_config()


def test_instantiate_checks_required_and_passes_kwargs():
    with pytest.raises(MissingRequiredError, match="width"):
        Inner.default_config().instantiate()
    obj = Inner.default_config().set(width=2).instantiate(scale=5)
    assert isinstance(obj, Inner) and obj.scale == 5 and obj.config.width == 2


def test_config_for_function_wraps_signature():
    def affine(x: float, slope: float = 2.0, offset: float = 0.0):
        return slope * x + offset

    cfg = config_for_function(affine).set(x=3)
    assert cfg.keys() == ["x", "slope", "offset"]
    assert cfg.instantiate() == 6.0
    with pytest.raises(ConfigTypeError, match="slope"):
        cfg.slope = "steep"
    with pytest.raises(MissingRequiredError, match="x"):
        config_for_function(affine).instantiate()


def test_config_for_class_wraps_third_party_constructor():
    class ThirdParty:
        def __init__(self, size: int, name: str = "t"):
            self.size, self.name = size, name

    obj = config_for_class(ThirdParty, size=4).instantiate()
    assert (obj.size, obj.name) == (4, "t")
    with pytest.raises(UnknownFieldError, match="did you mean 'size'"):
        config_for_class(ThirdParty).sise = 1


def test_plain_config_base_subclass():
    class Plain(ConfigBase):
        # Count.
        count: int = 1

    p = Plain(count=3)
    assert p.items() == [("count", 3)]
    with pytest.raises(ConfigTypeError, match="Plain.count"):
        Plain(count="3")
