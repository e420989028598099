"""The learner: an optax optimizer built from a typed config.

AdamW with per-parameter weight-decay scales taken from the parameter specs
(norm scales and biases declare 0), global-norm clipping, and a warmup followed by
cosine or linear decay.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from axcore.config import ConfigBase
from axcore.params import ParameterSpec


class Schedule(enum.Enum):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


class Optimizer(enum.Enum):
    ADAMW = "adamw"
    SGD = "sgd"


class LearnerConfig(ConfigBase):
    """Optimizer and learning-rate schedule."""

    # Update rule.
    optimizer: Optimizer = Optimizer.ADAMW
    # Peak learning rate (reached at the end of warmup).
    learning_rate: float = 3e-3
    # Shape of the learning rate after warmup.
    schedule: Schedule = Schedule.COSINE
    # Steps of linear warmup from 0 to the peak.
    warmup_steps: int = 30
    # Final learning rate as a fraction of the peak (cosine and linear).
    end_fraction: float = 0.1
    # Steps over which the schedule decays; None = the trainer's max_steps.
    decay_steps: int | None = None
    # Adam first-moment decay.
    b1: float = 0.9
    # Adam second-moment decay.
    b2: float = 0.95
    # Adam epsilon.
    eps: float = 1e-8
    # Decoupled weight decay, multiplied by each parameter's weight_decay_scale.
    weight_decay: float = 0.1
    # Clip gradients to this global norm; None disables clipping.
    max_grad_norm: float | None = 1.0


def learning_rate_schedule(cfg: LearnerConfig, total_steps: int) -> optax.Schedule:
    """Warmup then constant / cosine / linear decay to `end_fraction * learning_rate`."""
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.end_fraction
    decay_steps = max((cfg.decay_steps or total_steps) - cfg.warmup_steps, 1)
    if cfg.schedule is Schedule.CONSTANT:
        after = optax.constant_schedule(peak)
    elif cfg.schedule is Schedule.COSINE:
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.end_fraction)
    else:
        after = optax.linear_schedule(peak, end, decay_steps)
    if cfg.warmup_steps <= 0:
        return after
    warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warmup, after], [cfg.warmup_steps])


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
    """The optimizer for parameters declared by `specs` (a ParameterSpec tree)."""
    schedule = learning_rate_schedule(cfg, total_steps)
    scales = jax.tree.map(
        lambda s: jnp.float32(s.weight_decay_scale), specs, is_leaf=lambda x: isinstance(x, ParameterSpec)
    )
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    if cfg.optimizer is Optimizer.ADAMW:
        parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    if cfg.weight_decay:
        parts.append(scaled_weight_decay(cfg.weight_decay, scales))
    parts.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*parts), schedule
