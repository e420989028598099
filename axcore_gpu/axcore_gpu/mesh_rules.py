"""Mesh rules for NVIDIA GPU instance types `gpu-(h100|h200|a100|b200)-N`.

One rule per device kind (`gpu-h100`, `gpu-h200`, `gpu-a100`, `gpu-b200`), one host or
many (N counts every device of the run): for now data parallelism over all devices,
the batch split over mesh axis `data` and parameters replicated; fsdp and tensor axes
come with the scale-out work. Config modifiers, in order:

- `bfloat16_compute`: `model.compute_dtype: bfloat16` unless the experiment set a
  compute dtype itself. Parameters and optimizer state stay float32 (master weights),
  since `model.param_dtype` is left alone.

The remat policy is left as configured (none by default: every activation is saved,
which fits a ~1B model on one 80 GB GPU); `plugins: [remat]` trades compute for memory.
The attention kernel is not forced: the cuDNN kernel wins by priority where it
supports the call and declines, with its reason logged, where it does not.
"""

from __future__ import annotations

from typing import Any

from axcore.errors import ConfigError
from axcore.platform.mesh import MeshRule

# Device kinds of `detect_instance_type` (the first token like h100 in device_kind) that get a rule.
GPU_KINDS = ("h100", "h200", "a100", "b200")
# Above the default rule (-1000); room below for broader GPU rules, above for specific layouts.
GPU_RULE_PRIORITY = 10


def bfloat16_compute(config: Any) -> Any:
    """A copy of the experiment config with bfloat16 compute, unless a compute dtype is set.

    Raises:
        ConfigError: the model config has no `compute_dtype` (not an axcore layer).
    """
    if "compute_dtype" not in config.model.keys():
        raise ConfigError(
            f"Mesh rule modifier bfloat16_compute: model config {type(config.model).__name__} has no "
            f"compute_dtype field; build the model from axcore layers or set mesh.rule: default."
        )
    if config.model.compute_dtype is not None:
        return config  # The experiment chose a compute dtype; respect it.
    new = config.clone()
    new.model.compute_dtype = "bfloat16"
    return new


def gpu_mesh_rules() -> list[MeshRule]:
    """The rules this plugin registers, one per device kind of `GPU_KINDS`."""
    return [
        MeshRule(
            name=f"gpu-{kind}",
            instance_type=rf"gpu-{kind}-\d+",
            mesh_shape=(-1,),
            mesh_axis_names=("data",),
            axis_rules={"batch": "data"},
            config_modifiers=(bfloat16_compute,),
            priority=GPU_RULE_PRIORITY,
        )
        for kind in GPU_KINDS
    ]
