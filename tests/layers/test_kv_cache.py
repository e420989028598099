"""KV-cache decoding equals the full forward: prefill + one token at a time gives the
logits `CausalLM.logits` computes over the whole sequence (the independent reference
is the training forward, which never sees a cache)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.experiment import load_experiment
from axcore.layers.transformer import TransformerLayer
from axcore.module import functional

SMALL = [
    "model.dim=32",
    "model.num_layers=2",
    "model.decoder.layer.self_attention.num_heads=4",
    "model.decoder.layer.feed_forward.hidden_dim=48",
    "input.seq_len=16",
    "model.compute_dtype=float32",  # Also on a GPU, whose mesh rules would switch compute to bfloat16.
]
GQA = ["model.decoder.layer.self_attention.num_kv_heads=2"]

CASES = {
    "default (learned positions, MHA)": (None, ["model.position_embedding.max_len=16"]),
    "rope + GQA + swiglu": (None, ["plugins=[rope, swiglu]", *GQA]),
    "rope + GQA, scanned stack": ("scan", ["plugins=[rope]", *GQA]),
    "alibi + sliding window": (None, ["plugins=[alibi]", "model.decoder.layer.self_attention.sliding_window=3"]),
    "moe (no token dropped) + rope": (None, ["plugins=[rope, moe]", "moe.capacity_factor=null", *GQA]),
    "q/k norm + rope + GQA": (
        None,
        ["plugins=[rope]", *GQA, "model.decoder.layer.self_attention.q_norm.type=rms_norm",
         "model.decoder.layer.self_attention.k_norm.type=rms_norm"],
    ),
}


def _model(source, overrides):
    exp = load_experiment(source, [*SMALL, *overrides])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    return model, model.initialize(jax.random.key(1))


@pytest.mark.parametrize("case", list(CASES))
def test_decoding_token_by_token_matches_the_full_forward(case):
    model, params = _model(*CASES[case])
    batch, prompt, total = 3, 5, 12
    ids = jax.random.randint(jax.random.key(2), (batch, total), 0, 256)
    full = jax.jit(lambda p, x: functional(model, p, (x,), None, False, method="logits")[0])(params, ids)
    prefill = jax.jit(lambda p, x, c: functional(model, p, (x, c), None, False, method="extend")[0])
    step = jax.jit(lambda p, x, c, pos: functional(model, p, (x, c, pos), None, False, method="extend")[0])
    logits, cache = prefill(params, ids[:, :prompt], model.init_cache(batch, total))
    decoded = [logits]
    for t in range(prompt, total):
        logits, cache = step(params, ids[:, t : t + 1], cache, jnp.full((batch, 1), t))
        decoded.append(logits)
    decoded = jnp.concatenate(decoded, axis=1)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), atol=2e-5, rtol=1e-5)
    leaves = jax.tree.leaves(cache)
    assert leaves and all(leaf.shape[-4:-2] == (batch, total) for leaf in leaves)


def test_each_sequence_decodes_at_its_own_position():
    """Prompts of different lengths in one batch: row b continues from its own length; its
    logits equal a full forward over that row alone, and the prefill's padding is never seen."""
    model, params = _model(None, ["plugins=[rope, swiglu]", *GQA])
    lengths, total = np.array([2, 5, 3]), 9
    ids = jax.random.randint(jax.random.key(3), (3, total), 0, 256)
    full = jax.jit(lambda p, x: functional(model, p, (x,), None, False, method="logits")[0])(params, ids)
    extend = jax.jit(lambda p, *args: functional(model, p, args, None, False, method="extend")[0])
    padded = jnp.where(jnp.arange(5)[None, :] < lengths[:, None], ids[:, :5], 255)  # Garbage after each prompt.
    logits, cache = extend(params, padded, model.init_cache(3, total))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, n - 1], full[b, n - 1], atol=2e-5, rtol=1e-5)
    for i in range(total - lengths.max()):
        positions = jnp.asarray(lengths + i)[:, None]
        tokens = jnp.take_along_axis(ids, positions, axis=1)
        logits, cache = extend(params, tokens, cache, positions)
        expected = jnp.take_along_axis(full, positions[:, :, None], axis=1)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=2e-5, rtol=1e-5)


def test_a_cache_longer_than_the_learned_positions_is_refused():
    model, _ = _model(None, ["model.position_embedding.max_len=16"])
    with pytest.raises(ValueError, match="max_len 16"):
        model.init_cache(1, 17)


class NoAttentionBlock(TransformerLayer):
    def attention_block(self, x, **kwargs):
        return x


def test_a_layer_whose_forward_skips_its_attention_cannot_decode_silently():
    cfg = NoAttentionBlock.default_config().set(input_dim=16)
    cfg.self_attention.set(num_heads=2)
    cfg.feed_forward.set(hidden_dim=32)
    layer = cfg.instantiate(name="l", registries=axcore.create_plugin_manager([]).registries)
    params = layer.initialize(jax.random.key(0))
    x = jnp.ones((1, 3, 16), jnp.float32)
    with pytest.raises(TypeError, match="its self_attention was never called"):
        inputs = {"x": x, "cache": layer.init_cache(1, 3), "positions": jnp.arange(3)[None]}
        functional(layer, params, inputs, None, False, method="extend")
