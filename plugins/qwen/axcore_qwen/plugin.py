"""The `qwen` plugin: converters for the Hugging Face model types `qwen2` and `qwen3`.

Installed, it is found by `axcore convert` without being listed in `plugins:`
(converters are searched among installed plugins); imported runs use `rope` and
`swiglu` like Llama, with the attention biases, QK-norm and layer patterns of the
core's generic switches, so no Qwen code runs in training or generation.
"""

import axcore

from axcore_qwen.qwen import QWEN2, QWEN3

# Needs the axcore_register_model_converters hook (plugin API 1.1).
AXCORE_PLUGIN_API = ">=1.1,<2"


@axcore.hookimpl
def axcore_register_model_converters(register):
    register("qwen2", QWEN2)
    register("qwen3", QWEN3)
