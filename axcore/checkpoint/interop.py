"""Model converters: what a plugin registers to import and export another framework's checkpoints.

A converter handles one model family of an outside format, keyed by that format's
own name for it (Hugging Face's `model_type` in `config.json`: `llama`, `mistral`,
...). Plugins register them through `axcore_register_model_converters`
(`register(model_type, converter, *, override=False)`), so a new family is a new
plugin, never a change to axcore; `registries.model_converters[model_type]` finds
one. The `axcore-hf` plugin registers `llama` and `mistral` and provides the
`axcore convert` command that uses them.

Parameters cross this boundary as nested dicts of NumPy arrays shaped like the
axcore model's parameter tree (`model.parameter_specs()`); outside tensors as a flat
`{name: array}` map in their own layouts and dtypes.

This file imports no JAX, no plugin manager and no higher core module (hookspecs
validate registrations with `converter_validator`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from axcore.errors import AxcoreError


class ConversionError(AxcoreError):
    """An outside checkpoint or config cannot be converted; the message names the file and field."""


@runtime_checkable
class ModelConverter(Protocol):
    """Converts one outside model family to and from axcore (see the module docstring)."""

    def experiment(self, config: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The outside `config` (e.g. config.json's data, read from file `where`) -> experiment data.

        Returns YAML-safe experiment data (`plugins:`, the plugins' sections, `model:`)
        that builds the same architecture. Raises ConversionError naming `where` and
        the field for anything the axcore model cannot express.
        """

    def outside_config(self, experiment: Any, base: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The resolved `axcore.Experiment` -> the outside config (`base`: fields to keep, e.g. token ids).

        Raises ConversionError naming the config path (`where` the run) when the
        model has a component the outside format cannot express.
        """

    def params_from_outside(
        self, tensors: Mapping[str, Any], config: Mapping[str, Any], template: Any, where: str
    ) -> dict[str, Any]:
        """Outside tensors `{name: array}` -> axcore params shaped like `template` (a tree of shapes).

        Raises ConversionError naming `where` and the tensor for a missing, unexpected
        or wrongly shaped one.
        """

    def params_to_outside(self, params: Any, config: Mapping[str, Any]) -> dict[str, Any]:
        """axcore params (NumPy tree) -> outside tensors `{name: array}` for `config` (float32)."""


def converter_validator(name: str, value: Any) -> str | None:
    """Accepts a `ModelConverter` (an object with its four methods)."""
    if isinstance(value, type) or not isinstance(value, ModelConverter):
        return (
            f"expected a model converter instance with methods experiment, outside_config, "
            f"params_from_outside and params_to_outside, got {value!r}"
        )
    return None
