"""The `gemma` plugin: converters for the Hugging Face model types `gemma2` and `gemma3_text`.

Installed, it is found by `axcore convert` without being listed in `plugins:`;
imported runs use `rope` and `swiglu` (GeGLU) with the core's generic switches
(sandwich norms, `x * (1 + w)` norms, embedding scale, soft-caps, layer patterns), so
no Gemma code runs in training or generation.
"""

import axcore

from axcore_gemma.gemma import GEMMA2, GEMMA3

# Needs the axcore_register_model_converters hook (plugin API 1.1).
AXCORE_PLUGIN_API = ">=1.1,<2"


@axcore.hookimpl
def axcore_register_model_converters(register):
    register("gemma2", GEMMA2)
    register("gemma3_text", GEMMA3)
