"""BaseLayer: a Module with a parameter dtype and weight initialization settings."""

from __future__ import annotations

from typing import Any

from axcore.config import DType, InstantiableConfig
from axcore.module import Module
from axcore.params import FanAxes, Initializer, ParameterSpec, ParamInit, constant


class BaseLayer(Module):
    """A module with parameters."""

    class Config(Module.Config):
        """Configures BaseLayer."""

        # Storage dtype of this layer's parameters.
        param_dtype: DType = "float32"
        # Initialization of this layer's weights (biases and norm scales are constant).
        param_init: ParamInit = ParamInit()

    def _weight(
        self,
        shape: tuple[int, ...],
        mesh_axes: tuple[str | None, ...],
        fan_axes: FanAxes,
        *,
        weight_decay_scale: float = 1.0,
    ) -> ParameterSpec:
        """Spec of a weight initialized by `param_init` with the given fans."""
        return ParameterSpec(
            shape=tuple(shape),
            dtype=self._config.param_dtype,
            initializer=self._config.param_init.initializer(fan_axes),
            mesh_axes=mesh_axes,
            weight_decay_scale=weight_decay_scale,
        )

    def _constant(
        self, shape: tuple[int, ...], value: float, mesh_axes: tuple[str | None, ...]
    ) -> ParameterSpec:
        """Spec of a bias or scale: constant init, no weight decay."""
        init: Initializer = constant(value)
        return ParameterSpec(tuple(shape), self._config.param_dtype, init, mesh_axes, 0.0)


def with_fields(cfg: InstantiableConfig, **values: Any) -> InstantiableConfig:
    """A copy of `cfg` with those of `values` that it declares set; others are skipped.

    Parents use this to pass dimensions (e.g. `input_dim`) to a slot that may hold
    any component, which declares only the fields it needs.
    """
    fields = set(cfg.keys())
    return cfg.clone(**{k: v for k, v in values.items() if k in fields})
