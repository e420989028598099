"""Parameter specs and initializers.

A layer declares each parameter as a `ParameterSpec` (shape, dtype, initializer,
logical axis names, weight-decay scale). Specs are plain leaves in a nested dict,
so `jax.tree.map` works on a spec tree; nothing is allocated until `initialize()`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import jax
import jax.numpy as jnp

from axcore.config import ConfigBase, Positive

# initializer(prng_key, shape, dtype) -> array of that shape and dtype.
Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class ParameterSpec:
    """Declares one parameter without allocating it."""

    # Shape of the parameter.
    shape: tuple[int, ...]
    # Storage dtype.
    dtype: Any
    # Builds the initial value from (prng_key, shape, dtype).
    initializer: Initializer
    # Logical axis name per dimension (None: replicated); mapped to mesh axes by rules.
    mesh_axes: tuple[str | None, ...] | None = None
    # Multiplier on the optimizer's weight decay for this parameter (0 disables it).
    weight_decay_scale: float = 1.0
    # False for state the optimizer never updates (e.g. a kernel's quantization scales);
    # its new value comes from the step's `state_updates`.
    trainable: bool = True
    # Only with trainable=False: the step's gradient of this parameter IS its new value (a kernel's
    # custom VJP returns the new value as the cotangent, e.g. an fp8 gradient's amax history).
    overwrite_with_gradient: bool = False

    def __post_init__(self):
        if self.mesh_axes is not None and len(self.mesh_axes) != len(self.shape):
            raise ValueError(f"mesh_axes {self.mesh_axes} do not match shape {self.shape}.")
        if self.overwrite_with_gradient and self.trainable:
            raise ValueError(
                "overwrite_with_gradient=True needs trainable=False: the optimizer must not also update a "
                "parameter whose new value is its gradient."
            )

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype)


def name_to_int(name: str) -> int:
    """A stable non-negative 31-bit integer for `name` (keys are folded from names)."""
    return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


def fold_in_name(key: jax.Array | None, name: str) -> jax.Array | None:
    """`key` folded with a stable hash of `name`; None stays None."""
    return None if key is None else jax.random.fold_in(key, name_to_int(name))


@dataclasses.dataclass(frozen=True)
class Constant:
    """Initializer: all entries equal `value`."""

    value: float

    def __call__(self, key, shape, dtype):
        del key
        return jnp.full(shape, self.value, dtype)


def constant(value: float) -> Initializer:
    """All entries equal `value`."""
    return Constant(value)


class Distribution(enum.Enum):
    NORMAL = "normal"
    TRUNCATED_NORMAL = "truncated_normal"
    UNIFORM = "uniform"


class FanMode(enum.Enum):
    FAN_IN = "fan_in"
    FAN_OUT = "fan_out"
    FAN_AVG = "fan_avg"
    # Standard deviation is `scale` itself.
    NONE = "none"


@dataclasses.dataclass(frozen=True)
class FanAxes:
    """Which dimensions of a weight are its inputs and outputs (the rest are batch-like)."""

    in_axes: tuple[int, ...]
    out_axes: tuple[int, ...]

    def fans(self, shape: Sequence[int]) -> tuple[int, int]:
        fan_in = math.prod(shape[a] for a in self.in_axes)
        fan_out = math.prod(shape[a] for a in self.out_axes)
        return fan_in, fan_out


class ParamInit(ConfigBase):
    """Variance-scaling initialization of weights: std = scale / sqrt(fan)."""

    # Distribution of the initial values (truncated normal is cut at two std and rescaled).
    distribution: Distribution = Distribution.NORMAL
    # Standard deviation multiplier.
    scale: Annotated[float, Positive] = 1.0
    # Which fan divides the variance.
    fan: FanMode = FanMode.FAN_IN

    def initializer(self, fan_axes: FanAxes | None) -> Initializer:
        """The initializer for a weight whose fans are given by `fan_axes`."""
        return VarianceScaling(self.distribution, self.scale, self.fan, fan_axes)


@dataclasses.dataclass(frozen=True)
class VarianceScaling:
    """Initializer: std = scale / sqrt(fan), drawn from `distribution`.

    A hashable value (like `Constant`), so `Module.initialize` compiles one eager
    draw per (initializer, shape, dtype) and reuses it across the process.
    """

    distribution: Distribution
    scale: float
    fan: FanMode
    fan_axes: FanAxes | None

    def __call__(self, key, shape, dtype):
        if self.fan is FanMode.NONE or self.fan_axes is None:
            std = self.scale
        else:
            fan_in, fan_out = self.fan_axes.fans(shape)
            fan = {
                FanMode.FAN_IN: fan_in,
                FanMode.FAN_OUT: fan_out,
                FanMode.FAN_AVG: (fan_in + fan_out) / 2,
            }[self.fan]
            std = self.scale / math.sqrt(fan)
        if self.distribution is Distribution.NORMAL:
            sample = jax.random.normal(key, shape, jnp.float32) * std
        elif self.distribution is Distribution.TRUNCATED_NORMAL:
            # A standard normal truncated to [-2, 2] has std 0.87962566.
            sample = jax.random.truncated_normal(key, -2.0, 2.0, shape) * (std / 0.87962566)
        else:
            limit = std * math.sqrt(3.0)
            sample = jax.random.uniform(key, shape, jnp.float32, -limit, limit)
        return sample.astype(dtype)
