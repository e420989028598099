"""The flat layout's module paths that the docs gave plugin authors still import, as the same objects.

`axcore.mesh`, `axcore.sharding`, `axcore.interop`, `axcore.hookspecs` and
`axcore.config_modifiers` moved into packages (docs/architecture.md); a plugin written
against the old paths must keep working, and a re-export must not carry a hook
implementation (registering the old path next to the built-in would register it twice).
"""

import importlib

import pytest

# Old path -> new module, and the names in-tree plugins imported from the old path before the move.
MOVED = {
    "axcore.mesh": ("axcore.platform.mesh", {"MeshRule", "InstanceType", "device_kind_token", "instance_platform",
                                             "detect_instance_type"}),
    "axcore.sharding": ("axcore.platform.sharding", {"DEFAULT_AXIS_RULES", "resolve_rules", "mesh_axes_of"}),
    "axcore.interop": ("axcore.checkpoint.interop", {"ConversionError", "ModelConverter"}),
    "axcore.hookspecs": ("axcore.plugin.hookspecs", {"PLUGIN_API_VERSION", "axcore_register_layers"}),
    "axcore.config_modifiers": ("axcore.experiment.config_modifiers", {"Modifier", "matching_configs", "remat",
                                                                       "compute_dtype", "attention_kernel",
                                                                       "REMAT_POLICIES"}),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_old_path_re_exports_the_new_modules_objects(old):
    new_name, used = MOVED[old]
    old_module, new_module = importlib.import_module(old), importlib.import_module(new_name)
    assert used <= set(old_module.__all__)
    for name in old_module.__all__:
        assert getattr(old_module, name) is getattr(new_module, name), name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_old_path_carries_no_hook_implementation(old):
    module = importlib.import_module(old)
    assert not [name for name in module.__all__ if hasattr(getattr(module, name), "axcore_impl")]
