"""The rl plugin's own hook: `axcore_register_rewards` (adds the `rewards` registry family).

Added through `axcore_add_hookspecs` when the rl plugin is registered; any plugin listed
with it may implement the hook to ship rewards (`registries.rewards`).
"""

from __future__ import annotations

import axcore
from axcore.registry import Family, module_class_validator, registers

from axcore_rl.rewards import Reward


class RewardSpecs:
    """Holder of the rl plugin's hookspecs (`add_hookspecs(RewardSpecs)`)."""

    @registers(Family("rewards", "reward", module_class_validator(Reward), config_names=True))
    @axcore.hookspec
    def axcore_register_rewards(self, register) -> None:
        """Register rewards that an `rl` run's `rewards:` list names with `type: <name>`.

        Args:
            register: `register(name, reward_class, *, override=False)`; the class must subclass
                `axcore_rl.Reward`, whose `__call__(completion, sample)` returns a float.

        Returns nothing. Called like the other registration hooks (same duplicate-name rule,
        one config namespace). The built-ins are exact_match, format and python.
        """
