"""The installed `sinusoidal` plugin: axcore's conformance suites, the paper's formula, a YAML file, training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.layers import LearnedPositionEmbedding
from axcore.testing import TINY_OVERRIDES, ConfigTransformConformance, PositionEmbeddingConformance

from axcore_sinusoidal import SinusoidalPositionEmbedding


class TestEmbedding(PositionEmbeddingConformance):
    embedding = SinusoidalPositionEmbedding.default_config()
    plugins = ["sinusoidal"]


class TestTransform(ConfigTransformConformance):
    plugin = "sinusoidal"
    settings = {"base": 500.0}
    targets = LearnedPositionEmbedding  # The default model's input slot holds one.


def paper_encoding(positions, dim, base=10000.0):
    """PE(pos, 2i) = sin(pos / base^(2i/dim)), PE(pos, 2i+1) = cos(pos / base^(2i/dim)), in float64."""
    pe = np.zeros((*positions.shape, dim))
    for i in range(0, dim, 2):
        angle = positions / base ** (i / dim)
        pe[..., i] = np.sin(angle)
        if i + 1 < dim:
            pe[..., i + 1] = np.cos(angle)
    return pe


@pytest.mark.parametrize("dim, base", [(16, 10000.0), (7, 500.0)])
def test_matches_the_papers_formula(axcore_registries, dim, base):
    cfg = SinusoidalPositionEmbedding.default_config().set(dim=dim, base=base)
    layer = cfg.instantiate(name="position_embedding", registries=axcore_registries)
    positions = np.stack([np.arange(12), np.arange(12) * 50 + 3])  # Up to position 553.
    x = np.random.default_rng(0).normal(size=(2, 12, dim)).astype(np.float32)
    out, _ = axcore.functional(layer, layer.initialize(jax.random.key(0)), (jnp.asarray(x), jnp.asarray(positions)),
                               prng_key=None, is_training=False, method="embed_inputs")
    np.testing.assert_allclose(np.asarray(out), x + paper_encoding(positions, dim, base), atol=1e-4)


def test_max_len_is_enforced(axcore_registries):
    layer = SinusoidalPositionEmbedding.default_config().set(dim=4, max_len=8).instantiate(
        name="position_embedding", registries=axcore_registries)
    x, positions = jnp.zeros((1, 9, 4)), jnp.arange(9)[None]
    with pytest.raises(ValueError, match="exceeds max_len 8"):
        axcore.functional(layer, {}, (x, positions), prng_key=None, is_training=False, method="embed_inputs")


def test_enabled_from_a_yaml_plugins_list(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("plugins: [sinusoidal]\nsinusoidal: {base: 1000.0}\n")
    experiment = axcore.load_experiment(str(path), TINY_OVERRIDES)
    embedding = experiment.config.model.position_embedding
    assert embedding.klass is SinusoidalPositionEmbedding and embedding.base == 1000.0
    assert "model.position_embedding.type: sinusoidal\n" in experiment.flat()
    assert experiment.settings["sinusoidal"].base == 1000.0


def test_a_few_training_steps_lower_the_loss(axcore_tiny_experiment, axcore_train_steps):
    experiment = axcore_tiny_experiment(["model.num_layers=1"])
    assert not jax.tree.leaves(  # No parameters: the table is computed from the positions.
        experiment.config.model.instantiate(name="model", registries=experiment.registries)
        .position_embedding.initialize(jax.random.key(0)))
    losses = axcore_train_steps(experiment, steps=4)
    assert losses[-1] < losses[0]
