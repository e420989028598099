"""Rematerialization for TPU runs: the mesh rules' default policy, and offloading to host memory.

Two config modifiers (`axcore.experiment.config_modifiers` conventions: a new config, never an
edit of the input; errors name the modifier):

- `tpu_remat(policy, paths)`, in the TPU mesh rules: the built-in `remat(policy,
  paths)`, applied only when the experiment chose no remat policy anywhere in its
  model and the paths match some layer (a model without `decoder.layer*` layers is left
  alone rather than refused).
- `remat_offload(paths)`, registered by the `tpu` plugin under that name (YAML:
  `{type: remat_offload, paths: 'decoder\\.layer\\d*'}` in a `mesh_rules[i].modifiers`
  list): the matching layers (the outermost ones) get the remat policy
  `offload_dot_with_no_batch_dims(device,pinned_host)`, i.e.
  `jax.checkpoint_policies.offload_dot_with_no_batch_dims(offload_src="device",
  offload_dst="pinned_host")`: the outputs of weight matmuls (dots without batch
  dimensions) are saved to pinned host memory in the forward pass and brought back
  for the backward pass; everything else is recomputed. It needs a platform whose
  devices have memory of their own beside pinned host memory: TPUs (and CUDA GPUs),
  read from the experiment's instance type. On `cpu-*` it refuses with a ConfigError:
  a CPU device's memory *is* host memory, so there is nothing to offload (JAX traces
  the policy there, but the copies are no-ops).

The policy string is resolved by `axcore.layers.base.checkpoint_policy`, which takes
`jax.checkpoint_policies` attributes and calls of its factories with string arguments.
Policies that pick dots see only plain `dot_general`s: the matmuls of kernels with a
custom VJP (`int8`, `fp8`, XLA:CPU's `xla_cpu`) are recomputed, not saved or offloaded.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax

from axcore.config import get_path, walk
from axcore.errors import AxcoreError, ConfigError, NoMatchError
from axcore.experiment.config_modifiers import Modifier, matching_configs, remat
from axcore.platform.mesh import instance_platform

# The transformer layers of axcore's decoders: decoder.layer0, layer1, ... (stacked) or
# decoder.layer (the unit a RepeatedTransformer scans).
DECODER_LAYERS = r"decoder\.layer\d*"
# Where saved activations go, and from where.
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"
OFFLOAD_POLICY = f"offload_dot_with_no_batch_dims({OFFLOAD_SRC},{OFFLOAD_DST})"
# Platforms (instance-type prefixes) whose devices have memory other than pinned host memory.
HOST_OFFLOAD_PLATFORMS = ("tpu", "gpu")


def offload_policy() -> Any:
    """The `jax.checkpoint` policy `OFFLOAD_POLICY` names (what `remat_offload` installs)."""
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims(offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)


def experiment_sets_remat(config: Any) -> bool:
    """Whether any layer config of the experiment's model sets a remat policy."""
    for _, node in walk(config.model, "model"):
        if "remat_policy" in getattr(node, "keys", lambda: ())() and node.remat_policy is not None:
            return True
    return False


def tpu_remat(policy: str = "save_matmul_outputs", paths: str = DECODER_LAYERS) -> Modifier:
    """The built-in `remat(policy, paths)`, unless the experiment set a remat policy or no layer matches."""
    inner = remat(policy, paths)
    this = Modifier("tpu_remat", {"policy": policy, "paths": paths})

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        if experiment_sets_remat(config):
            return config  # The experiment chose; respect it.
        try:
            return inner(config, registries)
        except NoMatchError:
            return config  # Not an axcore decoder: nothing this rule knows to remat.

    return dataclasses.replace(this, fn=fn)


def remat_offload(paths: str = DECODER_LAYERS) -> Modifier:
    """Offloads the matching layers' saved matmul outputs to host memory (module docstring)."""
    this = Modifier("remat_offload", {"paths": paths})
    try:
        pattern = re.compile(paths)
    except (re.error, TypeError) as e:
        raise ConfigError(f"Config modifier {this}: paths '{paths}' is not a regular expression: {e}.") from None

    def fn(self: Modifier, config: Any, registries: Any) -> Any:
        from axcore.layers.base import BaseLayer

        instance_type = config.mesh.instance_type
        platform = instance_platform(instance_type)
        if platform not in HOST_OFFLOAD_PLATFORMS:
            if platform == "cpu":
                why = "a CPU device's memory is host memory, so there is nothing to offload"
            elif platform is None:
                why = "its platform is unknown"
            else:
                why = f"platform '{platform}' has no host offloading here"
            raise ConfigError(
                f"Config modifier {self}: instance type {instance_type} cannot offload activations to host "
                f"memory: {why}; it needs {' or '.join(HOST_OFFLOAD_PLATFORMS)}. Use remat (e.g. policy full) instead."
            )
        if registries is None:
            from axcore.experiment.builtins import builtin_registries  # Deferred: the plugin manager imports modifiers.

            registries = builtin_registries()
        targets = matching_configs(self, config, registries, pattern, BaseLayer, "layer", outermost=True)
        new = config.clone()
        for path in targets:
            get_path(new, path).remat_policy = OFFLOAD_POLICY
        try:  # A layer that resolves remat_policy on its own may not take a factory call.
            new.model.clone().instantiate(name="model", registries=registries)
        except AxcoreError as e:
            raise ConfigError(f"Config modifier {self}: the model refuses the offloading policy: {e}") from None
        return new

    return dataclasses.replace(this, fn=fn)


__all__ = [
    "DECODER_LAYERS",
    "OFFLOAD_POLICY",
    "experiment_sets_remat",
    "offload_policy",
    "remat_offload",
    "tpu_remat",
]
