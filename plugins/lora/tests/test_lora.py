"""The lora plugin on the tiny model: fresh adapters change nothing, only adapters train, bad settings refused.

Tiny model (axcore.testing.TINY_OVERRIDES): dim 32, 2 layers, 2 heads of 16, feed-forward hidden 64 (up/down),
so per layer the targeted projections are q, k, v `[32 -> 32]`, o `[32 -> 32]`, up `[32 -> 64]`
and down `[64 -> 32]`.
"""

import math

import jax
import numpy as np
import pytest

import axcore
from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.step import TrainStep

from axcore_lora import LoraConfigError

RANK = 4
# (in, out) of every targeted projection of one tiny layer.
SITES = {"q": (32, 32), "k": (32, 32), "v": (32, 32), "o": (32, 32), "up": (32, 64), "down": (64, 32)}


def _experiment(*extra):
    return load_experiment(None, [*TINY_OVERRIDES, "plugins=[lora]", f"lora.rank={RANK}", *extra])


def _flat(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_fresh_adapters_give_the_base_logits_exactly():
    exp, base = _experiment(), load_experiment(None, TINY_OVERRIDES)
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    base_model = base.config.model.instantiate(name="model", registries=base.registries)
    params, base_params = model.initialize(jax.random.key(0)), base_model.initialize(jax.random.key(0))
    ids = next(exp.config.input.make_iterator(Split.TRAIN))["input_ids"]
    logits = jax.jit(lambda p: axcore.functional(model, p, (ids,), None, False, method="logits")[0])(params)
    expected = jax.jit(lambda p: axcore.functional(base_model, p, (ids,), None, False, method="logits")[0])(base_params)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected))

    pairs = {k: v for k, v in _flat(params).items() if "/lora_" in k}
    assert len(pairs) == 2 * len(SITES) * 2  # A and B at six sites in two layers.
    for name, value in pairs.items():
        if name.endswith("lora_b"):
            assert not value.any()
        else:  # PEFT's kaiming_uniform_(a=sqrt(5)): uniform in +-1/sqrt(in), std bound/sqrt(3).
            bound = 1 / math.sqrt(value.shape[0])
            assert np.abs(value).max() <= bound and np.abs(value).max() > 0.8 * bound
            np.testing.assert_allclose(value.std(), bound / math.sqrt(3), rtol=0.25)


def test_adapter_adds_its_low_rank_product(monkeypatch):
    """One site's output against x @ w + x @ A @ B * alpha / rank in NumPy (float64)."""
    exp = _experiment("lora.target=decoder\\.layer1\\.feed_forward\\.up_proj", "lora.alpha=8")
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = jax.device_get(model.initialize(jax.random.key(0)))
    up = params["decoder"]["layer1"]["feed_forward"]["up_proj"]
    pair = up["kernel_state"]["dot"]
    pair["lora_b"] = np.random.default_rng(0).normal(size=pair["lora_b"].shape).astype(np.float32)
    assert sum("lora_" in k for k in _flat(params)) == 2  # The path regex picked one site.
    x = np.random.default_rng(1).normal(size=(2, 5, 32)).astype(np.float32)
    layer = model.decoder.layer1.feed_forward.up_proj
    y = axcore.functional(layer, up, (x,), None, False)[0]
    a, b, w = (np.asarray(v, np.float64) for v in (pair["lora_a"], pair["lora_b"], up["weight"]))
    np.testing.assert_allclose(np.asarray(y), x @ w + x @ a @ b * (8 / RANK), rtol=1e-5, atol=1e-5)


def test_only_adapters_train_and_the_base_stays_bit_identical():
    exp = _experiment("trainer.learner.learning_rate=0.01", "trainer.learner.schedule.warmup_steps=0",
                      "trainer.max_steps=20")
    step = TrainStep(exp)
    state = step.init_state()
    initial = _flat(jax.device_get(state["params"]))

    # Adam's two moments for the adapters only: rank * (in + out) per site, six sites in two layers.
    adapters = 2 * sum(RANK * (i + o) for i, o in SITES.values())
    moments = sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0)
    assert moments == 2 * adapters
    assert sum(v.size for k, v in initial.items() if "/lora_" in k) == adapters

    train = step.compiled_train_step()
    batch = next(exp.config.input.make_iterator(Split.TRAIN))
    losses = []
    for _ in range(20):
        state, metrics = train(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.1, losses
    final = _flat(jax.device_get(state["params"]))
    for name, value in initial.items():
        if "/lora_" in name:
            assert not np.array_equal(final[name], value), name  # Every adapter (B from zero too) moved.
        else:
            np.testing.assert_array_equal(final[name], value, err_msg=name)


def test_a_target_matching_no_projection_is_refused():
    with pytest.raises(LoraConfigError, match=r"'lora\.target' \('qq\|gates'\) matches no projection.*q, up, v"):
        _experiment("lora.target=qq|gates")


def test_a_rank_larger_than_a_projection_is_refused():
    with pytest.raises(LoraConfigError, match=r"'lora\.rank' \(40\) is larger than projection decoder\.layer0\."
                                              r"self_attention\.q_proj \(\[32 -> 32\]\); use a rank of at most 32"):
        _experiment("lora.rank=40")


def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    from axcore.cli import main

    (tmp_path / "e.yaml").write_text("plugins: [lora]\nlora: {target: nothing}\n")
    assert main(["config", str(tmp_path / "e.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'lora.target' ('nothing') matches no projection" in err[0]


def _dot_output_shapes(jaxpr) -> set:
    """Shapes of every dot_general's output in a jaxpr and the jaxprs nested in its equations."""
    shapes = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes.add(tuple(eqn.outvars[0].aval.shape))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    shapes |= _dot_output_shapes(inner)
    return shapes


def test_no_gradient_is_computed_for_the_base_weights():
    """The traced train step has no matmul producing a frozen weight's gradient (the up and down projections'
    `[32, 64]` and `[64, 32]`); the same step of full fine-tuning has both."""
    def shapes(exp):
        step = TrainStep(exp)
        return _dot_output_shapes(jax.make_jaxpr(step.train_step)(step.abstract_state(), step.abstract_batch()).jaxpr)

    frozen = {(32, 64), (64, 32)}
    assert frozen <= shapes(load_experiment(None, TINY_OVERRIDES))
    assert not frozen & shapes(_experiment())
