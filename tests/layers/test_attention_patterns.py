"""Generic mechanisms of dense model families: attention projection biases (`qkv_bias`,
`output_bias`) against a NumPy formula, and per-layer attention patterns
(`StackedTransformer.layer_types` / `attention_types`): each layer gets its type's
sliding window and RoPE base, training and KV-cache decoding see the same windows,
and bad patterns are one-line config errors naming the field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_layer import np_attention

import axcore
from axcore.errors import ConfigError
from axcore.experiment import load_experiment
from axcore.layers import MultiheadAttention
from axcore.module import functional

SMALL = [
    "model.dim=32",
    "model.num_layers=3",
    "model.decoder.layer.self_attention.num_heads=4",
    "model.decoder.layer.self_attention.num_kv_heads=2",
    "model.decoder.layer.feed_forward.hidden_dim=48",
    "input.seq_len=16",
    "model.compute_dtype=float32",
    "plugins=[rope]",
]
PATTERN = [
    "model.decoder.layer_types=[local, local, global]",
    "model.decoder.attention_types={local: {sliding_window: 3, position_embedding.theta: 100.0}, global: {}}",
]


def _biased(registries, **kw):
    cfg = MultiheadAttention.default_config().set(
        input_dim=16, num_heads=4, num_kv_heads=2, head_dim=4, causal=True, **kw
    )
    layer = cfg.instantiate(name="attn", registries=registries)
    params = layer.initialize(jax.random.key(0))
    rng = np.random.default_rng(3)  # Biases start at zero: draw them, so the test can fail.
    return layer, {k: (rng.normal(size=v.shape).astype(np.float32) if k.startswith("b") else v) for k, v in params.items()}


def test_projection_biases_match_numpy(registries):
    layer, params = _biased(registries, qkv_bias=True, output_bias=True)
    assert (params["bq"].shape, params["bk"].shape, params["bv"].shape, params["bo"].shape) == ((4, 4), (2, 4), (2, 4), (16,))
    specs = layer.parameter_specs()
    assert specs["bq"].mesh_axes == ("heads", None) and specs["bk"].mesh_axes == ("kv_heads", None)
    assert specs["bo"].weight_decay_scale == 0.0
    x = np.random.default_rng(1).normal(size=(2, 6, 16)).astype(np.float32)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    q = np.einsum("btd,dnh->btnh", x, p["wq"]) + p["bq"]
    k = np.repeat(np.einsum("btd,dnh->btnh", x, p["wk"]) + p["bk"], 2, axis=2)
    v = np.repeat(np.einsum("btd,dnh->btnh", x, p["wv"]) + p["bv"], 2, axis=2)
    expected = np.einsum("btnh,nhd->btd", np_attention(q, k, v, scale=0.5, causal=True), p["wo"]) + p["bo"]
    out, _ = axcore.functional(layer, params, inputs=(x,), prng_key=None, is_training=False)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_biases_are_off_by_default_and_separate(registries):
    cfg = MultiheadAttention.default_config().set(input_dim=16, num_heads=4)
    assert sorted(cfg.instantiate(name="a", registries=registries).parameter_specs()) == ["wk", "wo", "wq", "wv"]
    layer, _ = _biased(registries, qkv_bias=True)
    assert "bo" not in layer.parameter_specs() and "bq" in layer.parameter_specs()
    layer, _ = _biased(registries, output_bias=True)
    assert sorted(k for k in layer.parameter_specs() if k.startswith("b")) == ["bo"]


def _model(*overrides, init=True):
    exp = load_experiment(None, [*SMALL, *overrides])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    return model, model.initialize(jax.random.key(1)) if init else None


def _logits(model, params, ids):
    return np.asarray(functional(model, params, (ids,), None, False, method="logits")[0])


def test_each_layer_gets_its_types_window_and_rope_base():
    model, _ = _model(*PATTERN, init=False)
    layers = [getattr(model.decoder, f"layer{i}").self_attention for i in range(3)]
    assert [a.config.sliding_window for a in layers] == [3, 3, None]
    assert [a.config.position_embedding.theta for a in layers] == [100.0, 100.0, 10000.0]  # The rope plugin's 1e4.


def _decoded(model, params, ids, prompt):
    """Logits of `ids` by a prefill of `prompt` tokens, then one token at a time through the KV cache."""
    batch, total = ids.shape
    extend = jax.jit(lambda p, *args: functional(model, p, args, None, False, method="extend")[0])
    logits, cache = extend(params, ids[:, :prompt], model.init_cache(batch, total))
    decoded = [logits]
    for t in range(prompt, total):
        logits, cache = extend(params, ids[:, t : t + 1], cache, jnp.full((batch, 1), t))
        decoded.append(logits)
    return np.concatenate(decoded, axis=1)


def test_kv_cache_decoding_respects_each_layers_window():
    model, params = _model(*PATTERN)
    ids = jax.random.randint(jax.random.key(2), (2, 12), 0, 256)
    full = _logits(model, params, ids)
    plain, _ = _model()  # Same parameters without the pattern: the windows and bases change the logits.
    assert np.abs(_logits(plain, params, ids) - full).max() > 1e-2
    np.testing.assert_allclose(_decoded(model, params, ids, 4), full, atol=2e-5, rtol=1e-5)


def test_a_scanned_block_repeats_the_pattern():
    block = [
        "model.num_layers=4",
        "model.decoder.type=repeated_transformer",
        "model.decoder.layer.type=stacked_transformer",
        "model.decoder.layer.num_layers=2",
        "model.decoder.layer.layer.self_attention.num_heads=4",
        "model.decoder.layer.layer.self_attention.causal=true",
        "model.decoder.layer.layer.feed_forward.hidden_dim=48",
        "model.decoder.layer.layer_types=[local, global]",
        "model.decoder.layer.attention_types={local: {sliding_window: 2}, global: {}}",
    ]
    model, params = _model(*block)
    ids = jax.random.randint(jax.random.key(2), (2, 10), 0, 256)
    windowed = _logits(model, params, ids)
    plain, _ = _model(*block[:-2])
    assert np.abs(_logits(plain, params, ids) - windowed).max() > 1e-2
    unit = model.decoder.layer
    assert (unit.layer0.self_attention.config.sliding_window, unit.layer1.self_attention.config.sliding_window) == (2, None)
    np.testing.assert_allclose(_decoded(model, params, ids, 3), windowed, atol=2e-5, rtol=1e-5)  # Scanned cache.


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.decoder.layer_types=[local, global]", PATTERN[1]],
         "'model.decoder.layer_types' lists 2 types but num_layers is 3"),
        (["model.decoder.layer_types=[local, lokal, global]", PATTERN[1]],
         "'model.decoder.layer_types[1]' is 'lokal', which attention_types does not define (did you mean 'local'?)"),
        ([PATTERN[1]], "'model.decoder.attention_types' is set but layer_types is not"),
        ([PATTERN[0], "model.decoder.attention_types={local: {window: 3}, global: {}}"],
         "model.decoder.attention_types.local.window: cannot set the self_attention field"),
    ],
)
def test_bad_patterns_are_config_errors_naming_the_field(overrides, expected):
    with pytest.raises(ConfigError) as info:
        _model(*overrides, init=False)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
