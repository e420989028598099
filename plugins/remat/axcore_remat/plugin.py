"""The remat plugin: sets `remat_policy` on every `RepeatedTransformer`.

The scanned stack wraps its per-layer body in `jax.checkpoint(policy=...)`, so the
backward pass recomputes what the policy does not save. A model without a scanned
stack (`repeated_transformer`) has nothing to remat: the transform matches nothing
and axcore raises NoMatchError naming this plugin.
"""

from __future__ import annotations

import jax

from axcore import ConfigBase, hookimpl
from axcore.config import replace
from axcore.errors import ConfigError
from axcore.layers import RepeatedTransformer


class RematSettings(ConfigBase):
    """Settings of the remat plugin (the experiment's `remat:` section)."""

    # A jax.checkpoint_policies name: nothing_saveable (least memory), dots_saveable, ...
    policy: str = "nothing_saveable"


@hookimpl
def axcore_settings_config():
    return RematSettings()


@hookimpl
def axcore_transform_config(config, settings):
    if not hasattr(jax.checkpoint_policies, settings.policy):
        raise ConfigError(
            f"remat.policy '{settings.policy}' is not in jax.checkpoint_policies; try 'nothing_saveable'."
        )
    return replace(config, RepeatedTransformer, lambda _, c: c.set(remat_policy=settings.policy))
