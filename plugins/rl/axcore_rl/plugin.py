"""The rl plugin: the `grpo` objective, the `rewards` registry family (its own hookspec), the built-in rewards,
the `prompts` data source and the rollout stage of `axcore train` (an example experiment: plugins/rl/examples/rl.yaml).

`plugins: [rl]` with `trainer.objective: {type: grpo, ...}`; rewards are found in
`registries.rewards` by name (`exact_match`, `format`, `python`, and those of other
plugins implementing `axcore_register_rewards`). With `input.source: {type: prompts, ...}`
`axcore train` runs GRPO (or, with `rl.algorithm: online_dpo` and the dpo plugin, online
DPO): the `rl:` section (`axcore_rl.settings.RlSettings`) says how it samples and scores,
the loop hook `rollouts` (`axcore_rl.stage`) makes each step's batch from the live
parameters. The transform checks such a config (`axcore_rl.settings.check_config`) and
sets `input.source.repeat` to `rl.group_size`; it leaves any other config as it is.
"""

from __future__ import annotations

import axcore
from axcore.config import is_config_of, replace

from axcore_rl.hookspecs import RewardSpecs
from axcore_rl.objective import GRPO
from axcore_rl.prompts import PromptFiles
from axcore_rl.rewards import REWARDS
from axcore_rl.settings import RlSettings, check_config
from axcore_rl.stage import RolloutStage


@axcore.hookimpl
def axcore_add_hookspecs(add_hookspecs):
    add_hookspecs(RewardSpecs)


@axcore.hookimpl
def axcore_register_objectives(register):
    register("grpo", GRPO)


@axcore.hookimpl
def axcore_register_rewards(register):
    for name, reward in REWARDS.items():
        register(name, reward)


@axcore.hookimpl
def axcore_register_data_sources(register):
    register("prompts", PromptFiles)


@axcore.hookimpl
def axcore_register_loop_hooks(register):
    register("rollouts", RolloutStage)


@axcore.hookimpl
def axcore_settings_config():
    return RlSettings()


@axcore.hookimpl
def axcore_transform_config(config, settings, registries):
    if not is_config_of(config.input.source, PromptFiles):
        return config
    check_config(config, settings, registries)
    return replace(config, PromptFiles, lambda _, source: source.set(repeat=settings.group_size))
