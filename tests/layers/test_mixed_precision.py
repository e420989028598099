"""The dtype policy: float32 parameters, compute-dtype activations at every layer boundary,
float32 logits and loss, and inheritance of param_dtype / compute_dtype down the tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.layers import CausalLM, Embedding, FeedForward, MultiheadAttention, RMSNorm, TransformerLayer
from axcore.testing import TINY_OVERRIDES


def _spy(monkeypatch, cls, method, seen):
    original = getattr(cls, method)

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        arrays = [a for a in args if hasattr(a, "dtype")]
        seen.append((f"{cls.__name__}.{method}", [str(a.dtype) for a in arrays], str(out.dtype)))
        return out

    monkeypatch.setattr(cls, method, spy)


def test_bfloat16_compute_keeps_float32_parameters_and_float32_logits_and_loss(monkeypatch):
    exp = axcore.load_experiment(None, [*TINY_OVERRIDES, "model.compute_dtype=bfloat16"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    assert {str(p.dtype) for p in jax.tree.leaves(params)} == {"float32"}
    seen = []
    for cls, method in [(Embedding, "forward"), (RMSNorm, "forward"), (MultiheadAttention, "forward"),
                        (FeedForward, "forward"), (TransformerLayer, "forward"), (CausalLM, "logits")]:
        _spy(monkeypatch, cls, method, seen)
    ids = np.arange(2 * 16).reshape(2, 16) % 256
    (loss, metrics), _ = axcore.functional(model, params, ({"input_ids": ids, "target_labels": ids},), None, True)
    assert loss.dtype == jnp.float32 and metrics["cross_entropy"].dtype == jnp.float32
    boundaries = {name for name, _, _ in seen}
    assert boundaries == {"Embedding.forward", "RMSNorm.forward", "MultiheadAttention.forward",
                          "FeedForward.forward", "TransformerLayer.forward", "CausalLM.logits"}
    for name, inputs, output in seen:
        if name == "Embedding.forward":
            assert output == "bfloat16"  # Token ids in, compute dtype out.
        elif name == "CausalLM.logits":
            assert output == "float32"
        else:
            assert inputs == ["bfloat16"] and output == "bfloat16", (name, inputs, output)
    grads = jax.grad(lambda p: axcore.functional(model, p, ({"input_ids": ids, "target_labels": ids},), None, True)[0][0])(params)
    assert {str(g.dtype) for g in jax.tree.leaves(grads)} == {"float32"}


def test_bfloat16_compute_is_close_to_float32():
    ids = np.arange(2 * 16).reshape(2, 16) % 256
    losses = {}
    for dtype in ("float32", "bfloat16"):
        exp = axcore.load_experiment(None, [*TINY_OVERRIDES, f"model.compute_dtype={dtype}"])
        model = exp.config.model.instantiate(name="model", registries=exp.registries)
        params = model.initialize(jax.random.key(0))
        (loss, _), _ = axcore.functional(model, params, ({"input_ids": ids, "target_labels": ids},), None, False)
        losses[dtype] = float(loss)
    assert losses["float32"] != losses["bfloat16"]  # bfloat16 really ran...
    assert losses["bfloat16"] == pytest.approx(losses["float32"], abs=0.02)  # ...close to float32.


def test_dtypes_set_on_the_model_apply_to_every_layer_unless_overridden(registries):
    cfg = CausalLM.default_config().set(vocab_size=32, dim=16, num_layers=2, param_dtype="bfloat16", compute_dtype="bfloat16")
    cfg.decoder.layer.self_attention.num_heads = 2
    cfg.decoder.layer.feed_forward.hidden_dim = 32
    cfg.decoder.layer.feed_forward.param_dtype = "float32"  # An override for one sublayer and its children.
    model = cfg.instantiate(name="model", registries=registries)
    specs = model.parameter_specs()
    flat = {"/".join(str(k.key) for k in path): spec.dtype for path, spec in jax.tree_util.tree_flatten_with_path(specs)[0]}
    for name, dtype in flat.items():
        expected = np.float32 if "feed_forward" in name else jnp.bfloat16
        assert np.dtype(dtype) == np.dtype(expected), name
    assert model.decoder.layer0.feed_forward.up_proj.compute_dtype == np.dtype(jnp.bfloat16)
    default = CausalLM.default_config().set(vocab_size=32, dim=16, num_layers=1)
    default.decoder.layer.self_attention.num_heads = 2
    default.decoder.layer.feed_forward.hidden_dim = 32
    plain = default.instantiate(name="model", registries=registries)
    assert plain.param_dtype == np.float32 and plain.decoder.layer0.self_attention.compute_dtype == np.float32
