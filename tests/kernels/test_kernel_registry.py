"""Kernel selection by priority, `is_supported` and name; plugins; attention layers using it."""

import logging
import math

import jax
import numpy as np
import pytest

import axcore
from axcore.errors import DuplicateComponentError, UnknownComponentError
from axcore.kernels import ATTENTION, SUPPORTED, AttentionProblem, KernelRegistry, Support, XlaAttention
from axcore.layers import MultiheadAttention
from axcore.registry import Provenance

DIM, HEADS = 16, 4


class FakeKernel:
    """Attention kernel that returns 2 * the reference result and records its calls."""

    def __init__(self, name="fake", priority=10, support=SUPPORTED):
        self.name = name
        self.priority = priority
        self.support = support
        self.problems = []
        self.calls = []

    def is_supported(self, problem):
        self.problems.append(problem)
        return self.support

    def __call__(self, problem, q, k, v, **inputs):
        self.calls.append({"problem": problem, **inputs})
        return 2.0 * XlaAttention()(problem, q, k, v, **inputs)


class KernelPlugin:
    def __init__(self, *kernels, override=False):
        self.kernels = kernels
        self.override = override

    @axcore.hookimpl
    def axcore_register_attention_kernels(self, register):
        for kernel in self.kernels:
            register(kernel, override=self.override)


def _registries(*kernels, override=False):
    pm = axcore.create_plugin_manager(["fake"], objects={"fake": KernelPlugin(*kernels, override=override)})
    return pm.registries


def _problem(num_heads=HEADS, num_kv_heads=HEADS):
    q = np.zeros((2, 6, num_heads, 4), np.float32)
    k = np.zeros((2, 6, num_kv_heads, 4), np.float32)
    return AttentionProblem.of(q, k, causal=True)


def _attention(registries, **kw):
    cfg = MultiheadAttention.default_config().set(input_dim=DIM, num_heads=HEADS, causal=True, **kw)
    layer = cfg.instantiate(name="attn", registries=registries)
    return layer, layer.initialize(jax.random.key(0))


def _x():
    return np.random.default_rng(0).normal(size=(2, 6, DIM)).astype(np.float32)


def np_reference_layer(params, x):
    """Causal MHA of the layer's weights in NumPy."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    q, k, v = (np.einsum("btd,dnh->btnh", x.astype(np.float64), p[w]) for w in ("wq", "wk", "wv"))
    logits = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
    logits = np.where(np.tril(np.ones((6, 6), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("btnh,nhd->btd", np.einsum("bnts,bsnh->btnh", probs, v), p["wo"])


def _run(layer, params, inputs):
    out, _ = axcore.functional(layer, params, inputs=inputs, prng_key=None, is_training=False)
    return np.asarray(out)


# The built-in context-parallel kernels (they decline every problem without a `context` mesh axis).
CONTEXT = ("context_all_gather", "context_ring")


# -- Selection -------------------------------------------------------------------------------


def test_builtin_registries_have_the_xla_and_the_context_parallel_attention_kernels():
    registries = axcore.create_plugin_manager().registries
    # The context kernels decline every problem whose sequence is not split over a `context` mesh axis.
    assert [k.name for k in registries.kernels.candidates(ATTENTION)] == ["context_all_gather", "context_ring", "xla"]
    assert registries.kernels.select(ATTENTION, _problem()).name == "xla"


def test_higher_priority_supported_kernel_is_selected_and_used_by_the_layer():
    fake = FakeKernel(priority=10)
    registries = _registries(fake)
    assert [k.name for k in registries.kernels.candidates(ATTENTION) if k.name not in CONTEXT] == ["fake", "xla"]
    assert registries.kernels.select(ATTENTION, _problem()) is fake
    layer, params = _attention(registries)
    x = _x()
    out = _run(layer, params, (x,))
    np.testing.assert_allclose(out, 2.0 * np_reference_layer(params, x), rtol=1e-5, atol=1e-5)
    assert len(fake.calls) == 1
    call = fake.calls[0]
    assert call["problem"].causal is True and not call["problem"].has_bias and "kv_mask" not in call
    assert call["problem"].scale == pytest.approx(1 / math.sqrt(DIM // HEADS))


def test_kernel_sees_the_layers_problem():
    fake = FakeKernel()
    layer, params = _attention(_registries(fake), num_kv_heads=2)
    x = _x()
    _run(layer, params, {"x": x, "kv_mask": np.ones((2, 6), bool)})
    problem = fake.problems[-1]
    assert (problem.batch, problem.q_len, problem.kv_len) == (2, 6, 6)
    assert (problem.num_heads, problem.num_kv_heads, problem.head_dim) == (HEADS, 2, DIM // HEADS)
    assert problem.causal and problem.has_kv_mask and not problem.has_bias
    assert problem.dtype == np.float32 and problem.platform == jax.default_backend()


def test_declining_kernel_falls_back_to_xla_and_logs_why(caplog):
    fake = FakeKernel(priority=10, support=Support(False, "head_dim too small for the fake"))
    registries = _registries(fake)
    with caplog.at_level(logging.INFO, logger="axcore.kernels.registry"):
        assert registries.kernels.select(ATTENTION, _problem()).name == "xla"
    assert "head_dim too small for the fake" in caplog.text
    with caplog.at_level(logging.INFO, logger="axcore.kernels.registry"):
        registries.kernels.select(ATTENTION, _problem())  # Same reason again: not logged twice.
    assert caplog.text.count("head_dim too small for the fake") == 1
    layer, params = _attention(registries)
    x = _x()
    np.testing.assert_allclose(_run(layer, params, (x,)), np_reference_layer(params, x), rtol=1e-5, atol=1e-5)
    assert fake.problems and not fake.calls


def test_lower_priority_kernel_loses_to_xla():
    fake = FakeKernel(priority=-1)
    registries = _registries(fake)
    assert [k.name for k in registries.kernels.candidates(ATTENTION) if k.name not in CONTEXT] == ["xla", "fake"]
    assert registries.kernels.select(ATTENTION, _problem()).name == "xla"


@pytest.mark.parametrize("order", [("alpha", "beta"), ("beta", "alpha")])
def test_priority_ties_are_broken_by_name_not_registration_order(order):
    kernels = {name: FakeKernel(name=name, priority=5) for name in order}
    pm = axcore.create_plugin_manager(
        list(order), objects={name: KernelPlugin(kernel) for name, kernel in kernels.items()}
    )
    registries = pm.registries
    assert [k.name for k in registries.kernels.candidates(ATTENTION) if k.name not in CONTEXT] == ["alpha", "beta", "xla"]
    assert registries.kernels.select(ATTENTION, _problem()) is kernels["alpha"]
    # Same with a bare registry, registering in the given order.
    registry = KernelRegistry()
    for name in order:
        registry.register(ATTENTION, kernels[name], Provenance("test", "test"))
    assert registry.select(ATTENTION, _problem()).name == "alpha"


# -- Requesting a kernel by name ---------------------------------------------------------------


def test_requested_kernel_is_used_even_with_lower_priority():
    fake = FakeKernel(priority=-5)
    registries = _registries(fake)
    layer, params = _attention(registries, kernel="fake")
    x = _x()
    np.testing.assert_allclose(_run(layer, params, (x,)), 2.0 * np_reference_layer(params, x), rtol=1e-5, atol=1e-5)
    assert len(fake.calls) == 1


def test_requesting_xla_bypasses_a_higher_priority_kernel():
    fake = FakeKernel(priority=10)
    layer, params = _attention(_registries(fake), kernel="xla")
    x = _x()
    np.testing.assert_allclose(_run(layer, params, (x,)), np_reference_layer(params, x), rtol=1e-5, atol=1e-5)
    assert not fake.calls


def test_requested_kernel_that_declines_raises_kernel_not_supported():
    fake = FakeKernel(support=Support(False, "no causal support"))
    registries = _registries(fake)
    with pytest.raises(axcore.KernelNotSupportedError, match="no causal support"):
        registries.kernels.select(ATTENTION, _problem(), requested="fake")
    layer, params = _attention(registries, kernel="fake")
    with pytest.raises(axcore.KernelNotSupportedError, match="fake"):
        _run(layer, params, (_x(),))
    assert not fake.calls


def test_requesting_an_unknown_kernel_or_op_raises_unknown_component():
    registries = _registries(FakeKernel())
    with pytest.raises(UnknownComponentError, match="flash"):
        registries.kernels.select(ATTENTION, _problem(), requested="flash")
    with pytest.raises(UnknownComponentError, match="no_such_op"):
        registries.kernels.select("no_such_op", _problem())
    with pytest.raises(UnknownComponentError, match="no_such_op"):
        registries.kernels.select("no_such_op", _problem(), requested="xla")
    with pytest.raises(TypeError, match="AttentionProblem"):
        registries.kernels.select("dot", _problem())


def test_no_supporting_kernel_raises_with_every_reason():
    registry = KernelRegistry()
    for name, reason in [("a", "reason A"), ("b", "reason B")]:
        registry.register(ATTENTION, FakeKernel(name, 1, Support(False, reason)), Provenance("t", "t"))
    with pytest.raises(axcore.KernelNotSupportedError) as info:  # The reference declines 3 heads over 2 kv heads.
        registry.select(ATTENTION, _problem(num_heads=3, num_kv_heads=2))
    assert "reason A" in str(info.value) and "reason B" in str(info.value) and "multiple" in str(info.value)


# -- Registration --------------------------------------------------------------------------


def test_kernel_named_like_a_builtin_needs_override():
    with pytest.raises(DuplicateComponentError, match="xla"):
        _registries(FakeKernel(name="xla", priority=0))
    replacement = FakeKernel(name="xla", priority=0)
    registries = _registries(replacement, override=True)
    assert registries.kernels.select(ATTENTION, _problem()) is replacement


def test_object_without_kernel_interface_is_rejected():
    class NotAKernel:
        name = "broken"
        priority = 1

    with pytest.raises(axcore.PluginLoadError, match="broken"):
        _registries(NotAKernel())
