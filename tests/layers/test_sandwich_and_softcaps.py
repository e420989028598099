"""Generic mechanisms of the Gemma-style families, each against a NumPy formula or a
property: RMSNorm's `scale_offset` (x * (1 + w) in float32), sandwich norms
(`TransformerLayer.post_norms`), the embedding multiplier (`CausalLM.scale_embeddings`)
and the final logit soft-cap (`CausalLM.logits_softcap`)."""

import math

import jax
import numpy as np

import axcore
from axcore.experiment import load_experiment
from axcore.layers import RMSNorm, TransformerLayer
from axcore.module import functional

SMALL = ["model.dim=32", "model.num_layers=2", "model.decoder.layer.self_attention.num_heads=4",
         "model.decoder.layer.feed_forward.hidden_dim=48", "input.seq_len=16", "model.compute_dtype=float32",
         "plugins=[rope]"]


def test_rms_norm_scale_offset_is_x_times_one_plus_w(registries):
    norm = RMSNorm.default_config().set(input_dim=8, eps=1e-6, scale_offset=1.0).instantiate(name="n", registries=registries)
    assert np.all(norm.initialize(jax.random.key(0))["scale"] == 0.0)  # A gain of 1 at init.
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 8)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32)
    out, _ = axcore.functional(norm, {"scale": w}, inputs=(x,), prng_key=None, is_training=False)
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-6) * (1.0 + w)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_post_norms_normalize_each_sublayer_output(registries):
    cfg = TransformerLayer.default_config().set(input_dim=16, post_norms=True)
    cfg.self_attention.set(num_heads=4, causal=True)
    cfg.feed_forward.set(hidden_dim=32)
    layer = cfg.instantiate(name="layer", registries=registries)
    params = layer.initialize(jax.random.key(0))
    assert params["post_attention_norm"]["scale"].shape == params["post_ffn_norm"]["scale"].shape == (16,)
    x = np.random.default_rng(1).normal(size=(2, 5, 16)).astype(np.float32)

    def run(p):
        return np.asarray(axcore.functional(layer, p, inputs=(x,), prng_key=None, is_training=False)[0])

    # A post-norm's gain scales its sublayer's contribution: zero gains leave the residual stream alone,
    # and the attention's contribution alone is the RMS-normalized (unit RMS) output of the sublayer.
    zero = jax.tree.map(np.asarray, params)
    zero["post_attention_norm"]["scale"] = np.zeros(16, np.float32)
    zero["post_ffn_norm"]["scale"] = np.zeros(16, np.float32)
    np.testing.assert_array_equal(run(zero), x)
    ffn_off = jax.tree.map(np.asarray, params)
    ffn_off["post_ffn_norm"]["scale"] = np.zeros(16, np.float32)
    added = run(ffn_off) - x
    np.testing.assert_allclose(np.sqrt(np.mean(added.astype(np.float64) ** 2, -1)), 1.0, rtol=1e-4)


def _model(*overrides):
    exp = load_experiment(None, [*SMALL, *overrides])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    return model, model.initialize(jax.random.key(1))


def test_scale_embeddings_multiplies_the_table_rows_by_sqrt_dim():
    model, params = _model("model.scale_embeddings=true", "model.lm_head=null")
    ids = np.array([[3, 7, 3]])
    positions = np.arange(3)[None]
    embedded = functional(model, params, (ids, positions), None, False, method="_embed")[0]
    table = np.asarray(params["embedding"]["weight"])
    np.testing.assert_allclose(embedded, table[ids] * math.sqrt(32), rtol=1e-6)


def test_logits_softcap_is_c_tanh_of_logits_over_c():
    model, params = _model()
    capped, _ = _model("model.logits_softcap=0.5")
    ids = np.random.default_rng(2).integers(0, 256, size=(2, 6))
    raw = np.asarray(functional(model, params, (ids,), None, False, method="logits")[0], np.float64)
    assert np.abs(raw).max() > 1.0  # The cap bites.
    out = functional(capped, params, (ids,), None, False, method="logits")[0]
    np.testing.assert_allclose(out, 0.5 * np.tanh(raw / 0.5), rtol=1e-5, atol=1e-6)
