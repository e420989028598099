"""Online DPO rows from a rollout: each prompt's best and worst completion as a (chosen, rejected) pair for the dpo
plugin's objective, checked against the rewards by hand and against DPO's log 2 at policy = reference."""

import math

import jax
import numpy as np

from axcore.module import functional
from axcore.testing import load_tiny_experiment

from axcore_dpo import DPO
from axcore_rl import Rollout, preference_batch

PROMPTS = [(1, 2, 3), (4, 5), (6,)]
COMPLETIONS = [[7, 8], [9], [10, 11, 12], [13], [14, 15], [16], [17, 18], [19], [20]]
REWARDS = np.array([0.5, 1.0, 0.0, 0.3, 0.3, 0.3, 0.0, 1.0, 1.0])  # Prompt 1 ties: no pair.


def test_pairs_are_each_prompts_best_then_worst_and_the_dpo_objective_reads_them():
    rollout = Rollout(list(PROMPTS), 3, COMPLETIONS, [[-1.0] * len(c) for c in COMPLETIONS], ["length"] * 9, 0.0)
    batch = preference_batch(rollout, REWARDS, 8)
    assert batch["input_ids"].shape == (4, 8) and "advantages" not in batch

    def reply(row):
        return batch["target_labels"][row][batch["target_weights"][row] > 0].tolist()

    # Prompt 0: best [9] (1.0), worst [10, 11, 12] (0.0); prompt 2: best [19] (first of the 1.0s), worst [17, 18].
    assert [reply(r) for r in range(4)] == [[9], [10, 11, 12], [19], [17, 18]]
    assert batch["input_ids"][1, :6].tolist() == [1, 2, 3, 10, 11, 0]  # Prompt + reply but its last token.
    exp = load_tiny_experiment()
    model = exp.config.model.clone(vocab_size=32).instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    objective = DPO.default_config().set(beta=0.1).instantiate()
    out = objective.loss(model, params, batch, prng_key=None, is_training=False, state=objective.init_state(params))
    np.testing.assert_allclose(float(out.loss), math.log(2), rtol=1e-6)
    assert float(out.metrics["pairs"]) == 2.0
    empty = preference_batch(rollout, np.ones(9), 8)
    assert empty["input_ids"].shape == (0, 8)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_the_dpo_loss_on_precomputed_reference_logprobs_equals_numpys_formula():
    rollout = Rollout(list(PROMPTS), 3, COMPLETIONS, [[-1.0] * len(c) for c in COMPLETIONS], ["length"] * 9, 0.0)
    batch = preference_batch(rollout, REWARDS, 8)
    exp = load_tiny_experiment()
    model = exp.config.model.clone(vocab_size=32).instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    ref = np.random.default_rng(0).normal(-3.0, 1.0, batch["target_labels"].shape).astype(np.float32)
    objective = DPO.default_config().set(beta=0.1, precomputed_reference=True).instantiate()
    assert [f.name for f in objective.batch_fields()] == ["ref_logprobs"]
    out = objective.loss(model, params, {**batch, "ref_logprobs": ref}, prng_key=None, is_training=False,
                         state=objective.init_state(params))
    logits, _ = functional(model, params, {k: batch[k] for k in ("input_ids", "positions", "segment_ids")}, None,
                           False, method="logits")
    labels, weights = batch["target_labels"], batch["target_weights"].astype(np.float64)
    logp = np.take_along_axis(_log_softmax(logits), np.maximum(labels, 0)[..., None], -1)[..., 0]
    policy, reference = (logp * weights).sum(-1), (ref.astype(np.float64) * weights).sum(-1)
    margin = 0.1 * ((policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2]))
    np.testing.assert_allclose(float(out.loss), np.mean(np.log1p(np.exp(-margin))), rtol=1e-5)
    # What the rollout stage precomputes: the reference's (here the initial parameters') log-probability per target.
    tokens = objective.reference_token_logprobs(model, params, batch, objective.init_state(params))
    np.testing.assert_allclose(np.asarray(tokens), np.where(labels >= 0, logp, 0.0), rtol=1e-5, atol=1e-6)
