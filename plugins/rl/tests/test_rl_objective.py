"""The grpo objective on the tiny model: loss and gradient against a float64 NumPy GRPO (the published formula:
clipped ratio, k3 KL, sequence / token / Dr. GRPO normalisation), group advantages against the formula by hand."""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.testing import load_tiny_experiment

import axcore_rl.plugin
from axcore_rl import GRPO, GrpoError, group_advantages

VOCAB = 64
ROWS, SEQ = 5, 12


def _experiment(objective: str):
    return load_tiny_experiment(["rl"], [f"trainer.objective={objective}"], objects={"rl": axcore_rl.plugin})


def _model(exp):
    return exp.config.model.clone(vocab_size=VOCAB).instantiate(name="model", registries=exp.registries)


def _logits(model, params, batch):
    inputs = {k: batch[k] for k in ("input_ids", "positions", "segment_ids")}
    return axcore.functional(model, params, inputs, None, False, method="logits")[0]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def _batch(model, params, seed=0, temperature=1.0):
    """Rollout-shaped rows: completions of different lengths after a 4-token prompt, one padding row; old
    log-probabilities the current ones moved by up to +-0.5 (so some ratios leave the clip range)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(ROWS, SEQ + 1))
    weights = np.zeros((ROWS, SEQ), np.float32)
    for row, length in enumerate([8, 5, 3, 8, 0]):
        weights[row, 3:3 + length] = 1.0
    batch = {"input_ids": ids[:, :-1].astype(np.int32), "target_labels": ids[:, 1:].astype(np.int32),
             "target_weights": weights, "positions": np.tile(np.arange(SEQ, dtype=np.int32), (ROWS, 1)),
             "segment_ids": np.ones((ROWS, SEQ), np.int32),
             "advantages": rng.normal(size=ROWS).astype(np.float32)}
    logp = _picked(_logits(model, params, batch), batch, temperature)
    batch["old_logprobs"] = ((logp + rng.uniform(-0.5, 0.5, size=logp.shape)) * weights).astype(np.float32)
    return batch


def _picked(logits, batch, temperature):
    lp = _log_softmax(np.asarray(logits, np.float64) / temperature)
    return np.take_along_axis(lp, batch["target_labels"][..., None], -1)[..., 0]


def _numpy_grpo(logits, ref_logits, batch, *, epsilon, epsilon_high, beta, loss_type, temperature):
    """GRPO's loss and its gradient with respect to the policy's logits, float64 NumPy."""
    lp = _log_softmax(np.asarray(logits, np.float64) / temperature)
    labels, m = batch["target_labels"], batch["target_weights"].astype(np.float64)
    logp = np.take_along_axis(lp, labels[..., None], -1)[..., 0]
    adv = batch["advantages"].astype(np.float64)[:, None]
    ratio = np.exp(logp - batch["old_logprobs"])
    clipped = np.clip(ratio, 1 - epsilon, 1 + epsilon_high)
    per = -np.minimum(ratio * adv, clipped * adv)
    d_per = np.where(ratio * adv <= clipped * adv, -adv * ratio, 0.0)  # The clipped branch is constant in logp.
    if beta:
        ref = _picked(ref_logits, batch, temperature)
        per += beta * (np.exp(ref - logp) - (ref - logp) - 1)
        d_per += beta * (1 - np.exp(ref - logp))
    lengths = m.sum(-1)
    n = (lengths > 0).sum()
    if loss_type == "sequence":
        c = m / np.maximum(lengths, 1)[:, None] / n
    elif loss_type == "token":
        c = m / m.sum()
    else:
        c = m / (n * m.shape[1])
    loss = (c * per).sum()
    onehot = np.eye(lp.shape[-1])[labels]
    d_logits = (c * d_per)[..., None] * (onehot - np.exp(lp)) / temperature
    return loss, d_logits, (ratio * adv > clipped * adv)[m > 0].mean()


@pytest.mark.parametrize("loss_type, beta, temperature", [
    ("sequence", 0.0, 1.0), ("sequence", 0.1, 1.0), ("token", 0.0, 1.0), ("token", 0.1, 0.7), ("dr_grpo", 0.1, 1.0)])
def test_loss_and_gradient_equal_a_numpy_grpo(loss_type, beta, temperature):
    exp = _experiment(f"{{type: grpo, beta: {beta}, loss_type: {loss_type}, temperature: {temperature}, "
                      f"epsilon_high: 0.28}}")
    model, objective = _model(exp), exp.config.trainer.objective.instantiate()
    params, reference = model.initialize(jax.random.key(0)), model.initialize(jax.random.key(1))
    batch = _batch(model, params, temperature=temperature)
    state = {"reference": reference} if beta else None
    assert (objective.init_state(params) is None) == (beta == 0)  # No reference copy without a KL term.

    def loss_fn(p):
        out = objective.loss(model, p, batch, prng_key=None, is_training=False, state=state)
        return out.loss, out.metrics

    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    expected, d_logits, clip_fraction = _numpy_grpo(
        _logits(model, params, batch), _logits(model, reference, batch), batch, epsilon=0.2, epsilon_high=0.28,
        beta=beta, loss_type=loss_type, temperature=temperature)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), clip_fraction, rtol=1e-6)
    assert 0 < clip_fraction < 1  # Both branches of the min are exercised.
    assert float(metrics["completions"]) == 4.0 and (float(metrics["kl"]) > 0) == (beta > 0)
    pull_back = jax.jit(lambda p, g: jax.vjp(lambda q: _logits(model, q, batch), p)[1](g)[0])
    expected_grads = pull_back(params, jnp.asarray(d_logits, jnp.float32))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert any(np.abs(np.asarray(g)).max() > 1e-4 for g in jax.tree.leaves(grads))


def test_reference_log_probs_given_once_equal_those_computed_in_the_loss():
    exp = _experiment("{type: grpo, beta: 0.05}")
    model, objective = _model(exp), exp.config.trainer.objective.instantiate()
    params = model.initialize(jax.random.key(0))
    batch = _batch(model, params)
    state = objective.init_state(model.initialize(jax.random.key(1)))
    inside = objective.loss(model, params, batch, prng_key=None, is_training=False, state=state)
    given = {**batch, "ref_logprobs": objective.reference_logprobs(model, params, batch, state)}
    outside = objective.loss(model, params, given, prng_key=None, is_training=False, state=None)
    np.testing.assert_allclose(float(outside.loss), float(inside.loss), rtol=1e-6)
    assert float(inside.metrics["kl"]) > 0


def test_lora_base_as_reference_needs_no_copy():
    exp = load_tiny_experiment(["lora", "rl"], ["trainer.objective={type: grpo, beta: 0.1, reference: lora_b}"],
                               objects={"rl": axcore_rl.plugin})
    model, objective = _model(exp), exp.config.trainer.objective.instantiate()
    params = model.initialize(jax.random.key(0))
    assert objective.init_state(params) is None
    out = objective.loss(model, params, _batch(model, params), prng_key=None, is_training=False)
    assert float(out.metrics["kl"]) == 0.0  # B = 0 at initialisation: the policy is the base, KL 0.


def test_group_advantages_equal_the_formula():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.2, 0.9, 0.3])
    got = group_advantages(rewards, 4)
    for g in range(3):
        group = rewards[4 * g:4 * g + 4].tolist()
        mean, std = statistics.mean(group), statistics.stdev(group)
        np.testing.assert_allclose(got[4 * g:4 * g + 4], [(r - mean) / (std + 1e-4) for r in group], rtol=1e-6)
    np.testing.assert_allclose(group_advantages(rewards, 4, scale=False)[:4], [0.5, -0.5, -0.5, 0.5])
    assert np.all(got[4:8] == 0)  # Equal rewards: no signal.
    with pytest.raises(GrpoError, match="at least 2 completions per prompt"):
        group_advantages(rewards, 1)


def test_a_batch_without_rollout_fields_is_refused_naming_the_field():
    exp = _experiment("{type: grpo}")
    model, objective = _model(exp), exp.config.trainer.objective.instantiate()
    assert isinstance(objective, GRPO)
    params = model.initialize(jax.random.key(0))
    batch = _batch(model, params)
    del batch["advantages"]
    with pytest.raises(GrpoError, match="needs batch field 'advantages'"):
        objective.loss(model, params, batch, prng_key=None, is_training=False)
