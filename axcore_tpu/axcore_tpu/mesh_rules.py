"""Mesh rules for TPU instance types `tpu-(v4|v5e|v5p|v6e)-N[xS]` (grammar: `axcore_tpu.instance_types`).

One rule per generation (`tpu-v4`, `tpu-v5e`, `tpu-v5p`, `tpu-v6e`; v5e also matches
Cloud's `v5litepod`, v5p JAX's ambiguous `v5` token and v6e JAX's `v6`), priority 10
(above the default rule). Resolving one needs no TPU and no devices: the mesh shape
keeps -1 for the device count, which is filled when a run lays out its mesh.

Layout: mesh axes `(data, fsdp, tensor)`, shape `(S, -1, 1)`: fully-sharded data
parallelism over the chips of a slice (parameters and optimizer state sharded over
`fsdp`, the batch over `data` and `fsdp`), and with S > 1 slices plain data
parallelism over DCN (`data` = S: each slice holds a full fsdp-sharded copy, gradients
are all-reduced across slices), MaxText's default layout (`ici_fsdp_parallelism=-1`,
`dcn_data_parallelism=-1`). `tensor` (size 1) is there so that `mesh.mesh_shape:
[1, -1, 4]` adds tensor parallelism without renaming axes. Axis rules: batch ->
(data, fsdp), embed -> fsdp (the defaults of `axcore.platform.sharding`, written out).

Config modifiers, in order:

- `tpu_slices`: `mesh.mesh_shape = (S, -1, 1)` from the instance type's slice count
  (nothing for one slice). An explicit `mesh.mesh_shape` of the experiment still wins.
- `compute_dtype(compute='bfloat16', override=False)`: bfloat16 compute (the MXU's
  native input type) unless the experiment set a compute dtype; parameters and
  optimizer state stay float32 (master weights; `param_dtype` is left alone).
- `tpu_remat(policy='save_matmul_outputs', paths='decoder\\.layer\\d*')`: per
  transformer layer, keep the outputs of weight matmuls and recompute the rest
  (element-wise ops, norms and attention, whose matmuls have batch dimensions):
  MaxText's "minimal" policy, a middle ground between saving everything (fastest,
  the most HBM: 16 GiB per v5e chip, 32 GiB v4/v6e, 95 GiB v5p) and recomputing
  everything. Skipped when the experiment set any remat policy itself. Offloading
  the saved outputs to host memory instead is the `remat_offload` modifier.

The attention kernel is not forced: `splash` (priority 100) wins wherever it supports
the call, `pallas_tpu` (90) next, the XLA reference otherwise, each decline logged
with its reason. `tpu_mesh_rules(attention_kernel="splash")` builds rules that force
it (an error with the reason where it cannot run).
"""

from __future__ import annotations

from typing import Any

from axcore.errors import ConfigError
from axcore.experiment.config_modifiers import attention_kernel as attention_kernel_modifier, compute_dtype
from axcore.platform.mesh import MeshRule

from axcore_tpu.instance_types import CANONICAL_GENERATIONS, instance_type_pattern, parse_instance_type
from axcore_tpu.remat import DECODER_LAYERS, tpu_remat

# Generation -> the instance-type tokens its rule matches.
RULE_TOKENS = {"v4": ("v4",), "v5e": ("v5e", "v5litepod"), "v5p": ("v5p", "v5"), "v6e": ("v6e", "v6")}
# Above the default rule (-1000); room below for broader rules, above for specific layouts.
TPU_RULE_PRIORITY = 10
MESH_AXIS_NAMES = ("data", "fsdp", "tensor")
AXIS_RULES = {"batch": ("data", "fsdp"), "embed": "fsdp"}


def tpu_slices(config: Any) -> Any:
    """A copy of the config whose mesh puts the instance type's slices on `data` (S, -1, 1); itself for one slice.

    Raises:
        ConfigError: the instance type is not a TPU one (`tpu-<generation>-<N>[x<S>]`).
    """
    instance_type = config.mesh.instance_type
    instance = parse_instance_type(instance_type or "")
    if instance is None:
        raise ConfigError(
            f"Mesh rule modifier tpu_slices: instance type {instance_type!r} is not tpu-<generation>-<N>[x<S>]."
        )
    if instance.slices == 1:
        return config
    new = config.clone()
    new.mesh.mesh_shape = (instance.slices, -1, 1)
    return new


def tpu_mesh_rules(
    *,
    remat_policy: str | None = "save_matmul_outputs",
    attention_kernel: str | None = None,
    priority: int = TPU_RULE_PRIORITY,
) -> list[MeshRule]:
    """The rules this plugin registers, one per generation (module docstring).

    Args:
        remat_policy: the `remat` policy of `tpu_remat` (none, full, save_matmul_outputs);
            None = no remat modifier.
        attention_kernel: force this attention kernel on every attention layer; None = by priority.
        priority: the rules' priority.
    """
    modifiers: list[Any] = [tpu_slices, compute_dtype("bfloat16", override=False)]
    if remat_policy is not None:
        modifiers.append(tpu_remat(remat_policy, DECODER_LAYERS))
    if attention_kernel is not None:
        modifiers.append(attention_kernel_modifier(attention_kernel))
    return [
        MeshRule(
            name=f"tpu-{generation}",
            instance_type=instance_type_pattern(*RULE_TOKENS[generation]),
            mesh_shape=(1, -1, 1),
            mesh_axis_names=MESH_AXIS_NAMES,
            axis_rules=dict(AXIS_RULES),
            config_modifiers=tuple(modifiers),
            priority=priority,
        )
        for generation in CANONICAL_GENERATIONS
    ]
