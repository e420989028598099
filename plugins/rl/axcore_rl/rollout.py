"""Rollouts inside the training process: G completions per prompt from the engine on the live parameters.

`sample_rollouts(engine, prompts, group_size, ...)` sends one request per prompt with
`n = group_size` choices (they share the prompt's KV blocks) and `logprobs=0`, runs the
engine until all finish, and returns a `Rollout`: each completion's tokens and the
sampler's log-probability of each (`axcore.engine.sampling`: those of
`log_softmax(logits / temperature)`, exactly what the learner computes on the same
parameters at that temperature; no penalties, no top-k/p filters, which would make the
sampler's distribution differ from the learner's). The engine holds the parameters it
was given (no copy): after each optimiser step call `engine.update_weights(new_params)`,
which drops the now stale KV and prefix caches.

`rollout_batch(rollout, advantages, seq_len)` lays the completions out in the batch
schema the `grpo` objective reads (`axcore_rl.objective`): row `i` is prompt + completion
`i`, `input_ids` its tokens but the last, `target_labels` its tokens but the first (-1 on
padding), `target_weights` 1 on the completion's targets, `old_logprobs` the sampler's
log-probabilities at those targets, `positions`, `segment_ids` (1 on tokens, 0 on padding)
and `advantages` `[rows]`. Completion token k of a prompt of P tokens is the target at
index P - 1 + k. `preference_batch(rollout, rewards, seq_len)` instead pairs each prompt's
best and worst completion for online DPO (the dpo plugin's `dpo` objective).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from axcore.engine import Engine
from axcore.engine.requests import GenerationRequest, SamplingParams

from axcore_rl.objective import GrpoError


@dataclasses.dataclass
class Rollout:
    """The completions of one rollout, grouped by prompt: completion `p * group_size + j` is prompt p's j-th."""

    # Each prompt's token ids, [prompts].
    prompts: list[tuple[int, ...]]
    # Completions per prompt (G).
    group_size: int
    # Each completion's new tokens, [prompts * G] lists (a stop token included).
    completions: list[list[int]]
    # The sampler's log-probability of each of those tokens, [prompts * G] lists of floats.
    logprobs: list[list[float]]
    # Why each completion ended: "stop" (a stop or end-of-sequence token) or "length".
    finish_reasons: list[str]
    # Wall-clock seconds the engine took for the rollout.
    seconds: float

    def prompt_of(self, index: int) -> tuple[int, ...]:
        """The prompt of completion `index`."""
        return self.prompts[index // self.group_size]

    @property
    def num_tokens(self) -> int:
        """Tokens generated over all completions."""
        return sum(len(c) for c in self.completions)


def sample_rollouts(engine: Engine, prompts: Sequence[Sequence[int]], group_size: int, *, max_tokens: int,
                    temperature: float = 1.0, seed: int = 0, stop_token_ids: Sequence[int] = ()) -> Rollout:
    """`group_size` completions of each prompt from `engine` on its current parameters (module docstring).

    `seed` makes the draws reproducible: prompt i's request is seeded with `seed * 100003 + i`
    (its G choices draw differently from each other); vary it between steps.
    """
    if group_size < 2:
        raise GrpoError(f"group_size {group_size}: GRPO compares completions of one prompt; sample at least 2.")
    start = time.perf_counter()
    requests = [
        GenerationRequest(f"rollout-{seed}-{i}", tuple(prompt),
                          SamplingParams(n=group_size, max_tokens=max_tokens, temperature=temperature, logprobs=0,
                                         seed=seed * 100003 + i, stop_token_ids=tuple(stop_token_ids)))
        for i, prompt in enumerate(prompts)
    ]
    outputs = engine.generate(requests)
    completions, logprobs, reasons = [], [], []
    for output in outputs:
        for choice in sorted(output.choices, key=lambda c: c.index):
            completions.append(list(choice.token_ids))
            logprobs.append(list(choice.logprobs))
            reasons.append(choice.finish_reason)
    return Rollout([tuple(p) for p in prompts], group_size, completions, logprobs, reasons,
                   time.perf_counter() - start)


def rollout_batch(rollout: Rollout, advantages: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """The `grpo` objective's batch of `rollout` (module docstring): `[prompts * G, seq_len]` arrays and
    `advantages` `[prompts * G]` float32.

    Raises GrpoError if a prompt plus its completion is longer than `seq_len + 1` tokens.
    """
    rows = len(rollout.completions)
    if np.shape(advantages) != (rows,):
        raise GrpoError(f"advantages: shape {np.shape(advantages)}, need one per completion ({rows},).")
    batch = {
        "input_ids": np.zeros((rows, seq_len), np.int32),
        "target_labels": np.full((rows, seq_len), -1, np.int32),
        "target_weights": np.zeros((rows, seq_len), np.float32),
        "old_logprobs": np.zeros((rows, seq_len), np.float32),
        "positions": np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1)),
        "segment_ids": np.zeros((rows, seq_len), np.int32),
        "advantages": np.asarray(advantages, np.float32),
    }
    for i, (completion, logprobs) in enumerate(zip(rollout.completions, rollout.logprobs)):
        prompt = rollout.prompt_of(i)
        tokens = np.asarray([*prompt, *completion], np.int32)
        inputs = len(tokens) - 1
        if inputs > seq_len:
            raise GrpoError(f"completion {i}: its prompt ({len(prompt)} tokens) and completion ({len(completion)}) "
                            f"need seq_len >= {inputs}, the batch has {seq_len}; raise seq_len or lower max_tokens.")
        batch["input_ids"][i, :inputs] = tokens[:-1]
        batch["target_labels"][i, :inputs] = tokens[1:]
        batch["segment_ids"][i, :inputs] = 1
        first = len(prompt) - 1
        batch["target_weights"][i, first:inputs] = 1.0
        batch["old_logprobs"][i, first:inputs] = logprobs
    return batch


def preference_batch(rollout: Rollout, rewards: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Online DPO rows from a rollout: the `dpo` objective's batch (the dpo plugin) of `[2 * pairs, seq_len]` arrays.

    For each prompt whose completions' `rewards` (`[prompts * G]`) differ, its best
    completion (the first of equal ones) is row 2k, the chosen, and its worst (the first of
    equal ones) row 2k + 1, the rejected; `target_weights` is 1 on each completion's
    tokens. A prompt whose completions all score the same gives no pair; with none at all
    the arrays have 0 rows.
    """
    rewards = np.asarray(rewards)
    if rewards.shape != (len(rollout.completions),):
        raise GrpoError(f"rewards: shape {rewards.shape}, need one per completion ({len(rollout.completions)},).")
    prompts, completions, logprobs = [], [], []
    for p, prompt in enumerate(rollout.prompts):
        group = rewards[p * rollout.group_size:(p + 1) * rollout.group_size]
        if group.max() == group.min():
            continue
        prompts.append(prompt)
        for j in (int(np.argmax(group)), int(np.argmin(group))):
            completions.append(rollout.completions[p * rollout.group_size + j])
            logprobs.append(rollout.logprobs[p * rollout.group_size + j])
    pairs = Rollout(prompts, 2, completions, logprobs, ["pair"] * len(completions), 0.0)
    batch = rollout_batch(pairs, np.zeros(len(completions), np.float32), seq_len)
    return {k: v for k, v in batch.items() if k not in ("old_logprobs", "advantages")}


__all__ = ["Rollout", "preference_batch", "rollout_batch", "sample_rollouts"]
