"""The learner: registered schedules and optimizers, weight-decay scales and frozen parameters vs. formulas."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from axcore.config import from_dict
from axcore.data import Split
from axcore.errors import ConfigError, UnknownComponentError
from axcore.experiment import load_experiment
from axcore.layers import Linear
from axcore.params import ParameterSpec, constant
from axcore.testing import TINY_OVERRIDES
from axcore.trainer import (
    SGD,
    Adafactor,
    AdamW,
    Constant,
    Cosine,
    LearnerConfig,
    LinearDecay,
    Lion,
    StateUpdateError,
    WarmupStableDecay,
    build_optimizer,
    learning_rate_schedule,
)
from axcore.trainer.learner import apply_state_updates
from axcore.trainer.step import TrainStep


def _learner(optimizer, schedule=None, **kwargs):
    kwargs.setdefault("max_grad_norm", None)
    kwargs.setdefault("weight_decay", 0.0)
    return LearnerConfig(optimizer=optimizer, schedule=schedule or Constant.default_config(), **kwargs)


def _step(cfg, specs, params, grads, state=None):
    opt, _ = build_optimizer(cfg, specs, total_steps=100)
    state = opt.init(params) if state is None else state
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def test_builtin_families_are_registered(registries):
    assert {"adamw", "adafactor", "lion", "sgd"} <= set(registries.optimizers)
    assert {"constant", "cosine", "linear_decay", "wsd"} <= set(registries.schedules)
    assert registries.lookup("adamw") is AdamW and registries.lookup("wsd") is WarmupStableDecay


def test_yaml_names_optimizer_and_schedule(registries):
    cfg = from_dict(
        {"optimizer": {"type": "sgd", "momentum": 0.5}, "schedule": {"type": "cosine", "warmup_steps": 7}},
        registries,
        LearnerConfig(),
    )
    assert cfg.optimizer.target is SGD and cfg.optimizer.momentum == 0.5
    assert cfg.schedule.target is Cosine and cfg.schedule.warmup_steps == 7
    with pytest.raises(UnknownComponentError, match="did you mean 'adamw'"):
        from_dict({"optimizer": {"type": "adamww"}}, registries, LearnerConfig())


def test_warmup_then_cosine_matches_formula():
    cfg = LearnerConfig(learning_rate=1.0, schedule=Cosine.default_config().set(warmup_steps=10, end_fraction=0.1))
    schedule = learning_rate_schedule(cfg, total_steps=110)
    for step in [0, 5, 10, 60, 110]:
        if step < 10:
            expected = step / 10
        else:
            t = (step - 10) / 100
            expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-6), step


def test_linear_decay_and_constant_schedules():
    linear = learning_rate_schedule(
        LearnerConfig(learning_rate=2.0, schedule=LinearDecay.default_config().set(end_fraction=0.5)), 100
    )
    assert float(linear(50)) == pytest.approx(1.5) and float(linear(100)) == pytest.approx(1.0)
    constant_lr = learning_rate_schedule(
        LearnerConfig(learning_rate=2.0, schedule=Constant.default_config().set(warmup_steps=4)), 100
    )
    assert float(constant_lr(2)) == pytest.approx(1.0) and float(constant_lr(80)) == pytest.approx(2.0)


def test_schedule_total_steps_overrides_the_run_length():
    cfg = LearnerConfig(learning_rate=1.0, schedule=LinearDecay.default_config().set(total_steps=40, end_fraction=0.0))
    schedule = learning_rate_schedule(cfg, total_steps=1000)
    assert float(schedule(20)) == pytest.approx(0.5) and float(schedule(40)) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize(
    "shape,formula",
    [
        ("linear", lambda x: 1 - x),
        ("cosine", lambda x: 0.5 * (1 + math.cos(math.pi * x))),
        ("sqrt", lambda x: 1 - math.sqrt(x)),
    ],
)
def test_warmup_stable_decay_matches_formula(shape, formula):
    wsd = WarmupStableDecay.default_config().set(
        warmup_steps=10, decay_fraction=0.25, end_fraction=0.1, decay_shape=shape
    )
    schedule = learning_rate_schedule(LearnerConfig(learning_rate=2.0, schedule=wsd), total_steps=90)
    # 80 steps after warmup: stable for 60 (steps 10..70), then 20 steps of decay (70..90).
    for step in [0, 4, 10, 40, 70, 75, 80, 90, 95]:
        if step < 10:
            expected = 2.0 * step / 10
        else:
            x = min(max((step - 70) / 20, 0.0), 1.0)
            expected = 0.2 + (2.0 - 0.2) * formula(x)
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-5), step


def test_adamw_step_with_weight_decay_scales_matches_numpy():
    specs = {
        "w": ParameterSpec((3,), jnp.float32, constant(0.0), None, 1.0),
        "scale": ParameterSpec((3,), jnp.float32, constant(1.0), None, 0.0),
    }
    adam = AdamW.default_config()
    cfg = _learner(adam, learning_rate=0.1, weight_decay=0.5)
    params = {"w": jnp.array([1.0, -2.0, 3.0]), "scale": jnp.array([1.0, 1.0, 1.0])}
    grads = {"w": jnp.array([0.5, 0.5, -1.0]), "scale": jnp.array([1.0, 2.0, 3.0])}
    new, _ = _step(cfg, specs, params, grads)
    for name, decay in [("w", 0.5), ("scale", 0.0)]:
        g, p = np.asarray(grads[name], np.float64), np.asarray(params[name], np.float64)
        m = (1 - adam.b1) * g / (1 - adam.b1)  # Bias-corrected first step.
        v = (1 - adam.b2) * g * g / (1 - adam.b2)
        expected = p - 0.1 * (m / (np.sqrt(v) + adam.eps) + decay * p)
        np.testing.assert_allclose(new[name], expected, rtol=1e-5)


def _numpy_adam(params, grads_per_step, lr, b1, b2, eps, round_moment):
    """Adam (Kingma & Ba, Algorithm 1) in float64, the stored moments rounded by `round_moment`."""
    p = np.asarray(params, np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads_per_step, start=1):
        m = round_moment(b1 * m + (1 - b1) * g)
        v = round_moment(b2 * v + (1 - b2) * g * g)
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


@pytest.mark.parametrize("moment_dtype", [None, "bfloat16"])
def test_adam_moment_dtype_matches_numpy_over_several_steps(moment_dtype):
    rng = np.random.default_rng(0)
    specs = {"w": ParameterSpec((64,), jnp.float32, constant(0.0))}
    initial = np.asarray(rng.normal(size=64), np.float32)
    params = {"w": jnp.asarray(initial)}
    grads = [rng.normal(size=64) * 10 ** rng.uniform(-3, 1) for _ in range(5)]
    adam = AdamW.default_config().set(b1=0.9, b2=0.99, eps=1e-6, moment_dtype=moment_dtype)
    cfg = _learner(adam, learning_rate=0.01)
    opt, _ = build_optimizer(cfg, specs, total_steps=100)
    state = opt.init(params)
    moments = [x for x in jax.tree.leaves(state) if x.ndim == 1]
    want_dtype = np.dtype(moment_dtype or "float32")
    assert len(moments) == 2 and all(x.dtype == want_dtype for x in moments)  # Both m and v.
    step = jax.jit(opt.update)
    for g in grads:
        updates, state = step({"w": jnp.asarray(g, jnp.float32)}, state, params)
        params = optax.apply_updates(params, updates)
    if moment_dtype is None:
        round_moment = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    else:
        round_moment = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    expected = _numpy_adam(initial, grads, 0.01, 0.9, 0.99, 1e-6, round_moment)
    np.testing.assert_allclose(params["w"], expected, rtol=2e-5, atol=1e-6)


def test_lion_step_matches_formula():
    specs = {"w": ParameterSpec((4,), jnp.float32, constant(0.0))}
    params = {"w": jnp.array([1.0, -1.0, 0.5, 0.0])}
    grads = {"w": jnp.array([0.3, -2.0, 0.0, -0.1])}
    new, _ = _step(_learner(Lion.default_config().set(b1=0.9, b2=0.99), learning_rate=0.1), specs, params, grads)
    # First step: m_0 = 0, so the update is sign((1 - b1) g).
    expected = np.asarray(params["w"]) - 0.1 * np.sign(0.1 * np.asarray(grads["w"]))
    np.testing.assert_allclose(new["w"], expected, rtol=1e-6)


def test_adafactor_first_step_matches_formula():
    specs = {"w": ParameterSpec((4,), jnp.float32, constant(0.0))}
    params = {"w": jnp.array([1.0, -1.0, 0.5, 2.0])}
    grads = {"w": jnp.array([0.3, -2.0, 0.5, -0.1])}
    new, _ = _step(_learner(Adafactor.default_config(), learning_rate=0.1), specs, params, grads)
    # Step 1: the decay 1 - 1^-0.8 is 0, so v = g^2 + eps and the direction g / sqrt(v) = sign(g),
    # whose root-mean-square is 1, inside the clipping threshold.
    g = np.asarray(grads["w"], np.float64)
    expected = np.asarray(params["w"]) - 0.1 * g / np.sqrt(g * g + 1e-30)
    np.testing.assert_allclose(new["w"], expected, rtol=1e-6)


def test_sgd_momentum_matches_formula():
    specs = {"w": ParameterSpec((2,), jnp.float32, constant(0.0))}
    cfg = _learner(SGD.default_config().set(momentum=0.5), learning_rate=0.1)
    params = {"w": jnp.array([1.0, 2.0])}
    g1, g2 = np.array([1.0, -1.0]), np.array([2.0, 0.5])
    params1, state = _step(cfg, specs, params, {"w": jnp.asarray(g1, jnp.float32)})
    params2, _ = _step(cfg, specs, params1, {"w": jnp.asarray(g2, jnp.float32)}, state)
    # Heavy ball: v_1 = g_1, v_2 = g_2 + 0.5 v_1.
    np.testing.assert_allclose(params2["w"], np.array([1.0, 2.0]) - 0.1 * g1 - 0.1 * (g2 + 0.5 * g1), rtol=1e-6)


def test_global_norm_clipping():
    specs = {"w": ParameterSpec((2,), jnp.float32, constant(0.0))}
    cfg = _learner(SGD.default_config(), learning_rate=1.0, max_grad_norm=1.0)
    opt, _ = build_optimizer(cfg, specs, total_steps=10)
    params = {"w": jnp.zeros(2)}
    updates, _ = opt.update({"w": jnp.array([3.0, 4.0])}, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-6)


@pytest.mark.parametrize("optimizer", [AdamW, Adafactor, Lion, SGD])
def test_non_trainable_parameters_get_no_update_state_or_clipping_share(optimizer):
    specs = {
        "w": ParameterSpec((2,), jnp.float32, constant(0.0), None, 1.0),
        "scale": ParameterSpec((2,), jnp.float32, constant(1.0), None, 1.0, trainable=False),
    }
    cfg = _learner(optimizer.default_config().set(**({"momentum": 0.9} if optimizer is SGD else {})),
                   learning_rate=0.5, weight_decay=0.3, max_grad_norm=1.0)
    params = {"w": jnp.array([1.0, -1.0]), "scale": jnp.array([3.0, -4.0])}
    grads = {"w": jnp.array([0.0, 0.5]), "scale": jnp.array([100.0, 100.0])}
    opt, _ = build_optimizer(cfg, specs, total_steps=10)
    state = opt.init(params)
    # The optimizer keeps exactly the state it keeps for `w` alone: nothing for the frozen parameter.
    alone, _ = build_optimizer(cfg, {"w": specs["w"]}, total_steps=10)
    sizes = lambda tree: sorted(leaf.size for leaf in jax.tree.leaves(tree))  # noqa: E731
    assert sizes(state) == sizes(alone.init({"w": params["w"]}))
    for _ in range(3):
        updates, state = opt.update(grads, state, params)
        np.testing.assert_array_equal(updates["scale"], [0.0, 0.0])
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params["scale"], [3.0, -4.0])


def test_frozen_gradients_do_not_count_towards_clipping():
    specs = {
        "w": ParameterSpec((2,), jnp.float32, constant(0.0)),
        "frozen": ParameterSpec((1,), jnp.float32, constant(0.0), trainable=False),
    }
    cfg = _learner(SGD.default_config(), learning_rate=1.0, max_grad_norm=10.0)
    opt, _ = build_optimizer(cfg, specs, total_steps=10)
    params = {"w": jnp.zeros(2), "frozen": jnp.zeros(1)}
    updates, _ = opt.update({"w": jnp.array([3.0, 4.0]), "frozen": jnp.array([1e6])}, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], [-3.0, -4.0], rtol=1e-6)  # Norm 5 < 10: not clipped.


def test_a_component_of_another_kind_is_refused():
    cfg = LearnerConfig(optimizer=Linear.default_config())
    with pytest.raises(ConfigError, match=r"'trainer\.learner\.optimizer' builds 'Linear', which is not an optimizer"):
        build_optimizer(cfg, {"w": ParameterSpec((1,), jnp.float32, constant(0.0))}, 10)


def test_state_updates_replace_only_the_named_non_trainable_leaves():
    params = {"a": {"w": jnp.ones(2), "kernel_state": {"q": {"scale": jnp.ones(3), "amax": jnp.zeros(3)}}}}
    trainable = {"a": {"w": True, "kernel_state": {"q": {"scale": False, "amax": False}}}}
    update = {"a": {"kernel_state": {"q": {"scale": jnp.full(3, 2.0, jnp.bfloat16)}}}}
    new = apply_state_updates(params, update, trainable)
    np.testing.assert_array_equal(new["a"]["kernel_state"]["q"]["scale"], [2.0, 2.0, 2.0])
    assert new["a"]["kernel_state"]["q"]["scale"].dtype == jnp.float32  # Cast to the parameter's dtype.
    assert new["a"]["w"] is params["a"]["w"]  # Leaves not in the update stay as they are.
    assert new["a"]["kernel_state"]["q"]["amax"] is params["a"]["kernel_state"]["q"]["amax"]
    with pytest.raises(StateUpdateError, match="'a/w' targets a trainable parameter"):
        apply_state_updates(params, {"a": {"w": jnp.zeros(2)}}, trainable)
    with pytest.raises(StateUpdateError, match="'a/nope' names no parameter"):
        apply_state_updates(params, {"a": {"nope": jnp.zeros(2)}}, trainable)
    with pytest.raises(StateUpdateError, match="shape"):
        apply_state_updates(params, {"a": {"kernel_state": {"q": {"amax": jnp.zeros(4)}}}}, trainable)


def test_learner_trainable_trains_only_the_parameters_it_matches():
    """`trainer.learner.trainable`: the train step of the tiny model moves and keeps moments for the matched leaves only."""
    exp = load_experiment(None, [*TINY_OVERRIDES, "trainer.learner.trainable=^embedding/", "trainer.learner.weight_decay=0.5",
                                 "trainer.learner.schedule.warmup_steps=0"])
    step = TrainStep(exp)
    state = step.init_state()
    flat = lambda tree: {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)  # noqa: E731
                         for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}
    before = flat(state["params"])
    embedding = before["embedding/weight"].size
    # AdamW's two moments of the embedding table, nothing for the other parameters.
    assert sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0) == 2 * embedding
    state, _ = step.compiled_train_step()(state, next(exp.config.input.make_iterator(Split.TRAIN)))
    after = flat(state["params"])
    for name, value in before.items():
        assert np.array_equal(after[name], value) != (name == "embedding/weight"), name


def test_learner_trainable_matching_nothing_is_refused():
    exp = load_experiment(None, [*TINY_OVERRIDES, "trainer.learner.trainable=no_such_parameter"])
    with pytest.raises(ConfigError, match=r"'trainer\.learner\.trainable' \('no_such_parameter'\) matches no trainable "
                                          r"parameter \(e\.g\. "):
        TrainStep(exp)
