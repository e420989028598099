"""The alibi plugin: registers `alibi` and installs it in every attention layer."""

from __future__ import annotations

from axcore import hookimpl
from axcore.config import remove, replace
from axcore.layers import LearnedPositionEmbedding, MultiheadAttention

from axcore_alibi.layer import AlibiBias


@hookimpl
def axcore_register_position_embeddings(register):
    register("alibi", AlibiBias)


@hookimpl
def axcore_transform_config(config):
    # ALiBi replaces absolute positions: fill every attention slot, drop the input embedding.
    config = replace(config, MultiheadAttention, lambda _, c: c.set(position_embedding=AlibiBias.default_config()))
    return remove(config, LearnedPositionEmbedding, allow_no_match=True)
