"""The `int8_dot` config modifier: int8 matmuls for chosen layers (registered by the `tpu` plugin).

`int8_dot(paths)` sets `kernels: {dot: int8}` on the layers whose module path matches
`paths` (default `decoder\\.layer\\d*`: every transformer layer, not the output head),
so their weight matmuls (and their sub-layers', which inherit `kernels`) use the `int8`
kernel. The `tpu` plugin registers that kernel by name only (priority below the
reference), so it runs exactly where this modifier puts it; a forced kernel that
declines a site (e.g. sizes not multiples of 128 on TPU) is an error naming the reason.
`plugins: [int8]` instead enables it wherever it supports the call.

In YAML, in a `mesh_rules[i].modifiers` list: `{type: int8_dot, paths: 'decoder\\.layer\\d*'}`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from axcore.config import get_path
from axcore.errors import ConfigError, UnknownComponentError
from axcore.experiment.config_modifiers import Modifier, matching_configs

from axcore_tpu.remat import DECODER_LAYERS


def int8_dot(paths: str = DECODER_LAYERS) -> Modifier:
    """Forces the `int8` dot kernel on the layers matching `paths` (module docstring)."""
    this = Modifier("int8_dot", {"paths": paths})
    try:
        pattern = re.compile(paths)
    except (re.error, TypeError) as e:
        raise ConfigError(f"Config modifier {this}: paths '{paths}' is not a regular expression: {e}.") from None

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        from axcore.layers.base import BaseLayer

        if registries is None:
            from axcore.experiment.builtins import builtin_registries  # Deferred: the plugin manager imports modifiers.

            registries = builtin_registries()
        names = sorted(k.name for k in registries.kernels.candidates("dot"))
        if "int8" not in names:
            raise UnknownComponentError(
                f"Config modifier {self}: no dot kernel named 'int8' (registered: {', '.join(names)}); "
                f"enable the tpu or int8 plugin."
            )
        targets = matching_configs(self, config, registries, pattern, BaseLayer, "layer", outermost=True)
        new = config.clone()
        for path in targets:
            node = get_path(new, path)
            node.kernels = {**(node.kernels or {}), "dot": "int8"}
        return new

    return dataclasses.replace(this, fn=fn)


__all__ = ["int8_dot"]
