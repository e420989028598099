"""CausalLM's chunked head loss (`loss_chunk_len`): the unchunked loss and gradients, no full logits buffer."""

import re

import jax
import numpy as np
import pytest

import axcore
from axcore.layers import CausalLM

DIM, LAYERS, HEADS, HIDDEN = 16, 2, 2, 32
# A float32 array shape in HLO text, e.g. f32[2,64,512]{2,1,0}.
_F32_SHAPE = re.compile(r"f32\[([\d,]+)\]")


def _model(registries, vocab, **kw):
    cfg = CausalLM.default_config().set(vocab_size=vocab, dim=DIM, num_layers=LAYERS, **kw)
    cfg.decoder.layer.self_attention.num_heads = HEADS
    cfg.decoder.layer.feed_forward.hidden_dim = HIDDEN
    cfg.position_embedding.max_len = 64  # Smaller than the logits (the HLO test looks for the largest array).
    return cfg.instantiate(name="lm", registries=registries)


def _batch(vocab, batch, seq, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    labels[0, :3] = -1  # Ignored positions (weight 0).
    weights = (labels >= 0) * rng.uniform(0.5, 2.0, size=(batch, seq))
    return {
        "input_ids": rng.integers(0, vocab, size=(batch, seq)).astype(np.int32),
        "target_labels": labels,
        "target_weights": weights.astype(np.float32),
    }


def _loss_fn(model, batch):
    def loss(params):
        (value, metrics), _ = axcore.functional(model, params, (batch,), None, True)
        return value, metrics

    return loss


def _np_loss(logits, batch, z_loss_scale):
    """Weighted cross-entropy + z-loss of float64 logits (independent of axcore's code)."""
    logits = np.asarray(logits, np.float64)
    log_z = np.log(np.exp(logits).sum(-1))
    labels = np.maximum(batch["target_labels"], 0)
    picked = np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    w = batch["target_weights"].astype(np.float64)
    return ((log_z - picked) * w).sum() / w.sum() + z_loss_scale * (log_z**2 * w).sum() / w.sum()


@pytest.mark.parametrize(
    "settings, chunk_len",
    [
        ({"z_loss_scale": 1e-2}, 4),  # Untied head, 3 chunks of 12 positions.
        ({"z_loss_scale": 1e-3, "lm_head": None, "logits_softcap": 3.0}, 5),  # Tied head, soft-cap, padded to 15.
        ({}, 4096),  # A chunk longer than the row: one chunk of 12.
    ],
    ids=["untied_z_loss", "tied_softcap_padded", "one_chunk"],
)
def test_chunked_loss_and_gradients_equal_the_unchunked_ones(settings, chunk_len, registries):
    vocab, batch = 48, _batch(48, batch=2, seq=12)
    plain = _model(registries, vocab, **settings)
    chunked = _model(registries, vocab, loss_chunk_len=chunk_len, **settings)
    rng = np.random.default_rng(1)  # Random parameters of the right tree (initialize() compiles a sampler per shape).
    params = jax.tree.map(lambda a: np.asarray(0.5 * rng.normal(size=a.shape), a.dtype), plain.abstract_parameters())
    both = jax.jit(lambda p: (jax.value_and_grad(_loss_fn(chunked, batch), has_aux=True)(p),
                              jax.value_and_grad(_loss_fn(plain, batch), has_aux=True)(p)))
    ((loss, metrics), grads), ((ref_loss, ref_metrics), ref_grads) = both(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in ("cross_entropy", "z_loss", "num_tokens"):
        np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=1e-6, atol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    # And the loss is the NumPy cross-entropy of the model's logits.
    logits, _ = axcore.functional(plain, params, {"input_ids": batch["input_ids"]}, None, True, method="logits")
    np.testing.assert_allclose(loss, _np_loss(logits, batch, settings.get("z_loss_scale", 0.0)), rtol=1e-5)


def _largest_f32(hlo: str) -> int:
    """Elements of the largest float32 array in HLO text."""
    return max(int(np.prod([int(d) for d in dims.split(",")])) for dims in _F32_SHAPE.findall(hlo))


def test_compiled_chunked_gradient_holds_no_full_logits_buffer(registries):
    vocab, b, s, chunk_len = 512, 2, 64, 16
    batch = _batch(vocab, batch=b, seq=s)
    plain = _model(registries, vocab)
    chunked = _model(registries, vocab, loss_chunk_len=chunk_len)
    params = plain.abstract_parameters()

    def compiled(model):
        grad = jax.grad(lambda p: _loss_fn(model, batch)(p)[0])
        return jax.jit(grad).lower(params).compile()

    full, small = compiled(plain), compiled(chunked)
    # The unchunked gradient holds [b, s, vocab] float32 logits; the chunked one at most a chunk's.
    assert _largest_f32(full.as_text()) >= b * s * vocab
    assert _largest_f32(small.as_text()) <= b * chunk_len * vocab
    # XLA's buffer assignment saves at least one [b, s, vocab] float32 buffer.
    saved = full.memory_analysis().temp_size_in_bytes - small.memory_analysis().temp_size_in_bytes
    assert saved >= b * s * vocab * 4
