"""The learner: a registered optimizer and schedule, plus what every optimizer shares.

    update = -learning_rate(step) * (direction(clip(grads)) + weight_decay * scale * params)

`direction` is the configured optimizer's (`trainer.learner.optimizer`, e.g.
`{type: adamw, b1: 0.9}`), `learning_rate(step)` the configured schedule's
(`trainer.learner.schedule`, e.g. `{type: cosine, warmup_steps: 30}`) at peak
`learning_rate`, `scale` each parameter's `weight_decay_scale` (norm scales and
biases declare 0), and `clip` global-norm clipping. Parameters declared with
`trainable=False` (a kernel's state) are left out of all of it: the optimizer keeps no
state for them, their gradients do not count towards the clipping norm, and their
update is zero (the train step takes their new values from `state_updates`).

A non-trainable parameter declared with `overwrite_with_gradient=True` (e.g. an fp8
kernel's gradient amax history, known only in the backward pass) is differentiated
instead of gradient-stopped, and the train step makes its gradient its new value
(after the optimizer and the state updates). It is frozen here like any non-trainable
parameter, so its "gradient" reaches neither the optimizer, the clipping norm nor the
logged `grad_norm`. A step that never uses it gives it gradient zero, and a step that
uses it more than once gives it the sum of the cotangents: a kernel declaring one
must be used exactly once per step at its site.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from axcore.config import ConfigBase, InstantiableConfig, LearningRate, NonNegative, Positive
from axcore.errors import AxcoreError, ConfigError
from axcore.learning.optimizers import AdamW, Optimizer
from axcore.learning.schedules import Cosine, Schedule
from axcore.params import ParameterSpec

# multi_transform labels of trainable and frozen (trainable=False) parameters.
TRAINABLE, FROZEN = "trainable", "frozen"


class LearnerConfig(ConfigBase):
    """Optimizer, learning-rate schedule, weight decay and gradient clipping."""

    # Update rule: a registered optimizer (adamw, adafactor, lion, sgd, or a plugin's).
    optimizer: InstantiableConfig = AdamW.default_config()
    # Shape of the learning rate over the run: a registered schedule (constant, cosine, linear_decay, wsd, ...).
    schedule: InstantiableConfig = Cosine.default_config().set(warmup_steps=30)
    # Peak learning rate (reached at the end of warmup): > 0 and at most 10; above 1 is warned about.
    learning_rate: Annotated[float, LearningRate] = 3e-3
    # Decoupled weight decay, multiplied by the learning rate and by each parameter's weight_decay_scale.
    weight_decay: Annotated[float, NonNegative] = 0.1
    # Clip gradients to this global norm; None disables clipping.
    max_grad_norm: Annotated[float, Positive] | None = 1.0
    # Regex searched in each parameter's '/'-joined path (e.g. 'lora_' for adapters only): only matching
    # parameters train, the others are frozen like trainable=False ones; None = every declared trainable one.
    trainable: str | None = None


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParameterSpec)


def restrict_trainable(specs: Any, pattern: str | None) -> Any:
    """`specs` with every trainable parameter whose '/'-joined path `pattern` does not match (re.search)
    declared `trainable=False`: frozen (no gradient, no optimizer state, no weight decay, never updated).

    `learner.trainable` applies this to the model's specs; None returns `specs` itself.

    Raises:
        ConfigError: `pattern` is not a regex, or matches no trainable parameter.
    """
    if pattern is None:
        return specs
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"'trainer.learner.trainable' ({pattern!r}) is not a regular expression: {e}.") from None
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
    paths = ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat]
    kept = [spec.trainable and regex.search(p) is not None for p, (_, spec) in zip(paths, flat, strict=True)]
    if not any(kept):
        shown = ", ".join([p for p, (_, s) in zip(paths, flat, strict=True) if s.trainable][:5])
        raise ConfigError(
            f"'trainer.learner.trainable' ({pattern!r}) matches no trainable parameter (e.g. {shown}); "
            f"fix the pattern or set it to null to train every parameter."
        )
    frozen = [s if k or not s.trainable else dataclasses.replace(s, trainable=False) for k, (_, s) in zip(kept, flat)]
    return jax.tree_util.tree_unflatten(treedef, frozen)


def trainable_mask(specs: Any) -> Any:
    """A tree like `specs` of bools: whether each parameter is trainable."""
    return jax.tree.map(lambda s: bool(s.trainable), specs, is_leaf=_is_spec)


def overwrite_with_gradient_mask(specs: Any) -> Any:
    """A tree like `specs` of bools: whether each parameter's new value is its gradient."""
    return jax.tree.map(lambda s: bool(s.overwrite_with_gradient), specs, is_leaf=_is_spec)


class StateUpdateError(AxcoreError):
    """A layer recorded a state update that does not fit a non-trainable parameter."""


def apply_state_updates(params: Any, updates: Any, trainable: Any, path: str = "") -> Any:
    """`params` with the leaves in `updates` (nested by child name like `params`) replaced.

    Only non-trainable leaves may be updated; each new value must have its
    parameter's shape and is cast to its dtype. Leaves not in `updates` stay.

    Raises:
        StateUpdateError: naming the path of an update that names no parameter, a
            trainable one, or one of another shape.
    """
    if not updates:
        return params
    out = dict(params)
    for name, value in updates.items():
        where = f"{path}/{name}" if path else str(name)
        if not isinstance(params, dict) or name not in params:
            raise StateUpdateError(
                f"State update '{where}' names no parameter; a layer may only update the non-trainable "
                f"parameters it declares (ParameterSpec(trainable=False))."
            )
        if isinstance(value, dict):
            out[name] = apply_state_updates(params[name], value, trainable[name], where)
            continue
        if isinstance(params[name], dict) or trainable[name]:
            raise StateUpdateError(
                f"State update '{where}' targets a trainable parameter (or a subtree); only parameters "
                f"declared with trainable=False take state updates."
            )
        if tuple(value.shape) != tuple(params[name].shape):
            raise StateUpdateError(
                f"State update '{where}' has shape {tuple(value.shape)}, but the parameter has shape "
                f"{tuple(params[name].shape)}."
            )
        out[name] = value.astype(params[name].dtype)
    return out


def check_component(
    config: Any, base: type, path: str, *, kind: str | None = None, names: list[str] | None = None
) -> None:
    """Raises ConfigError unless `config` builds a subclass of `base`.

    Configs share one namespace of component names, so `optimizer: {type: linear}`
    reads fine but names a layer; this names the path and what to use instead.
    """
    target = getattr(config, "target", None)
    if isinstance(target, type) and issubclass(target, base):
        return
    kind = kind or base.__name__.lower()
    article = "an" if kind[0] in "aeiou" else "a"
    choices = f" ({', '.join(names)})" if names else ""
    raise ConfigError(
        f"Config '{path}' builds {getattr(target, '__qualname__', target)!r}, which is not {article} {kind} "
        f"(a subclass of {base.__module__}.{base.__qualname__}); set '{path}.type' to a registered "
        f"{kind}{choices}."
    )


def learning_rate_schedule(cfg: LearnerConfig, total_steps: int) -> optax.Schedule:
    """The configured schedule at peak `cfg.learning_rate` over `total_steps` steps."""
    check_component(cfg.schedule, Schedule, "trainer.learner.schedule")
    return cfg.schedule.instantiate()(cfg.learning_rate, total_steps)


class ScaledWeightDecayState(NamedTuple):
    """Stateless."""


def scaled_weight_decay(weight_decay: float, scales: Any) -> optax.GradientTransformation:
    """updates + weight_decay * scale * params, with `scales` a tree like params."""

    def init(params):
        del params
        return ScaledWeightDecayState()

    def update(updates, state, params):
        if params is None:
            raise ValueError("scaled_weight_decay needs params.")
        new = jax.tree.map(lambda u, p, s: u + weight_decay * s * p.astype(u.dtype), updates, params, scales)
        return new, state

    return optax.GradientTransformation(init, update)


def build_optimizer(cfg: LearnerConfig, specs: Any, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer for parameters declared by `specs` (a ParameterSpec tree), and its schedule.

    Raises:
        ConfigError: `optimizer` or `schedule` names a component of another kind.
    """
    schedule = learning_rate_schedule(cfg, total_steps)
    check_component(cfg.optimizer, Optimizer, "trainer.learner.optimizer")
    optimizer = cfg.optimizer.instantiate()
    direction = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm is not None else []
    direction.append(optimizer.transform())
    labels = jax.tree.map(lambda trainable: TRAINABLE if trainable else FROZEN, trainable_mask(specs))
    parts = [optax.multi_transform({TRAINABLE: optax.chain(*direction), FROZEN: optax.set_to_zero()}, labels)]
    if cfg.weight_decay:
        scales = jax.tree.map(
            lambda s: jnp.float32(s.weight_decay_scale if s.trainable else 0.0), specs, is_leaf=_is_spec
        )
        parts.append(scaled_weight_decay(cfg.weight_decay, scales))
    parts.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*parts), schedule
