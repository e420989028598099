"""Compatibility path: `axcore.mesh` is `axcore.platform.mesh`.

The flat layout's path that docs/hooks.md and docs/writing-a-hardware-plugin.md gave plugin
authors. Plugins written against the flat layout keep importing from here; new code imports
`axcore.platform.mesh`. Nothing inside `axcore` imports this module (the import contracts
say so).
"""

from axcore.platform.mesh import (
    DEFAULT_RULE,
    AmbiguousMeshRuleError,
    ConfigModifier,
    InstanceType,
    MeshRule,
    NoMeshRuleError,
    detect_instance_type,
    device_kind_token,
    instance_platform,
    select_mesh_rule,
)

__all__ = [
    "ConfigModifier",
    "MeshRule",
    "NoMeshRuleError",
    "AmbiguousMeshRuleError",
    "select_mesh_rule",
    "InstanceType",
    "instance_platform",
    "detect_instance_type",
    "device_kind_token",
    "DEFAULT_RULE",
]
