"""The learner: schedules and AdamW with per-parameter weight-decay scales vs. formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.params import ParameterSpec, constant
from axcore.trainer.learner import LearnerConfig, build_optimizer, learning_rate_schedule


def test_warmup_then_cosine_matches_formula():
    cfg = LearnerConfig(learning_rate=1.0, warmup_steps=10, schedule="cosine", end_fraction=0.1)
    schedule = learning_rate_schedule(cfg, total_steps=110)
    for step in [0, 5, 10, 60, 110]:
        if step < 10:
            expected = step / 10
        else:
            t = (step - 10) / 100
            expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-6), step


def test_linear_and_constant_schedules():
    linear = learning_rate_schedule(LearnerConfig(learning_rate=2.0, warmup_steps=0, schedule="linear", end_fraction=0.5), 100)
    assert float(linear(50)) == pytest.approx(1.5)
    constant_lr = learning_rate_schedule(LearnerConfig(learning_rate=2.0, warmup_steps=4, schedule="constant"), 100)
    assert float(constant_lr(2)) == pytest.approx(1.0) and float(constant_lr(80)) == pytest.approx(2.0)


def test_adamw_step_with_weight_decay_scales_matches_numpy():
    specs = {
        "w": ParameterSpec((3,), jnp.float32, constant(0.0), None, 1.0),
        "scale": ParameterSpec((3,), jnp.float32, constant(1.0), None, 0.0),
    }
    cfg = LearnerConfig(learning_rate=0.1, warmup_steps=0, schedule="constant", weight_decay=0.5, max_grad_norm=None)
    opt, _ = build_optimizer(cfg, specs, total_steps=10)
    params = {"w": jnp.array([1.0, -2.0, 3.0]), "scale": jnp.array([1.0, 1.0, 1.0])}
    grads = {"w": jnp.array([0.5, 0.5, -1.0]), "scale": jnp.array([1.0, 2.0, 3.0])}
    updates, _ = opt.update(grads, opt.init(params), params)
    new = jax.tree.map(lambda p, u: p + u, params, updates)
    for name, decay in [("w", 0.5), ("scale", 0.0)]:
        g, p = np.asarray(grads[name], np.float64), np.asarray(params[name], np.float64)
        m = (1 - cfg.b1) * g / (1 - cfg.b1)  # Bias-corrected first step.
        v = (1 - cfg.b2) * g * g / (1 - cfg.b2)
        expected = p - 0.1 * (m / (np.sqrt(v) + cfg.eps) + decay * p)
        np.testing.assert_allclose(new[name], expected, rtol=1e-5)


def test_global_norm_clipping():
    specs = {"w": ParameterSpec((2,), jnp.float32, constant(0.0))}
    cfg = LearnerConfig(optimizer="sgd", learning_rate=1.0, warmup_steps=0, schedule="constant", weight_decay=0.0, max_grad_norm=1.0)
    opt, _ = build_optimizer(cfg, specs, total_steps=10)
    params = {"w": jnp.zeros(2)}
    updates, _ = opt.update({"w": jnp.array([3.0, 4.0])}, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-6)
