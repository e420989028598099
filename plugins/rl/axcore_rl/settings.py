"""The `rl:` section of an experiment (`RlSettings`) and what the plugin checks of the rest of the config.

`axcore train` runs an `rl` experiment when `plugins:` lists `rl` and `input.source` is
the `prompts` source: each step's batch is made from the live parameters by the rollout
stage (`axcore_rl.stage`), learned from by `trainer.objective` (`grpo`, or `dpo` of the
dpo plugin for `algorithm: online_dpo`). `check_config` refuses, in one line naming the
field, a config that cannot work: too few completions per prompt, no reward or one that
is not a reward, an objective that does not match the algorithm, input settings that
would split a prompt's rows, held-out evaluation (the prompts hold nothing out).
"""

from __future__ import annotations

import enum
from typing import Annotated

from axcore.config import ConfigBase, InstantiableConfig, Length, Positive, is_config_of
from axcore.errors import ConfigError
from axcore.trainer.learner import check_component

from axcore_rl.objective import GRPO
from axcore_rl.prompts import PromptFiles
from axcore_rl.rewards import Reward


class Algorithm(enum.Enum):
    """What a step learns from its rollouts."""

    # Group-relative advantages and the `grpo` objective.
    GRPO = "grpo"
    # Each prompt's best and worst completion as a (chosen, rejected) pair for the dpo plugin's `dpo` objective.
    ONLINE_DPO = "online_dpo"


class RolloutEngine(ConfigBase):
    """The engine the rollouts run on (`axcore.engine.EngineConfig`'s fields that an rl run sets)."""

    # Tokens per KV block.
    block_size: Annotated[int, Length] = 16
    # Tokens fed per engine step, all rows together; None = rows x (input.seq_len + 1): all prompts at once.
    max_tokens_per_step: Annotated[int, Positive] | None = None
    # Row counts an engine step is padded to; None = the engine's default (powers of four up to the rows).
    batch_buckets: list[int] | None = None
    # Tokens per row an engine step is padded to; None = the engine's default.
    token_buckets: list[int] | None = None
    # False: each engine step is one model call, whose float32 log-probabilities match the learner's (docs/rl.md).
    split_mixed_steps: bool = False
    # True: rollouts run the XLA reference kernels of `paged_attention` and `dot`, whose float32
    # log-probabilities match the learner's closest (docs/rl.md); False: the engine's usual (fastest) kernels.
    reference_kernels: bool = True


class RlSettings(ConfigBase):
    """The `rl:` section (docs/rl.md, "axcore train")."""

    # grpo (the grpo objective) or online_dpo (the dpo plugin's dpo objective on best/worst pairs).
    algorithm: Algorithm = Algorithm.GRPO
    # Completions sampled per prompt (G); input.batch_size rows hold input.batch_size / G prompts.
    group_size: int = 8
    # New tokens per completion at most.
    max_tokens: Annotated[int, Positive] = 16
    # The sampler's temperature (the grpo objective's temperature must equal it).
    temperature: Annotated[float, Positive] = 1.0
    # Tokens that end a completion, besides the tokenizer's end-of-sequence token.
    stop_token_ids: list[int] = []
    # Optimiser steps (trainer steps) on each rollout batch.
    updates_per_rollout: Annotated[int, Positive] = 1
    # Rewards summed per completion: registered rewards, e.g. [{type: exact_match}, {type: format, pattern: ...}].
    rewards: list[InstantiableConfig] = []
    # Threads scoring completions (1 = inline).
    reward_workers: Annotated[int, Positive] = 1
    # The rollout engine's cache and batching.
    engine: RolloutEngine = RolloutEngine()


# Input settings that keep a prompt's G rows together in one batch, in order: field -> value.
GROUPED_ROWS = {"packing": "none", "shuffle": False, "long_documents": "error"}


def _fail(field: str, message: str) -> None:
    raise ConfigError(f"'{field}' {message}")


def check_config(config, settings: RlSettings, registries) -> None:
    """Raises ConfigError naming the first field of an `rl` run that cannot work (module docstring)."""
    if settings.group_size < 2:
        _fail("rl.group_size", f"is {settings.group_size}; sample at least 2 completions per prompt (advantages and "
                               f"pairs compare completions of one prompt).")
    if not settings.rewards:
        _fail("rl.rewards", "is empty; list at least one reward, e.g. [{type: exact_match}].")
    names = registries.rewards.names()
    for i, reward in enumerate(settings.rewards):
        check_component(reward, Reward, f"rl.rewards[{i}]", kind="reward", names=names)
    if not is_config_of(config.input.source, PromptFiles):
        _fail("input.source", "is not a prompts source; an rl run reads prompts: set input.source.type: prompts "
                              "with paths of JSONL prompt files.")
    repeat = config.input.source.repeat
    if repeat not in (1, settings.group_size):
        _fail("input.source.repeat", f"is {repeat} but rl.group_size is {settings.group_size}; leave it unset.")
    for field, wanted in GROUPED_ROWS.items():
        value = getattr(config.input, field)
        if getattr(value, "value", value) != wanted:
            _fail(f"input.{field}", f"is {getattr(value, 'value', value)!r}, but an rl run reads each prompt's "
                                    f"rows together; set input.{field}: {str(wanted).lower()}.")
    if config.input.batch_size % settings.group_size:
        _fail("input.batch_size", f"({config.input.batch_size}) is not a multiple of rl.group_size "
                                  f"({settings.group_size}); a batch holds whole groups of completions.")
    if config.input.data_shards not in (None, 1) or config.input.mixture is not None:
        _fail("input.data_shards", "must be 1 (and input.mixture unset): an rl run's rows come in groups.")
    if config.input.source.eval_fraction or config.trainer.eval_every:
        _fail("trainer.eval_every", "must be 0 (and input.source.eval_fraction 0): the prompts hold nothing out.")
    _check_objective(config.trainer.objective, settings, registries)


def _check_objective(objective, settings: RlSettings, registries) -> None:
    if settings.algorithm is Algorithm.GRPO:
        if not is_config_of(objective, GRPO):
            _fail("trainer.objective", "is not grpo; rl.algorithm grpo learns with trainer.objective: {type: grpo}.")
        if objective.temperature != settings.temperature:
            _fail("trainer.objective.temperature", f"({objective.temperature}) differs from rl.temperature "
                                                   f"({settings.temperature}), the sampler's; set them equal.")
        return
    dpo = registries.objectives["dpo"] if "dpo" in registries.objectives else None
    if dpo is None or not is_config_of(objective, dpo):
        _fail("trainer.objective", "is not dpo; rl.algorithm online_dpo learns with the dpo plugin's objective: "
                                   "list dpo in plugins and set trainer.objective: {type: dpo}.")


__all__ = ["GROUPED_ROWS", "Algorithm", "RlSettings", "RolloutEngine", "check_config"]
