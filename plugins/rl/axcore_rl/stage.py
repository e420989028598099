"""The rollout stage of an `rl` run under `axcore train`: a loop hook that makes each step's batch.

Registered as the loop hook `rollouts` (`axcore_rl.plugin`); active when the experiment
lists `rl` and reads the `prompts` source (`axcore_rl.settings`). Before a step (the
loop's `next_batch` phase, `axcore.trainer.hooks`) it:

1. takes the loader's next batch: `input.batch_size` rows of prompts, each prompt on G =
   `rl.group_size` consecutive rows (`axcore_rl.prompts.PromptFiles`), and finds each
   prompt's sample (the rewards read its fields);
2. tells the engine of the live parameters (`Engine.update_weights(run.state["params"])`,
   the train state the step updates: no copy) and samples G completions of each prompt
   (`axcore_rl.rollout.sample_rollouts`, seeded by `trainer.seed` and the step);
3. scores them (`axcore_rl.rewards.score`) and lays them out as the step's batch, of the
   same `[input.batch_size, input.seq_len]` shape: for `grpo` one completion per row with
   `old_logprobs` and each token's `advantages` (`rollout_batch`), for `online_dpo` each
   prompt's best and worst completion as a (chosen, rejected) pair, padding rows after
   (`preference_batch`); with a reference (grpo's `beta` > 0, dpo's
   `precomputed_reference`) its log-probabilities `ref_logprobs`, computed once here.

That batch serves `rl.updates_per_rollout` steps (counted from the rollout; a run resumed
between two rollouts samples afresh at its first step). The pipeline's position saved
with a checkpoint is that after the rollout's prompts, so a resumed run continues with
the next prompts; the draws depend only on the seed, the step and the parameters, so a
run resumed at a rollout is the run that was not stopped.

Metrics added to each fetched record (the step's, or its rollout's): `rl/reward_mean`,
`rl/reward_std`, `rl/response_length` (completion tokens), `rl/rollout_seconds`,
`rl/rollout_tokens_per_s` (tokens generated per second), `rl/learn_seconds` (the step's
update, from its dispatch until its parameters are ready), `rl/learn_tokens_per_s`
(non-padding batch tokens through the learner per second) and, for online DPO,
`rl/pairs`. One process only (the rollout reads every row).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np

from axcore import AxcoreError
from axcore.config import is_config_of
from axcore.data.schema import BATCH_SCHEMA
from axcore.engine import Engine, EngineConfig
from axcore.trainer.hooks import LoopHook, RunView

from axcore_rl.objective import group_advantages
from axcore_rl.prompts import PromptFiles
from axcore_rl.rewards import score
from axcore_rl.rollout import Rollout, preference_batch, rollout_batch, sample_rollouts
from axcore_rl.settings import Algorithm, RlSettings


class RolloutError(AxcoreError):
    """An rl run's batch cannot be made (names what and what to do)."""


def engine_config(settings: RlSettings, rows: int, seq_len: int, model_limit: int | None, seed: int) -> EngineConfig:
    """The rollout engine's settings: `rows` sequences at once, each at most `seq_len + 1` tokens, none preempted.

    The default token budget is every row's whole sequence: a rollout feeds all its prompts in its first step
    and every sibling's (a prompt's other choices) in its second. A budget of `max(rows, seq_len)`, the
    default until 2026-11-29, admitted a step's siblings a few at a time (each re-feeds its prompt's last,
    partial block), so a 135M model's 16-row rollout ran 9 padded chunk calls instead of 2 (9.6 s -> 3.9 s).
    """
    e = settings.engine
    max_len = seq_len + 1 if model_limit is None else min(seq_len + 1, model_limit)
    return EngineConfig(block_size=e.block_size, num_blocks=1 + rows * math.ceil(max_len / e.block_size),
                        max_seqs=rows, max_tokens_per_step=e.max_tokens_per_step or rows * max_len,
                        max_model_len=max_len, batch_buckets=tuple(e.batch_buckets) if e.batch_buckets else None,
                        token_buckets=tuple(e.token_buckets) if e.token_buckets else None, seed=seed,
                        split_mixed_steps=e.split_mixed_steps,
                        kernels={"paged_attention": "xla", "dot": "xla"} if e.reference_kernels else None)


def group_prompts(batch: dict[str, np.ndarray], group_size: int) -> list[tuple[int, ...]]:
    """The prompt of each group of `group_size` rows of a host batch of prompt rows (one document per row).

    A row of n targets holds the prompt `input_ids[:n] + [target_labels[n - 1]]`. Raises
    RolloutError when a group's rows differ or a row is empty.
    """
    prompts = []
    for first in range(0, len(batch["input_ids"]), group_size):
        rows = set()
        for r in range(first, first + group_size):
            n = int(np.count_nonzero(batch["segment_ids"][r]))
            if n == 0:
                raise RolloutError(f"batch row {r} holds no prompt; an rl run needs every row filled "
                                   f"(input.packing: none, the prompts source).")
            rows.add((*batch["input_ids"][r, :n].tolist(), int(batch["target_labels"][r, n - 1])))
        if len(rows) != 1:
            raise RolloutError(f"batch rows {first}..{first + group_size - 1} are not one prompt; keep "
                               f"input.shuffle: false and input.packing: none so that each prompt's rows stay together.")
        prompts.append(rows.pop())
    return prompts


class RolloutStage(LoopHook):
    """Makes each step's batch from rollouts on the live parameters (module docstring)."""

    def __init__(self):
        self.active, self.engine = False, None

    def on_run_start(self, run: RunView) -> None:
        experiment = run.train_step.experiment
        if "rl" not in experiment.settings or not is_config_of(run.config.input.source, PromptFiles):
            return
        if jax.process_count() > 1:
            raise RolloutError("An rl run samples every prompt in one process; run it with one process.")
        self.active = True
        self.settings: RlSettings = experiment.settings["rl"]
        step, cfg = run.train_step, run.config
        self.source = cfg.input.source.instantiate()
        self.source.use_tokenizer(step.tokenizer, "input.source")
        self.rewards = [reward.instantiate() for reward in self.settings.rewards]
        eos = step.tokenizer.eos_id
        self.eos = () if eos is None else (int(eos),)
        config = engine_config(self.settings, cfg.input.batch_size, cfg.input.seq_len, step.model.max_cache_len(),
                               cfg.trainer.seed)
        with step.op_environment():
            self.engine = Engine(step.model, run.state["params"], config=config, eos_token_ids=self.eos)
        self.reference = self._reference_fn(step)
        self.cached, self.uses, self.record = None, 0, {}
        self.dispatched_at = time.perf_counter()

    def _reference_fn(self, step: Any):
        """The jitted `(params, batch, objective state) -> ref_logprobs [rows, seq]`, or None without a reference."""
        objective, model = step.objective, step.model
        if "ref_logprobs" not in {f.name for f in objective.batch_fields()}:
            return None
        if self.settings.algorithm is Algorithm.GRPO:
            return jax.jit(lambda p, b, s: objective.reference_logprobs(model, p, b, s))
        return jax.jit(lambda p, b, s: objective.reference_token_logprobs(model, p, b, s))

    def next_batch(self, run: RunView) -> Any:
        if not self.active:
            return None
        if self.cached is not None and self.uses < self.settings.updates_per_rollout:
            self.uses += 1
            self.dispatched_at = time.perf_counter()
            return dataclasses.replace(self.cached, rows=0, tokens=0, counts={})
        loaded = next(run.loader)
        host = {k: np.asarray(v) for k, v in jax.device_get(loaded.batch).items()}
        prompts = group_prompts(host, self.settings.group_size)
        batch = self._rollout_batch(run, prompts, run.step + 1)
        placed = {k: jax.device_put(v, run.train_step.batch_sharding) for k, v in batch.items()}
        if self.reference is not None:
            with run.train_step.op_environment():
                placed["ref_logprobs"] = self.reference(run.state["params"], placed, run.state.get("objective"))
        self.learn_tokens = float(np.count_nonzero(batch["segment_ids"]))
        self.cached, self.uses = dataclasses.replace(loaded, batch=placed), 1
        self.dispatched_at = time.perf_counter()
        return self.cached

    def _rollout_batch(self, run: RunView, prompts: list[tuple[int, ...]], step: int) -> dict[str, np.ndarray]:
        """Samples, scores and lays out the rollout of `prompts` for `step` (module docstring, 2 and 3)."""
        s, cfg = self.settings, run.config
        samples = [self.source.sample(p) for p in prompts]
        self.engine.update_weights(run.state["params"])
        with run.train_step.op_environment():
            rollout = sample_rollouts(self.engine, prompts, s.group_size, max_tokens=s.max_tokens,
                                      temperature=s.temperature, seed=cfg.trainer.seed * 1000003 + step,
                                      stop_token_ids=s.stop_token_ids)
        tokenizer = run.train_step.tokenizer
        texts = [tokenizer.decode(np.asarray([t for t in c if t not in self.eos], np.int32))
                 for c in rollout.completions]
        rewards = score(self.rewards, texts, [x for x in samples for _ in range(s.group_size)],
                        workers=s.reward_workers)
        self.record = {
            "rl/reward_mean": float(rewards.mean()), "rl/reward_std": float(rewards.std()),
            "rl/response_length": rollout.num_tokens / len(rollout.completions),
            "rl/rollout_seconds": rollout.seconds,
            "rl/rollout_tokens_per_s": rollout.num_tokens / max(rollout.seconds, 1e-9),
        }
        rows, seq_len = cfg.input.batch_size, cfg.input.seq_len
        if s.algorithm is Algorithm.GRPO:
            scale = run.train_step.objective.config.loss_type != "dr_grpo"
            advantages = group_advantages(rewards, s.group_size, scale=scale)
            batch = rollout_batch(rollout, advantages, seq_len)
            batch["advantages"] = np.repeat(advantages[:, None], seq_len, axis=1)
            return batch
        return self._pairs(rollout, rewards, rows, seq_len)

    def _pairs(self, rollout: Rollout, rewards: np.ndarray, rows: int, seq_len: int) -> dict[str, np.ndarray]:
        """Online DPO's batch: the pairs of `preference_batch`, then padding rows up to `rows`."""
        pairs = preference_batch(rollout, rewards, seq_len)
        batch = BATCH_SCHEMA.padding(rows, seq_len)
        for name, value in pairs.items():
            batch[name][:len(value)] = value
        self.record["rl/pairs"] = len(pairs["input_ids"]) / 2
        return batch

    def on_step(self, run: RunView) -> None:
        if self.active:  # The next rollout needs these parameters anyway: waiting here costs nothing.
            jax.block_until_ready(run.state["params"])
            self.learn_seconds = time.perf_counter() - self.dispatched_at

    def on_fetch(self, run: RunView) -> None:
        if self.active:
            run.metrics.update(self.record)
            run.metrics["rl/learn_seconds"] = self.learn_seconds
            run.metrics["rl/learn_tokens_per_s"] = self.learn_tokens / max(self.learn_seconds, 1e-9)

    def on_run_end(self, run: RunView) -> None:
        if self.engine is not None:
            self.engine.close()

    def on_run_stopped(self, run: RunView, error: BaseException) -> None:
        self.on_run_end(run)


__all__ = ["RolloutError", "RolloutStage", "engine_config", "group_prompts"]
