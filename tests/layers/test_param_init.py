"""ParamInit: empirical statistics of initialized weights versus scale / sqrt(fan)."""

import math

import jax
import numpy as np
import pytest

from axcore.layers import Embedding, Linear, MultiheadAttention
from axcore.params import Distribution, FanAxes, FanMode, ParamInit

FAN_IN, FAN_OUT = 512, 256

# Maximum |sample| / std that each distribution can reach (normal: unbounded).
BOUND_IN_STDS = {
    Distribution.TRUNCATED_NORMAL: 2.0 / 0.87962566,
    Distribution.UNIFORM: math.sqrt(3.0),
}


def _linear_weight(registries, param_init, seed=0):
    cfg = Linear.default_config().set(input_dim=FAN_IN, output_dim=FAN_OUT, bias=False, param_init=param_init)
    layer = cfg.instantiate(name="layer", registries=registries)
    return np.asarray(layer.initialize(jax.random.key(seed))["weight"], np.float64)


FAN_VALUES = {FanMode.FAN_IN: FAN_IN, FanMode.FAN_OUT: FAN_OUT, FanMode.FAN_AVG: (FAN_IN + FAN_OUT) / 2}


# Every distribution and every fan mode occurs (the std does not depend on the
# distribution, and each combination costs a compile of about a second on CPU).
@pytest.mark.parametrize(
    "distribution, fan",
    [
        (Distribution.NORMAL, FanMode.FAN_IN),
        (Distribution.TRUNCATED_NORMAL, FanMode.FAN_OUT),
        (Distribution.UNIFORM, FanMode.FAN_AVG),
    ],
)
def test_linear_weight_std_is_scale_over_sqrt_fan_with_the_distributions_range(distribution, fan, registries):
    scale = 2.0
    w = _linear_weight(registries, ParamInit(distribution=distribution, scale=scale, fan=fan))
    std = scale / math.sqrt(FAN_VALUES[fan])
    assert w.shape == (FAN_IN, FAN_OUT)
    assert abs(w.mean()) < 0.02 * std
    assert w.std() == pytest.approx(std, rel=0.05)
    # The extreme values tell the distributions apart.
    max_in_stds = np.abs(w).max() / std
    if distribution is Distribution.NORMAL:
        # 131k normal samples essentially always include one beyond 3.5 std.
        assert max_in_stds > 3.5
    else:
        bound = BOUND_IN_STDS[distribution]
        assert max_in_stds <= bound * (1 + 1e-5)
        assert max_in_stds > 0.98 * bound


def test_fan_none_uses_scale_as_std(registries):
    w = _linear_weight(registries, ParamInit(scale=0.3, fan=FanMode.NONE))
    assert w.std() == pytest.approx(0.3, rel=0.05)


def test_embedding_default_std_is_one_over_sqrt_dim(registries):
    cfg = Embedding.default_config().set(num_embeddings=2048, dim=16)
    layer = cfg.instantiate(name="emb", registries=registries)
    w = np.asarray(layer.initialize(jax.random.key(0))["weight"], np.float64)
    assert w.std() == pytest.approx(1 / 4, rel=0.05)


def test_attention_projection_fans_span_several_axes(registries):
    # wq [dim, heads, head_dim]: fan_out = heads * head_dim = 64; wo [heads, head_dim, dim]:
    # fan_in = 64. With fan_avg both have fan (256 + 64) / 2 = 160; using only one of the
    # head axes (4 or 16) would give 130 or 136.
    cfg = MultiheadAttention.default_config().set(
        input_dim=256, num_heads=4, head_dim=16, param_init=ParamInit(fan=FanMode.FAN_AVG)
    )
    params = cfg.instantiate(name="attn", registries=registries).initialize(jax.random.key(0))
    for name in ("wq", "wk", "wv", "wo"):
        assert np.std(params[name]) == pytest.approx(1 / math.sqrt(160), rel=0.04), name


def test_fan_axes_multiply_the_listed_dimensions():
    assert FanAxes((0,), (1, 2)).fans((3, 4, 5)) == (3, 20)
    assert FanAxes((0, 1), (2,)).fans((3, 4, 5)) == (12, 5)
