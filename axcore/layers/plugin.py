"""Built-in plugin: the reference layers and the learned position embedding."""

from axcore.layers.attention import MultiheadAttention
from axcore.layers.basic import Embedding, LayerNorm, Linear, RMSNorm
from axcore.layers.feed_forward import FeedForward
from axcore.layers.lm import CausalLM
from axcore.layers.pipeline import Circular, GPipe
from axcore.layers.position import LearnedPositionEmbedding
from axcore.layers.transformer import RepeatedTransformer, StackedTransformer, TransformerLayer
from axcore.markers import hookimpl

LAYERS = {
    "linear": Linear,
    "embedding": Embedding,
    "rms_norm": RMSNorm,
    "layer_norm": LayerNorm,
    "feed_forward": FeedForward,
    "multihead_attention": MultiheadAttention,
    "transformer_layer": TransformerLayer,
    "stacked_transformer": StackedTransformer,
    "repeated_transformer": RepeatedTransformer,
    "causal_lm": CausalLM,
}


@hookimpl
def axcore_register_layers(register):
    for name, layer in LAYERS.items():
        register(name, layer)


@hookimpl
def axcore_register_position_embeddings(register):
    register("learned_position_embedding", LearnedPositionEmbedding)


@hookimpl
def axcore_register_pipeline_schedules(register):
    register("gpipe", GPipe)
    register("circular", Circular)
