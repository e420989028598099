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


def _linear_weight(param_init, seed=0):
    cfg = Linear.default_config().set(input_dim=FAN_IN, output_dim=FAN_OUT, bias=False, param_init=param_init)
    return np.asarray(cfg.instantiate(name="layer").initialize(jax.random.key(seed))["weight"], np.float64)


@pytest.mark.parametrize("distribution", list(Distribution))
@pytest.mark.parametrize(
    "fan, fan_value",
    [
        (FanMode.FAN_IN, FAN_IN),
        (FanMode.FAN_OUT, FAN_OUT),
        (FanMode.FAN_AVG, (FAN_IN + FAN_OUT) / 2),
    ],
)
def test_linear_weight_std_is_scale_over_sqrt_fan(distribution, fan, fan_value):
    scale = 2.0
    w = _linear_weight(ParamInit(distribution=distribution, scale=scale, fan=fan))
    target = scale / math.sqrt(fan_value)
    assert w.shape == (FAN_IN, FAN_OUT)
    assert abs(w.mean()) < 0.02 * target
    assert w.std() == pytest.approx(target, rel=0.05)


def test_fan_none_uses_scale_as_std():
    w = _linear_weight(ParamInit(scale=0.3, fan=FanMode.NONE))
    assert w.std() == pytest.approx(0.3, rel=0.05)


@pytest.mark.parametrize("distribution", list(Distribution))
def test_distribution_shape_shows_in_the_extreme_values(distribution):
    w = _linear_weight(ParamInit(distribution=distribution, fan=FanMode.FAN_IN))
    std = 1.0 / math.sqrt(FAN_IN)
    max_in_stds = np.abs(w).max() / std
    if distribution is Distribution.NORMAL:
        # 131k normal samples essentially always include one beyond 3.5 std.
        assert max_in_stds > 3.5
    else:
        bound = BOUND_IN_STDS[distribution]
        assert max_in_stds <= bound * (1 + 1e-5)
        assert max_in_stds > 0.98 * bound


def test_embedding_default_std_is_one_over_sqrt_dim():
    cfg = Embedding.default_config().set(num_embeddings=2048, dim=64)
    w = np.asarray(cfg.instantiate(name="emb").initialize(jax.random.key(0))["weight"], np.float64)
    assert w.std() == pytest.approx(1 / 8, rel=0.05)


def test_attention_projection_fans_span_several_axes():
    # wq [dim, heads, head_dim]: fan_out = heads * head_dim; wo [heads, head_dim, dim]: fan_in = heads * head_dim.
    cfg = MultiheadAttention.default_config().set(
        input_dim=256, num_heads=4, head_dim=16, param_init=ParamInit(fan=FanMode.FAN_OUT)
    )
    params = cfg.instantiate(name="attn").initialize(jax.random.key(0))
    assert np.std(params["wq"]) == pytest.approx(1 / math.sqrt(64), rel=0.05)
    assert np.std(params["wo"]) == pytest.approx(1 / math.sqrt(256), rel=0.05)
    cfg.param_init = ParamInit(fan=FanMode.FAN_IN)
    params = cfg.instantiate(name="attn").initialize(jax.random.key(0))
    assert np.std(params["wq"]) == pytest.approx(1 / math.sqrt(256), rel=0.05)
    assert np.std(params["wo"]) == pytest.approx(1 / math.sqrt(64), rel=0.05)


def test_fan_axes_multiply_the_listed_dimensions():
    assert FanAxes((0,), (1, 2)).fans((3, 4, 5)) == (3, 20)
    assert FanAxes((0, 1), (2,)).fans((3, 4, 5)) == (12, 5)


def test_param_init_initializer_respects_dtype_and_key():
    init = ParamInit(scale=1.0).initializer(FanAxes((0,), (1,)))
    a = init(jax.random.key(0), (64, 32), np.float32)
    b = init(jax.random.key(0), (64, 32), np.float32)
    c = init(jax.random.key(1), (64, 32), np.float32)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert init(jax.random.key(0), (4, 4), jax.numpy.bfloat16).dtype == jax.numpy.bfloat16
