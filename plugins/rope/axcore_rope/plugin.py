"""The `rope` plugin: registers the rotary embedding and installs it in every attention layer.

Settings (`rope:` in an experiment file) are the fields of `RotarySettings`:

    plugins: [rope]
    rope: {theta: 500000, scaling: llama3, scaling_factor: 8}
"""

import axcore
from axcore.config import remove, replace
from axcore.layers import LearnedPositionEmbedding, MultiheadAttention

from axcore_rope.rotary import RotaryEmbedding, RotarySettings, rotary_config


@axcore.hookimpl
def axcore_register_position_embeddings(register):
    register("rotary", RotaryEmbedding)


@axcore.hookimpl
def axcore_settings_config():
    return RotarySettings()


@axcore.hookimpl
def axcore_transform_config(config, settings):
    rotary = rotary_config(settings, where="rope")
    config = replace(config, MultiheadAttention, lambda _, attention: attention.set(position_embedding=rotary.clone()))
    return remove(config, LearnedPositionEmbedding, allow_no_match=True)
