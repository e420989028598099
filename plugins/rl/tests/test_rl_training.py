"""GRPO end to end on CPU: a tiny model from scratch learns single-digit addition (answers 0..5, one token of a
12-token character vocabulary) from its own samples and an exact-match reward, rollouts on the engine on the
live parameters; the mean reward rises from under 0.2 to over 0.8 within a bounded number of steps."""

import time

import jax
import numpy as np
import optax

from axcore.engine import Engine, EngineConfig
from axcore.testing import load_tiny_experiment

import axcore_rl.plugin
from axcore_rl import GrpoLoop, LoopSettings, generate_tasks

CHARS = "0123456789+="  # Token id = index: the answer of "a+b=" (<= 5) is one token.
PROMPTS, G = 16, 8
MAX_STEPS = 100


def test_grpo_learns_one_digit_addition_from_scratch():
    start = time.perf_counter()
    exp = load_tiny_experiment(["rl"], ["trainer.objective={type: grpo}"], objects={"rl": axcore_rl.plugin})
    model = exp.config.model.clone(vocab_size=len(CHARS)).instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    reward = exp.registries.rewards["exact_match"].default_config().instantiate()
    rows = PROMPTS * G
    engine = Engine(model, params, None, config=EngineConfig(
        block_size=4, num_blocks=2 * rows + 8, max_seqs=rows, max_tokens_per_step=rows, max_model_len=8,
        batch_buckets=(rows,), token_buckets=(1, 8)))
    loop = GrpoLoop(model, params, exp.config.trainer.objective.instantiate(), optax.adam(3e-3), engine,
                    generate_tasks("arithmetic", 256, seed=0, max_sum=5), lambda text: [CHARS.index(c) for c in text],
                    lambda ids: "".join(CHARS[i] for i in ids), [reward],
                    LoopSettings(prompts_per_step=PROMPTS, group_size=G, max_tokens=1, seq_len=8,
                                 updates_per_rollout=2))
    history = []
    while len(history) < MAX_STEPS and (len(history) < 10 or np.mean([m["reward_mean"] for m in history[-10:]]) <= 0.8):
        history.append(loop.step())
    rewards = [round(m["reward_mean"], 3) for m in history]
    assert history[0]["reward_mean"] < 0.2, rewards
    assert np.mean(rewards[-10:]) > 0.8, rewards
    assert max(m["logprob_mismatch"] for m in history) < 1e-5  # The rollouts sampled the learner's parameters.
    engine.close()
    print(f"{len(history)} steps, rewards {rewards[0]} -> {np.mean(rewards[-10:]):.3f} (last 10), "
          f"{time.perf_counter() - start:.0f} s in all")
