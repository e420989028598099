"""axcore's own components run the conformance suites that plugin authors run (axcore.testing)."""

from axcore.kernels import XlaAttention
from axcore.layers import (
    FeedForward,
    LearnedPositionEmbedding,
    MultiheadAttention,
    RepeatedTransformer,
    StackedTransformer,
)
from axcore.testing import (
    AttentionKernelConformance,
    CheckpointBackendConformance,
    ConfigTransformConformance,
    PositionEmbeddingConformance,
)

from axcore_alibi import AlibiBias
from axcore_rope.rotary import RotaryEmbedding

# -- attention kernels registered here (the GPU/TPU Pallas ones: tests/gpu, tests/tpu) ---


class TestXlaReferenceKernel(AttentionKernelConformance):
    kernel = XlaAttention()


# -- position embeddings ---------------------------------------------------------------


class TestLearnedPositionEmbedding(PositionEmbeddingConformance):
    embedding = LearnedPositionEmbedding.default_config().set(max_len=32)


class TestRotaryEmbedding(PositionEmbeddingConformance):
    embedding = RotaryEmbedding.default_config()
    plugins = ["rope"]
    relative = True


class TestAlibi(PositionEmbeddingConformance):
    embedding = AlibiBias.default_config()
    plugins = ["alibi"]
    relative = True


# -- checkpoint backends -----------------------------------------------------------------


class TestOrbaxBackend(CheckpointBackendConformance):
    backend = "orbax"
    commit_marker = "{step}/commit_success.txt"


class TestTensorStoreBackend(CheckpointBackendConformance):
    backend = "tensorstore"
    commit_marker = "step_{step:08d}/COMMITTED"


# -- config transforms of the built-in feature plugins -----------------------------------


class TestRopeTransform(ConfigTransformConformance):
    plugin = "rope"
    targets = MultiheadAttention
    also_touches = LearnedPositionEmbedding  # Rotary replaces the absolute input embedding.


class TestAlibiTransform(ConfigTransformConformance):
    plugin = "alibi"
    targets = MultiheadAttention
    also_touches = LearnedPositionEmbedding


class TestSwigluTransform(ConfigTransformConformance):
    plugin = "swiglu"
    settings = {"hidden_dim_multiplier": 0.5, "hidden_dim_multiple_of": 16}
    targets = FeedForward


class TestMoeTransform(ConfigTransformConformance):
    plugin = "moe"
    settings = {"num_experts": 2, "top_k": 1}
    targets = (StackedTransformer, RepeatedTransformer)


class TestRematTransform(ConfigTransformConformance):
    plugin = "remat"
    experiment = "scan"
    targets = RepeatedTransformer
