"""The named steps of the reference layers, the q/k-norm slots, `add_child`, the public parameter
names, and a layer-subclassing plugin end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.config import replace
from axcore.experiment import load_experiment
from axcore.layers import (
    FeedForward,
    LayerNorm,
    MultiheadAttention,
    PositionEmbedding,
    RMSNorm,
    TransformerLayer,
)
from axcore.layers.basic import Linear
from axcore.testing import TINY_OVERRIDES

EPS = 1e-6


class ShiftByPosition(PositionEmbedding):
    """q + 0.5 * position, k + 0.5 * position: a position embedding a norm after it would change."""

    def transform_qk(self, q, k, q_positions, k_positions):
        return (
            q + 0.5 * q_positions[:, :, None, None].astype(q.dtype),
            k + 0.5 * k_positions[:, :, None, None].astype(k.dtype),
        )


def _qk_norm_layer(registries, *, norm_first=True, position_embedding=True):
    cfg = MultiheadAttention.default_config().set(
        input_dim=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=6,  # Not input_dim // num_heads: the norms must get head_dim from the layer.
        causal=True,
        q_norm=RMSNorm.default_config().set(eps=EPS),
        k_norm=RMSNorm.default_config().set(eps=EPS),
        position_embedding=ShiftByPosition.default_config() if position_embedding else None,
    )
    layer = cfg.instantiate(name="attn", registries=registries)
    return layer, _init(layer, 0)  # Norm scales other than ones, so that they matter.


def reference(params, x, *, norm_first=True, shift=True):
    """The layer written out in plain jnp: project, RMS-norm q and k per head, shift by position,
    causal GQA attention, output projection."""
    q = jnp.einsum("btd,dnh->btnh", x, params["wq"])
    k = jnp.einsum("btd,dnh->btnh", x, params["wk"])
    v = jnp.einsum("btd,dnh->btnh", x, params["wv"])

    def rms(y, scale):
        return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + EPS) * scale

    def pos(y):
        return y + 0.5 * jnp.arange(y.shape[1], dtype=y.dtype)[None, :, None, None] if shift else y

    if norm_first:
        q, k = pos(rms(q, params["q_norm"]["scale"])), pos(rms(k, params["k_norm"]["scale"]))
    else:
        q, k = rms(pos(q), params["q_norm"]["scale"]), rms(pos(k), params["k_norm"]["scale"])
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    t = x.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)
    return jnp.einsum("btnh,nhd->btd", out, params["wo"])


def _x(seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(2, 5, 16)), jnp.float32)


def _init(layer, seed=0):
    """Parameters drawn with NumPy (weights ~ N(0, 0.3^2), norm scales in [0.5, 1.5]); no JAX compile."""
    rng = np.random.default_rng(seed)

    def draw(path, spec):
        scale = jax.tree_util.keystr(path).endswith("['scale']")
        value = rng.uniform(0.5, 1.5, spec.shape) if scale else rng.normal(0.0, 0.3, spec.shape)
        return jnp.asarray(value, spec.dtype)

    return jax.tree_util.tree_map_with_path(draw, layer.parameter_specs())


def _run(layer, params, x, method="forward"):
    """`layer.<method>(x)` under jit (one compile instead of one per eager op)."""
    return jax.jit(lambda p, x: axcore.functional(layer, p, (x,), None, False, method=method)[0])(params, x)


def test_qk_norm_params_are_over_head_dim_and_absent_by_default(registries):
    layer, params = _qk_norm_layer(registries)
    assert params["q_norm"]["scale"].shape == params["k_norm"]["scale"].shape == (6,)
    assert layer.parameter_specs()["q_norm"]["scale"].mesh_axes == ("norm",)
    plain = MultiheadAttention.default_config().set(input_dim=16, num_heads=4)
    assert set(plain.instantiate(name="attn", registries=registries).parameter_specs()) == {"wq", "wk", "wv", "wo"}


@pytest.mark.parametrize("position_embedding", [True, False])
def test_qk_norm_runs_before_the_position_embedding(registries, position_embedding):
    layer, params = _qk_norm_layer(registries, position_embedding=position_embedding)
    x = _x()
    got = np.asarray(_run(layer, params, x))
    with jax.default_matmul_precision("highest"):
        want = np.asarray(jax.jit(lambda p: reference(p, x, shift=position_embedding))(params))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if position_embedding:  # The other order gives other numbers: the test tells them apart.
        other = np.asarray(jax.jit(lambda p: reference(p, x, norm_first=False))(params))
        assert np.abs(other - want).max() > 1e-2


def test_qk_norm_gradients_match_the_plain_formula(registries):
    layer, params = _qk_norm_layer(registries)
    x = _x(seed=2)
    loss = lambda p: jnp.sum(jnp.sin(axcore.functional(layer, p, (x,), None, False)[0]))  # noqa: E731
    ref_loss = lambda p: jnp.sum(jnp.sin(reference(p, x)))  # noqa: E731
    with jax.default_matmul_precision("highest"):
        got, want = jax.jit(jax.grad(loss))(params), jax.jit(jax.grad(ref_loss))(params)
    for name in ("q_norm", "k_norm"):
        assert np.abs(np.asarray(got[name]["scale"])).max() > 1e-4  # Gradients reach the norms' scales.
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5), got, want)


def test_layer_norm_fits_the_k_norm_slot(registries):
    cfg = MultiheadAttention.default_config().set(input_dim=16, num_heads=4, k_norm=LayerNorm.default_config())
    layer = cfg.instantiate(name="attn", registries=registries)
    specs = layer.parameter_specs()
    assert specs["k_norm"]["scale"].shape == specs["k_norm"]["bias"].shape == (4,) and "q_norm" not in specs
    assert _run(layer, _init(layer, 0), _x()).shape == (2, 5, 16)


class Traced(MultiheadAttention):
    """Records the order of its steps; each override calls the reference step."""

    calls: list = []

    def project_qkv(self, x):
        self.calls.append(("project_qkv", x.shape))
        return super().project_qkv(x)

    def normalize_qk(self, q, k):
        self.calls.append(("normalize_qk", q.shape, k.shape))
        return super().normalize_qk(q, k)

    def position_embed(self, q, k, positions):
        self.calls.append(("position_embed", positions.shape))
        return super().position_embed(q, k, positions)

    def attend(self, q, k, v, **kwargs):
        self.calls.append(("attend", v.shape))
        return super().attend(q, k, v, **kwargs)

    def project_output(self, out):
        self.calls.append(("project_output", out.shape))
        return super().project_output(out)


def test_attention_steps_run_in_order_with_documented_shapes(registries):
    cfg = Traced.default_config().set(input_dim=16, num_heads=4, num_kv_heads=2)
    layer = cfg.instantiate(name="attn", registries=registries)
    params = _init(layer, 0)
    Traced.calls.clear()
    out = _run(layer, params, _x())
    assert out.shape == (2, 5, 16)
    assert Traced.calls == [
        ("project_qkv", (2, 5, 16)),
        ("normalize_qk", (2, 5, 4, 4), (2, 5, 2, 4)),
        ("position_embed", (2, 5)),
        ("attend", (2, 5, 2, 4)),
        ("project_output", (2, 5, 4, 4)),
    ]
    plain = MultiheadAttention.default_config().set(input_dim=16, num_heads=4, num_kv_heads=2)
    reference_out = _run(plain.instantiate(name="attn", registries=registries), params, _x())
    np.testing.assert_array_equal(np.asarray(out), np.asarray(reference_out))


def test_feed_forward_and_transformer_steps_compose_to_forward(registries):
    ffn = FeedForward.default_config().set(input_dim=8, hidden_dim=16).instantiate(name="ffn", registries=registries)
    params = _init(ffn, 0)
    assert set(params) == {"up_proj", "down_proj"} and params["up_proj"]["weight"].shape == (8, 16)
    x = _x()[..., :8]
    assert _run(ffn, params, x, "project_up").shape == (2, 5, 16)
    layer_cfg = TransformerLayer.default_config().set(input_dim=16)
    layer_cfg.self_attention.num_heads = 4
    layer_cfg.feed_forward.hidden_dim = 32
    layer = layer_cfg.instantiate(name="layer", registries=registries)
    lparams = _init(layer, 1)
    assert set(lparams) == {"attention_norm", "self_attention", "ffn_norm", "feed_forward"}
    x = _x()
    y = _run(layer, lparams, _run(layer, lparams, x, "attention_block"), "ffn_block")
    np.testing.assert_allclose(np.asarray(y), np.asarray(_run(layer, lparams, x)), rtol=1e-6, atol=1e-6)


def test_add_child_is_public_and_private_alias_remains(registries):
    linear = Linear.default_config().set(input_dim=4, output_dim=4)

    class WithExtra(FeedForward):
        def __init__(self, cfg, **kwargs):
            super().__init__(cfg, **kwargs)
            self.add_child("extra", linear)
            self._add_child("legacy", linear)
            with pytest.raises(ValueError, match="already has a child named 'extra'"):
                self.add_child("extra", linear)

    layer = WithExtra.default_config().set(input_dim=4, hidden_dim=8).instantiate(name="ffn", registries=registries)
    assert {"extra", "legacy", "up_proj", "down_proj"} <= set(layer.parameter_specs())
    assert layer.extra is layer.children["extra"]


# -- A layer-subclassing plugin, end to end (the README's example) -------------------------------


class HeadNormAttention(MultiheadAttention):
    """Attention whose per-head outputs are RMS-normalized before the output projection."""

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.add_child("head_norm", RMSNorm.default_config().set(input_dim=self.head_dim))

    def project_output(self, out):
        return super().project_output(self.head_norm(out))


class HeadNormPlugin:
    @axcore.hookimpl
    def axcore_register_layers(self, register):
        register("head_norm_attention", HeadNormAttention)

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        return replace(
            config, MultiheadAttention, lambda _, c: HeadNormAttention.default_config().set(**dict(c.items()))
        )


def test_layer_subclassing_plugin_end_to_end():
    overrides = [*TINY_OVERRIDES, "mesh.instance_type=cpu-1", "plugins=[head_norm]"]
    exp = load_experiment(None, overrides, objects={"head_norm": HeadNormPlugin()})
    flat = exp.flat()
    assert "model.decoder.layer.self_attention.type: head_norm_attention" in flat
    assert "model.decoder.layer.self_attention.q_norm: null" in flat
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    attention = model.decoder.layer0.self_attention  # The default decoder: a stacked_transformer.
    assert isinstance(attention, HeadNormAttention)
    specs = model.parameter_specs()["decoder"]["layer0"]["self_attention"]
    assert set(specs) == {"wq", "wk", "wv", "wo", "head_norm"} and specs["head_norm"]["scale"].shape == (16,)

    params = _init(attention, 0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 32)), jnp.float32)
    got = _run(attention, params, x)
    p = {k: np.asarray(v, np.float64) for k, v in params.items() if k.startswith("w")}
    xs = np.asarray(x, np.float64)
    q, k, v = (np.einsum("btd,dnh->btnh", xs, p[w]) for w in ("wq", "wk", "wv"))
    logits = np.einsum("btnh,bsnh->bnts", q, k) / 4.0
    logits = np.where(np.tril(np.ones((5, 5), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    o = np.einsum("bnts,bsnh->btnh", probs / probs.sum(-1, keepdims=True), v)
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + 1e-6) * np.asarray(params["head_norm"]["scale"], np.float64)
    np.testing.assert_allclose(np.asarray(got), np.einsum("btnh,nhd->btd", o, p["wo"]), rtol=1e-4, atol=1e-5)
