"""The rl plugin: the `grpo` objective, the `rewards` registry family (its own hookspec) and the built-in rewards.

`plugins: [rl]` with `trainer.objective: {type: grpo, ...}`; rewards are found in
`registries.rewards` by name (`exact_match`, `format`, `python`, and those of other
plugins implementing `axcore_register_rewards`).
"""

from __future__ import annotations

import axcore

from axcore_rl.hookspecs import RewardSpecs
from axcore_rl.objective import GRPO
from axcore_rl.rewards import REWARDS


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
