"""`GrpoLoop`: GRPO in one process: rollouts on the engine, rewards, advantages, optimiser steps, weight update.

One `step()`:

1. picks `prompts_per_step` samples (seeded by `seed` and the step),
2. samples `group_size` completions of each from the engine on the current parameters
   (`axcore_rl.rollout.sample_rollouts`),
3. scores each decoded completion with the rewards (`axcore_rl.rewards.score`; a reward
   that raises is one logged line and a 0),
4. computes group-relative advantages (`group_advantages`, unscaled for `loss_type: dr_grpo`),
5. builds the objective's batch (`rollout_batch`) and, with `beta` > 0, the reference's
   log-probabilities once for the batch,
6. takes `updates_per_rollout` optimiser steps on it (the importance ratio corrects for
   the policy moving after the first), without dropout, so the first step's ratio is
   exactly sampler vs learner,
7. hands the new parameters to the engine (`Engine.update_weights`: no copy).

It returns the step's metrics: `reward_mean`, `reward_std`, `loss`, `kl`,
`clip_fraction`, `ratio`, `response_length`, `logprob_mismatch` (the largest |sampler -
learner| log-probability on the first update), `rollout_seconds`, `learn_seconds`,
`rollout_tokens_per_s` (tokens generated), `learn_tokens_per_s` (tokens, prompt and
completion, through the learner's forward and backward passes).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from axcore.engine import Engine

from axcore_rl.objective import GRPO, group_advantages
from axcore_rl.rewards import Reward, score
from axcore_rl.rollout import rollout_batch, sample_rollouts


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """How one GRPO step samples and learns."""

    # Prompts per step.
    prompts_per_step: int = 8
    # Completions per prompt (G).
    group_size: int = 8
    # New tokens per completion at most.
    max_tokens: int = 16
    # Sampling temperature (the objective's `temperature` must equal it).
    temperature: float = 1.0
    # Tokens that end a completion (besides the engine's end-of-sequence tokens).
    stop_token_ids: tuple[int, ...] = ()
    # Row length of the learner's batch (>= longest prompt + max_tokens - 1).
    seq_len: int = 64
    # Optimiser steps per rollout batch.
    updates_per_rollout: int = 1
    # Threads scoring completions (1 = inline).
    reward_workers: int = 1
    # Seeds the prompt choice and the draws.
    seed: int = 0


class GrpoLoop:
    """GRPO on `samples` with `engine` sampling on the live parameters (module docstring).

    Args:
        model: the causal LM (the engine's).
        params: its initial parameter tree; `engine` must hold this same tree.
        objective: a `GRPO` instance.
        optimizer: an optax transformation.
        engine: an `Engine` over `model` and `params`.
        samples: the task samples (dicts with `prompt`, the rewards' fields).
        encode: prompt text -> token ids; decode: completion token ids -> text.
        rewards: the rewards summed per completion.
        settings: a `LoopSettings`.
    """

    def __init__(self, model: Any, params: Any, objective: GRPO, optimizer: optax.GradientTransformation,
                 engine: Engine, samples: Sequence[dict], encode: Callable[[str], Sequence[int]],
                 decode: Callable[[Sequence[int]], str], rewards: Sequence[Reward], settings: LoopSettings):
        placed = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        # Committed where they lie (no copy), as the update's outputs are: a jitted function compiles again
        # for committed inputs after uncommitted ones.
        params = jax.device_put(params, placed(params))
        self.model, self.params, self.objective, self.engine = model, params, objective, engine
        self.samples, self.encode, self.decode, self.rewards = list(samples), encode, decode, list(rewards)
        self.settings, self.optimizer = settings, optimizer
        state = optimizer.init(params)
        self.opt_state = jax.device_put(state, placed(state))
        self.objective_state = objective.init_state(params)
        self.step_count = 0
        # The updated parameters and optimizer state keep the shardings they came with (a restored run's
        # `P(None, None)` leaves came back as the equivalent `P()`, and the second step compiled again).
        self._update = jax.jit(self._update_fn, out_shardings=(placed(params), placed(self.opt_state), None))
        self._reference = jax.jit(lambda p, b, s: objective.reference_logprobs(model, p, b, s))

    def _update_fn(self, params, opt_state, batch, state):
        def loss_fn(p):
            out = self.objective.loss(self.model, p, batch, prng_key=None, is_training=False, state=state)
            return out.loss, out.metrics

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {**metrics, "loss": loss}

    def step(self) -> dict[str, float]:
        """One GRPO step (module docstring); its metrics."""
        s = self.settings
        rng = np.random.default_rng([s.seed, self.step_count])
        chosen = [self.samples[i] for i in rng.choice(len(self.samples), s.prompts_per_step, replace=False)]
        rollout = sample_rollouts(self.engine, [self.encode(x["prompt"]) for x in chosen], s.group_size,
                                  max_tokens=s.max_tokens, temperature=s.temperature,
                                  seed=s.seed * 1000003 + self.step_count, stop_token_ids=s.stop_token_ids)
        texts = [self.decode(c) for c in rollout.completions]
        rewards = score(self.rewards, texts, [x for x in chosen for _ in range(s.group_size)],
                        workers=s.reward_workers)
        scale = self.objective.config.loss_type != "dr_grpo"
        batch = rollout_batch(rollout, group_advantages(rewards, s.group_size, scale=scale), s.seq_len)
        start = time.perf_counter()
        if self.objective.config.beta > 0:
            batch["ref_logprobs"] = self._reference(self.params, batch, self.objective_state)
        history = []
        for _ in range(s.updates_per_rollout):
            self.params, self.opt_state, metrics = self._update(self.params, self.opt_state, batch,
                                                                self.objective_state)
            history.append(jax.device_get(metrics))
        learn = time.perf_counter() - start
        self.engine.update_weights(self.params)
        self.step_count += 1
        tokens = float(batch["segment_ids"].sum()) * s.updates_per_rollout
        last = {k: float(v) for k, v in history[-1].items()}
        return {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()), "loss": last["loss"],
            "kl": last["kl"], "clip_fraction": last["clip_fraction"], "ratio": last["ratio"],
            "response_length": last["response_length"],
            "logprob_mismatch": float(history[0]["max_logprob_gap"]),
            "rollout_seconds": rollout.seconds, "learn_seconds": learn,
            "rollout_tokens_per_s": rollout.num_tokens / max(rollout.seconds, 1e-9),
            "learn_tokens_per_s": tokens / max(learn, 1e-9),
        }


__all__ = ["GrpoLoop", "LoopSettings"]
