"""CausalLM and cross_entropy against NumPy; aux losses; jit and grad."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.layers import CausalLM, FeedForward, RepeatedTransformer, TransformerLayer, cross_entropy

VOCAB, DIM, LAYERS, HEADS, HIDDEN = 32, 16, 2, 2, 32
_erf = np.vectorize(math.erf)


# -- NumPy references ----------------------------------------------------------------------


def np_log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def np_cross_entropy(logits, labels, weights, z_loss_scale=0.0):
    logits = np.asarray(logits, np.float64)
    logp = np_log_softmax(logits)
    nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    log_z = np.log(np.exp(logits).sum(-1))
    # Weighted means (the tests keep sum(weights) >= 1, where axcore's guard against
    # dividing by zero, max(sum(weights), 1), does not change the denominator).
    assert weights.sum() >= 1.0
    xent = (nll * weights).sum() / weights.sum()
    z = (log_z**2 * weights).sum() / weights.sum()
    return xent + z_loss_scale * z, xent, z


def np_rms_norm(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def np_causal_attention(p, x):
    q = np.einsum("btd,dnh->btnh", x, p["wq"])
    k = np.einsum("btd,dnh->btnh", x, p["wk"])
    v = np.einsum("btd,dnh->btnh", x, p["wv"])
    t = x.shape[1]
    logits = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("btnh,nhd->btd", np.einsum("bnts,bsnh->btnh", probs, v), p["wo"])


def np_lm_hidden(params, ids):
    """Embedding + learned positions + pre-norm layers (GELU MLP) + final RMSNorm."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = p["embedding"]["weight"][ids] + p["position_embedding"]["weight"][np.arange(ids.shape[1])][None]
    for i in range(LAYERS):
        lp = p["decoder"][f"layer{i}"]
        x = x + np_causal_attention(lp["self_attention"], np_rms_norm(x, lp["attention_norm"]["scale"]))
        h = np_rms_norm(x, lp["ffn_norm"]["scale"]) @ lp["feed_forward"]["up_proj"]["weight"]
        h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
        x = x + h @ lp["feed_forward"]["down_proj"]["weight"]
    return np_rms_norm(x, p["final_norm"]["scale"])


# -- Helpers ---------------------------------------------------------------------------------


def _cfg(**kw):
    cfg = CausalLM.default_config().set(vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, **kw)
    cfg.decoder.layer.self_attention.num_heads = HEADS
    cfg.decoder.layer.feed_forward.hidden_dim = HIDDEN
    return cfg


def _model(registries, **kw):
    model = _cfg(**kw).instantiate(name="lm", registries=registries)
    return model, model.initialize(jax.random.key(0))


def _batch(seed=0, batch=2, seq=6):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(batch, seq)).astype(np.int32)
    labels = rng.integers(0, VOCAB, size=(batch, seq)).astype(np.int32)
    return ids, labels


def _loss(model, params, batch):
    (loss, metrics), _ = axcore.functional(model, params, (batch,), prng_key=None, is_training=False)
    return loss, metrics


def _logits(model, params, ids):
    out, _ = axcore.functional(model, params, {"input_ids": ids}, None, False, method="logits")
    return np.asarray(out)


# -- cross_entropy ---------------------------------------------------------------------------


def test_cross_entropy_matches_numpy_with_weights_and_z_loss():
    rng = np.random.default_rng(0)
    # The LM's logits shape, so that these ops compile once for both.
    logits = (3 * rng.normal(size=(2, 6, VOCAB))).astype(np.float32)
    labels = rng.integers(0, VOCAB, size=(2, 6)).astype(np.int32)
    weights = rng.uniform(0, 2, size=(2, 6)).astype(np.float32)
    weights[0, :2] = 0.0
    loss, metrics = cross_entropy(logits, labels, weights, z_loss_scale=0.1)
    ref_loss, ref_xent, ref_z = np_cross_entropy(logits, labels, weights, 0.1)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["cross_entropy"], ref_xent, rtol=1e-5)
    np.testing.assert_allclose(metrics["z_loss"], ref_z, rtol=1e-5)
    np.testing.assert_allclose(metrics["num_tokens"], weights.sum(), rtol=1e-6)


def test_cross_entropy_with_zero_weights_is_zero_not_nan():
    logits = np.ones((2, 6, VOCAB), np.float32)
    loss, metrics = cross_entropy(logits, np.zeros((2, 6), np.int32), np.zeros((2, 6), np.float32), 1.0)
    assert float(loss) == 0.0 and float(metrics["num_tokens"]) == 0.0


# -- CausalLM --------------------------------------------------------------------------------


def test_default_config_makes_attention_causal(registries):
    model = _cfg().instantiate(name="lm", registries=registries)
    assert model.decoder.layer0.self_attention.config.causal
    assert model.decoder.layer1.self_attention.config.causal


@pytest.mark.parametrize("z_loss_scale", [0.0, 0.01])
def test_loss_is_cross_entropy_of_logits_with_negative_labels_ignored(z_loss_scale, registries):
    model, params = _model(registries, z_loss_scale=z_loss_scale)
    ids, labels = _batch()
    labels[1, 3:] = -1
    loss, metrics = _loss(model, params, {"input_ids": ids, "target_labels": labels})
    logits = _logits(model, params, ids)
    weights = (labels >= 0).astype(np.float64)
    ref_loss, ref_xent, _ = np_cross_entropy(logits, np.maximum(labels, 0), weights, z_loss_scale)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["cross_entropy"], ref_xent, rtol=1e-5)
    assert float(metrics["num_tokens"]) == 9.0
    assert float(metrics["aux_loss"]) == 0.0


def test_explicit_target_weights_are_used(registries):
    model, params = _model(registries)
    ids, labels = _batch(1)
    weights = np.random.default_rng(1).uniform(size=labels.shape).astype(np.float32)
    loss, _ = _loss(model, params, {"input_ids": ids, "target_labels": labels, "target_weights": weights})
    ref, _, _ = np_cross_entropy(_logits(model, params, ids), labels, weights.astype(np.float64))
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def test_tied_head_logits_equal_independent_forward_times_embedding_transpose(registries):
    model, params = _model(registries, lm_head=None)
    assert "lm_head" not in params
    ids, _ = _batch(2)
    hidden = np_lm_hidden(params, ids)
    expected = hidden @ np.asarray(params["embedding"]["weight"], np.float64).T
    np.testing.assert_allclose(_logits(model, params, ids), expected, rtol=1e-4, atol=1e-5)


def test_untied_head_logits_use_lm_head_weight(registries):
    model, params = _model(registries)
    assert params["lm_head"]["weight"].shape == (DIM, VOCAB)
    ids, _ = _batch(3)
    expected = np_lm_hidden(params, ids) @ np.asarray(params["lm_head"]["weight"], np.float64)
    np.testing.assert_allclose(_logits(model, params, ids), expected, rtol=1e-4, atol=1e-5)


def test_future_tokens_do_not_change_earlier_logits(registries):
    model, params = _model(registries)
    ids, _ = _batch(4)
    changed = ids.copy()
    changed[:, -1] = (ids[:, -1] + 1) % VOCAB
    a, b = _logits(model, params, ids), _logits(model, params, changed)
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, -1], b[:, -1], atol=1e-4)


def test_lm_refuses_a_non_causal_decoder(registries):
    """Switching the decoder to a scan (as `decoder: {type: repeated_transformer}` in YAML
    does) starts from non-causal defaults; the LM must refuse rather than see the future."""
    cfg = _cfg()
    layer = TransformerLayer.default_config()
    layer.self_attention.num_heads = HEADS
    layer.feed_forward.hidden_dim = HIDDEN
    cfg.decoder = RepeatedTransformer.default_config().set(layer=layer)
    with pytest.raises(axcore.ConfigError, match=r"decoder\.layer\.self_attention.*set causal: true"):
        cfg.instantiate(name="lm", registries=registries)
    layer.self_attention.causal = True
    cfg.decoder = RepeatedTransformer.default_config().set(layer=layer)
    cfg.instantiate(name="lm", registries=registries)


AUX = 0.25


class AuxFeedForward(FeedForward):
    """A FeedForward that records a constant auxiliary loss."""

    def forward(self, x):
        self.add_module_output("aux_loss", jnp.asarray(AUX, jnp.float32))
        return super().forward(x)


@pytest.mark.parametrize("decoder", ["stacked", "repeated"])
def test_descendant_aux_losses_are_added_to_the_loss(decoder, registries):
    model, params = _model(registries)
    ids, labels = _batch(5)
    batch = {"input_ids": ids, "target_labels": labels}
    # Baseline: the plain stacked model (a repeated decoder gives the same numbers for
    # the same params, which test_repeated_transformer checks).
    base, _ = _loss(model, params, batch)
    aux_cfg = _cfg()
    if decoder == "repeated":
        aux_cfg.decoder = RepeatedTransformer.default_config().set(layer=aux_cfg.decoder.layer)
        layers = [params["decoder"][f"layer{i}"] for i in range(LAYERS)]
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(a) for a in xs]), *layers)
        params = dict(params, decoder={"layer": stacked})
    aux_cfg.decoder.layer.feed_forward = AuxFeedForward.default_config().set(hidden_dim=HIDDEN)
    aux_model = aux_cfg.instantiate(name="lm", registries=registries)
    with_aux, metrics = _loss(aux_model, params, batch)
    np.testing.assert_allclose(float(with_aux) - float(base), LAYERS * AUX, rtol=1e-4)
    np.testing.assert_allclose(metrics["aux_loss"], LAYERS * AUX, rtol=1e-6)
    # The aux loss does not leak into the cross-entropy metric.
    np.testing.assert_allclose(metrics["cross_entropy"], base, rtol=1e-5)


def test_loss_under_jit_and_grad(registries):
    model, params = _model(registries)
    ids, labels = _batch(6)
    batch = {"input_ids": ids, "target_labels": labels}

    def loss_fn(p):
        return _loss(model, p, batch)[0]

    eager = loss_fn(params)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    np.testing.assert_allclose(loss, eager, rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    for g in jax.tree.leaves(grads):
        assert np.all(np.isfinite(g))
    # lm_head gradient is dlogits^T h: check it against the NumPy forward.
    hidden = np_lm_hidden(params, ids)
    probs = np.exp(np_log_softmax(_logits(model, params, ids)))
    dlogits = (probs - np.eye(VOCAB)[labels]) / labels.size
    expected = np.einsum("btd,btv->dv", hidden, dlogits)
    np.testing.assert_allclose(grads["lm_head"]["weight"], expected, rtol=1e-4, atol=1e-6)
    # Only the positions that occur get position-embedding gradient.
    pos_grad = np.abs(np.asarray(grads["position_embedding"]["weight"])).sum(-1)
    assert np.all(pos_grad[: ids.shape[1]] > 0) and np.all(pos_grad[ids.shape[1] :] == 0)
    # A small gradient step lowers the loss.
    stepped = jax.tree.map(lambda p, g: np.asarray(p) - 0.05 * np.asarray(g), params, grads)
    assert float(loss_fn(stepped)) < float(loss)
