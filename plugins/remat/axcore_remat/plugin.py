"""The remat plugin: sets `remat_policy` on every `RepeatedTransformer`.

The scanned stack wraps its per-layer body in `jax.checkpoint(policy=...)`, so the
backward pass recomputes what the policy does not save. A model without a scanned
stack (`repeated_transformer`) has nothing to remat: the transform matches nothing
and axcore raises NoMatchError naming this plugin.

`policy` is what a layer's `remat_policy` takes (`axcore.layers.base.checkpoint_policy`):
a `jax.checkpoint_policies` name, or a call of one of its factories with string
arguments. Host offloading is such a call: `offload_dot_with_no_batch_dims(device,pinned_host)`
moves the saved outputs of weight matmuls to host memory after the forward pass and
brings them back for the backward (the backend needs a `pinned_host` memory kind).
"""

from __future__ import annotations

from axcore import ConfigBase, hookimpl
from axcore.config import replace
from axcore.errors import ConfigError
from axcore.layers import RepeatedTransformer
from axcore.layers.base import checkpoint_policy


class RematSettings(ConfigBase):
    """Settings of the remat plugin (the experiment's `remat:` section)."""

    # A jax.checkpoint_policies name (nothing_saveable: least memory; dots_saveable, ...) or factory
    # call, e.g. offload_dot_with_no_batch_dims(device,pinned_host) (saved matmul outputs on the host).
    policy: str = "nothing_saveable"


@hookimpl
def axcore_settings_config():
    return RematSettings()


@hookimpl
def axcore_transform_config(config, settings):
    try:
        checkpoint_policy(settings.policy)
    except (AttributeError, TypeError, ValueError) as e:
        raise ConfigError(
            f"remat.policy '{settings.policy}' is not in jax.checkpoint_policies ({e}); try 'nothing_saveable' "
            f"or 'offload_dot_with_no_batch_dims(device,pinned_host)'."
        ) from None
    return replace(config, RepeatedTransformer, lambda _, c: c.set(remat_policy=settings.policy))
