"""MixtureOfExperts (plugin axcore-moe) against a dense FeedForward and a per-token NumPy loop."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.errors import ConfigError
from axcore.layers import Activation, CausalLM, FeedForward

from axcore_moe import Gates, MixtureOfExperts

D, H = 8, 16


@pytest.fixture(scope="module")
def moe_registries():
    """Registries of a plugin manager with the moe plugin enabled."""
    return axcore.create_plugin_manager(["moe"]).registries


def _random_params(module, seed=0):
    """Random parameters drawn with NumPy (weights ~ N(0, 1/fan_in), scales 1): no init compile."""
    rng = np.random.default_rng(seed)

    def draw(a):
        if a.ndim == 1:
            return np.ones(a.shape, np.float32)
        return (rng.normal(size=a.shape) / math.sqrt(a.shape[-2])).astype(np.float32)

    return jax.tree.map(draw, module.abstract_parameters())


def _moe(registries, **kw):
    cfg = MixtureOfExperts.default_config().set(input_dim=D, hidden_dim=H, **kw)
    cfg.expert.activation = Activation.GELU_TANH
    layer = cfg.instantiate(name="moe", registries=registries)
    return layer, _random_params(layer)


def _apply(module, params, inputs, method="forward"):
    """`axcore.functional` under jit (one compile instead of one per eager op)."""
    return jax.jit(lambda p, i: axcore.functional(module, p, (i,), None, False, method))(params, inputs)


def _x(b=2, t=6, seed=1):
    return np.random.default_rng(seed).normal(size=(b, t, D)).astype(np.float32)


@pytest.mark.parametrize("gated", [False, True])
def test_one_expert_without_dropping_is_the_dense_feed_forward(gated):
    # Any feed-forward layer can be the expert: the core one, or the swiglu plugin's gated one.
    ffn_class = pytest.importorskip("axcore_swiglu").GatedFeedForward if gated else FeedForward
    registries = axcore.create_plugin_manager(["moe", "swiglu"] if gated else ["moe"]).registries
    cfg = MixtureOfExperts.default_config().set(input_dim=D, hidden_dim=H, num_experts=1, top_k=1, capacity_factor=None)
    cfg.expert = ffn_class.default_config()
    moe = cfg.instantiate(name="moe", registries=registries)
    params = _random_params(moe)
    ffn = ffn_class.default_config().set(input_dim=D, hidden_dim=H).instantiate(name="ffn", registries=registries)
    ffn_params = jax.tree.map(lambda w: w[0], params["expert"])  # Expert 0's weights.
    assert jax.tree.map(jnp.shape, ffn_params) == jax.tree.map(lambda a: a.shape, ffn.abstract_parameters())
    x = _x()
    expected, _ = _apply(ffn, ffn_params, x)
    actual, _ = _apply(moe, params, x)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def _np_reference(params, x, *, top_k, capacity_factor, renormalize=True):
    """Per-token loop: softmax, top-k, renormalize (or not), slots in (position, choice) order per sequence."""
    router = np.asarray(params["router"], np.float64)
    up = np.asarray(params["expert"]["up_proj"]["weight"], np.float64)
    down = np.asarray(params["expert"]["down_proj"]["weight"], np.float64)
    gelu = lambda h: 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))  # noqa: E731
    b, t, _ = x.shape
    e = router.shape[1]
    capacity = t if capacity_factor is None else min(t, math.ceil(capacity_factor * t * top_k / e))
    y, kept = np.zeros(x.shape), np.zeros((b, t, top_k), bool)
    logits = x.astype(np.float64) @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.zeros((b, t, top_k), int)
    for i in range(b):
        used = np.zeros(e, int)  # Assignments to each expert so far in this sequence.
        for j in range(t):
            experts = np.argsort(-probs[i, j])[:top_k]
            gates = probs[i, j, experts] / (probs[i, j, experts].sum() if renormalize else 1.0)
            chosen[i, j] = experts
            for c, (expert, gate) in enumerate(zip(experts, gates)):
                if used[expert] < capacity:
                    kept[i, j, c] = True
                    y[i, j] += gate * (gelu(x[i, j] @ up[expert]) @ down[expert])
                used[expert] += 1
    fraction = np.bincount(chosen.ravel(), minlength=e) / chosen.size
    load_balance = e * np.sum(fraction * probs.mean((0, 1)))
    log_z = np.log(np.exp(logits).sum(-1))
    return y, kept, chosen, load_balance, np.mean(log_z**2)


@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.3])
def test_routing_dropping_and_aux_losses_match_numpy(capacity_factor, moe_registries):
    moe, params = _moe(moe_registries, num_experts=4, top_k=2, capacity_factor=capacity_factor,
                       load_balance_loss_weight=0.5, router_z_loss_weight=0.25)
    x = _x(b=3, t=8)
    y, kept, chosen, load_balance, z_loss = _np_reference(params, x, top_k=2, capacity_factor=capacity_factor)
    routing, _ = _apply(moe, params, x, method="route")
    np.testing.assert_array_equal(routing.experts, chosen)
    np.testing.assert_array_equal(routing.kept, kept)
    out, collection = _apply(moe, params, x)
    np.testing.assert_allclose(out, y, rtol=1e-4, atol=1e-5)
    summaries = collection.summaries
    np.testing.assert_allclose(summaries["load_balance_loss"], load_balance, rtol=1e-5)
    np.testing.assert_allclose(summaries["router_z_loss"], z_loss, rtol=1e-5)
    np.testing.assert_allclose(collection.module_outputs["aux_loss"], 0.5 * load_balance + 0.25 * z_loss, rtol=1e-5)
    np.testing.assert_allclose(summaries["dropped_assignment_fraction"], 1 - kept.mean(), atol=1e-6)
    np.testing.assert_allclose(summaries["dropped_token_fraction"], 1 - kept.any(-1).mean(), atol=1e-6)
    if capacity_factor is None:
        assert kept.all()
    if capacity_factor == 0.3:  # capacity = ceil(0.3 * 8 * 2 / 4) = 2 slots per expert per sequence.
        assert moe.capacity(8) == 2 and 0 < kept.mean() < 1 and not kept.any(-1).all()
        assert np.all(np.asarray(out)[~kept.any(-1)] == 0)  # Fully dropped tokens contribute exactly 0.
        for i in range(3):  # Each expert serves its first two assignments of each sequence.
            for expert in range(4):
                served = kept[i][chosen[i] == expert]
                assert served.sum() == min(2, served.size) and served[: served.sum()].all()


def test_unnormalized_gates_weigh_experts_by_their_probabilities(moe_registries):
    # Qwen-MoE's norm_topk_prob false: the k gates are the softmax probabilities, summing to less than 1.
    moe, params = _moe(moe_registries, num_experts=4, top_k=2, capacity_factor=None, gates=Gates.PROBABILITIES)
    x = _x(b=2, t=8)
    y, *_ = _np_reference(params, x, top_k=2, capacity_factor=None, renormalize=False)
    renormalized, *_ = _np_reference(params, x, top_k=2, capacity_factor=None)
    assert np.abs(y - renormalized).max() > 1e-2  # The two weightings differ here.
    routing, _ = _apply(moe, params, x, method="route")
    assert float(jnp.max(jnp.sum(routing.gates, -1))) < 1 - 1e-3
    out, _ = _apply(moe, params, x)
    np.testing.assert_allclose(out, y, rtol=1e-4, atol=1e-5)


def test_aux_loss_is_added_to_the_causal_lm_loss_exactly(moe_registries):
    cfg = CausalLM.default_config().set(vocab_size=32, dim=D, num_layers=2)
    cfg.decoder.layer.self_attention.num_heads = 2
    cfg.decoder.layer.feed_forward = MixtureOfExperts.default_config().set(
        hidden_dim=H, num_experts=4, top_k=2, load_balance_loss_weight=0.1, router_z_loss_weight=0.01)
    model = cfg.instantiate(name="model", registries=moe_registries)
    ids = np.random.default_rng(0).integers(0, 32, (2, 8))
    params = _random_params(model)
    (loss, metrics), collection = _apply(model, params, {"input_ids": ids, "target_labels": ids})
    layers = collection.module_outputs["decoder"]
    recorded = [float(layers[f"layer{i}"]["feed_forward"]["aux_loss"]) for i in range(2)]
    assert min(recorded) > 0
    np.testing.assert_allclose(float(metrics["aux_loss"]), sum(recorded), rtol=1e-6)
    # loss = cross-entropy + the aux losses (z_loss_scale is 0).
    np.testing.assert_allclose(float(loss), float(metrics["cross_entropy"]) + sum(recorded), rtol=1e-6)


def test_expert_weights_carry_the_expert_logical_axis(moe_registries):
    moe, _ = _moe(moe_registries, num_experts=4)
    specs = moe.parameter_specs()
    assert specs["router"].shape == (D, 4) and specs["router"].mesh_axes == ("embed", None)
    assert specs["expert"]["up_proj"]["weight"].shape == (4, D, H)
    assert specs["expert"]["up_proj"]["weight"].mesh_axes == ("expert", "embed", "mlp")
    assert specs["expert"]["down_proj"]["weight"].mesh_axes == ("expert", "mlp", "embed")
    spec = specs["expert"]["up_proj"]["weight"]
    up = np.asarray(jax.jit(spec.initializer, static_argnums=(1, 2))(jax.random.key(0), spec.shape, spec.dtype))
    assert not np.allclose(up[0], up[1])  # Experts are initialized independently.
    np.testing.assert_allclose(up.std(), 1 / math.sqrt(D), rtol=0.2)  # Per-expert fan-in.


def test_bad_routing_settings_are_config_errors(moe_registries):
    with pytest.raises(ConfigError, match="top_k"):
        _moe(moe_registries, num_experts=2, top_k=3)
    with pytest.raises(ConfigError, match="capacity_factor"):
        _moe(moe_registries, capacity_factor=0.0)
