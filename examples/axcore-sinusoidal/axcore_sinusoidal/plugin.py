"""The `sinusoidal` plugin: registers the embedding and puts it in the model's input position slot.

Settings (`sinusoidal:` in an experiment file) are the fields of `SinusoidalSettings`:

    plugins: [sinusoidal]
    sinusoidal: {base: 10000.0, max_len: 4096}
"""

import axcore
from axcore.config import replace
from axcore.layers import CausalLM

from axcore_sinusoidal.layer import SinusoidalPositionEmbedding, SinusoidalSettings, sinusoidal_config

# This plugin uses hooks and arguments of plugin API 1.0.
AXCORE_PLUGIN_API = ">=1.0"


@axcore.hookimpl
def axcore_register_position_embeddings(register):
    register("sinusoidal", SinusoidalPositionEmbedding)


@axcore.hookimpl
def axcore_settings_config():
    return SinusoidalSettings()


@axcore.hookimpl
def axcore_transform_config(config, settings):
    # Fills every causal LM's input slot (replacing the learned table); applying it twice changes nothing.
    return replace(config, CausalLM, lambda _, lm: lm.set(position_embedding=sinusoidal_config(settings)))
