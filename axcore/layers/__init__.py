"""Reference layers (registered by the built-in plugin `axcore.layers.plugin`)."""

from axcore.layers.attention import MultiheadAttention
from axcore.layers.base import BaseLayer, with_fields
from axcore.layers.basic import Embedding, LayerNorm, Linear, RMSNorm
from axcore.layers.feed_forward import Activation, FeedForward
from axcore.layers.lm import CausalLM, chunked_head_loss, cross_entropy, sum_aux_losses
from axcore.layers.pipeline import Circular, GPipe, PipelineSchedule
from axcore.layers.position import LearnedPositionEmbedding, PositionEmbedding
from axcore.layers.transformer import RepeatedTransformer, StackedTransformer, TransformerLayer

__all__ = [
    "Activation",
    "BaseLayer",
    "CausalLM",
    "Circular",
    "Embedding",
    "FeedForward",
    "GPipe",
    "LayerNorm",
    "LearnedPositionEmbedding",
    "Linear",
    "MultiheadAttention",
    "PipelineSchedule",
    "PositionEmbedding",
    "RMSNorm",
    "RepeatedTransformer",
    "StackedTransformer",
    "TransformerLayer",
    "chunked_head_loss",
    "cross_entropy",
    "sum_aux_losses",
    "with_fields",
]
