"""Online DPO rows from a rollout: each prompt's best and worst completion as a (chosen, rejected) pair for the dpo
plugin's objective, checked against the rewards by hand and against DPO's log 2 at policy = reference."""

import math

import jax
import numpy as np

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
