"""The `moe_families` plugin: model converters for Hugging Face `mixtral` and `qwen3_moe`.

Registers them through `axcore_register_model_converters`; `axcore convert` (plugin
`hf`) finds them among the installed plugins. Imported runs list `rope`, `swiglu`
and `moe`, not this plugin: it is needed only to convert.
"""

import axcore

from axcore_moe_families.converter import MIXTRAL, QWEN3_MOE, MoEConverter

# Needs the axcore_register_model_converters hook (plugin API 1.1).
AXCORE_PLUGIN_API = ">=1.1,<2"


@axcore.hookimpl
def axcore_register_model_converters(register):
    for family in (MIXTRAL, QWEN3_MOE):
        register(family.model_type, MoEConverter(family))
