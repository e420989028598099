"""Learning-rate schedules: registered shapes that configs name with `type: <name>`.

A schedule is a `Configurable` that, given the peak learning rate and the run's
length, returns an optax schedule (step -> learning rate). Every schedule starts
with `warmup_steps` (or `warmup_fraction` of the run) of linear warmup from 0 to the
peak; subclasses give the shape after warmup (`after_warmup`).

Built-ins (registered by the built-in plugin `axcore.trainer.plugin`): `constant`,
`cosine`, `linear_decay` (named so because configs share one namespace and
`linear` is a layer) and `wsd` (warmup, stable, decay).

This file imports neither hookspecs nor the plugin manager (hookspecs validate
registrations against `Schedule`).
"""

from __future__ import annotations

import enum
from typing import Annotated

import jax.numpy as jnp
import optax

from axcore.config import Configurable, NonNegative, Positive, Probability, UnitInterval
from axcore.errors import ConfigError


class Schedule(Configurable):
    """Base of registered learning-rate schedules. Subclasses implement `after_warmup`."""

    class Config(Configurable.Config):
        """Configures Schedule."""

        # Steps of linear warmup from 0 to the peak learning rate; 0 = none.
        warmup_steps: Annotated[int, NonNegative] = 0
        # Warmup as a share of the schedule's steps instead (rounded, at least 1 step when above 0), so that it
        # fits runs of any length; None = warmup_steps. Setting both is an error.
        warmup_fraction: Annotated[float, Probability] | None = None
        # Step at which the schedule ends (decay complete); None = the trainer's max_steps.
        total_steps: Annotated[int, Positive] | None = None

        def check_fields(self) -> list[tuple[str, str]]:
            """Both warmups set: a problem at validation time (`axcore config`), before anything trains."""
            if self.warmup_fraction is not None and self.warmup_steps:
                return [("warmup_fraction", f"is set ({self.warmup_fraction}) beside warmup_steps ({self.warmup_steps}); "
                                            f"set one of them (the other to 0 or null)")]
            return []

    def warmup(self, total_steps: int) -> int:
        """The steps of warmup in a schedule of `total_steps` (the config's `total_steps` if set).

        Raises:
            ConfigError: both `warmup_steps` and `warmup_fraction` set, or either out of range.
        """
        cfg = self._config
        if cfg.warmup_steps < 0:
            raise ConfigError(f"Schedule warmup_steps must be >= 0, got {cfg.warmup_steps}.")
        if cfg.warmup_fraction is None:
            return cfg.warmup_steps
        if cfg.warmup_steps:
            raise ConfigError(
                f"trainer.learner.schedule sets both warmup_steps ({cfg.warmup_steps}) and warmup_fraction "
                f"({cfg.warmup_fraction}); set one of them (the other to 0 or null)."
            )
        if not 0.0 <= cfg.warmup_fraction < 1.0:
            raise ConfigError(f"Schedule warmup_fraction must lie in [0, 1), got {cfg.warmup_fraction}.")
        end = cfg.total_steps if cfg.total_steps is not None else total_steps
        return max(round(cfg.warmup_fraction * end), 1) if cfg.warmup_fraction > 0 else 0

    def __call__(self, peak: float, total_steps: int) -> optax.Schedule:
        """The learning rate of each step (0-based): `warmup` steps of warmup, then `after_warmup`.

        Args:
            peak: the learning rate at the end of warmup.
            total_steps: the run's length, used unless the config sets `total_steps`.
        """
        cfg = self._config
        warmup_steps = self.warmup(total_steps)
        end = cfg.total_steps if cfg.total_steps is not None else total_steps
        after = self.after_warmup(peak, max(end - warmup_steps, 1))
        if warmup_steps == 0:
            return after
        warmup = optax.linear_schedule(0.0, peak, warmup_steps)
        return optax.join_schedules([warmup, after], [warmup_steps])

    def after_warmup(self, peak: float, num_steps: int) -> optax.Schedule:
        """The learning rate `s` steps after warmup ended, for `s` in `[0, num_steps]` (and beyond)."""
        raise NotImplementedError(f"{type(self).__name__} must implement after_warmup(peak, num_steps).")


class Constant(Schedule):
    """The peak learning rate after warmup."""

    class Config(Schedule.Config):
        """Configures Constant."""

    def after_warmup(self, peak: float, num_steps: int) -> optax.Schedule:
        return optax.constant_schedule(peak)


class Cosine(Schedule):
    """Half a cosine from the peak down to `end_fraction * peak`, then flat."""

    class Config(Schedule.Config):
        """Configures Cosine."""

        # Final learning rate as a fraction of the peak.
        end_fraction: Annotated[float, UnitInterval] = 0.1

    def after_warmup(self, peak: float, num_steps: int) -> optax.Schedule:
        return optax.cosine_decay_schedule(peak, num_steps, alpha=self._config.end_fraction)


class LinearDecay(Schedule):
    """A straight line from the peak down to `end_fraction * peak`, then flat."""

    class Config(Schedule.Config):
        """Configures LinearDecay."""

        # Final learning rate as a fraction of the peak.
        end_fraction: Annotated[float, UnitInterval] = 0.1

    def after_warmup(self, peak: float, num_steps: int) -> optax.Schedule:
        return optax.linear_schedule(peak, peak * self._config.end_fraction, num_steps)


class DecayShape(enum.Enum):
    """How `wsd` decays, as a function of the decay's progress x in [0, 1]."""

    # 1 - x.
    LINEAR = "linear"
    # (1 + cos(pi x)) / 2.
    COSINE = "cosine"
    # 1 - sqrt(x).
    SQRT = "sqrt"


class WarmupStableDecay(Schedule):
    """Warmup, the peak for most of the run, then a decay over the last `decay_fraction` of it."""

    class Config(Schedule.Config):
        """Configures WarmupStableDecay."""

        # Share of the schedule's steps (after warmup) spent decaying, at its end.
        decay_fraction: Annotated[float, UnitInterval] = 0.2
        # Final learning rate as a fraction of the peak.
        end_fraction: Annotated[float, UnitInterval] = 0.0
        # Shape of the decay.
        decay_shape: DecayShape = DecayShape.LINEAR

    def after_warmup(self, peak: float, num_steps: int) -> optax.Schedule:
        cfg = self._config
        if not 0.0 <= cfg.decay_fraction <= 1.0:
            raise ConfigError(f"wsd decay_fraction must lie in [0, 1], got {cfg.decay_fraction}.")
        decay_steps = max(round(num_steps * cfg.decay_fraction), 1)
        stable_steps = num_steps - decay_steps
        end = peak * cfg.end_fraction

        def schedule(step):
            x = jnp.clip((step - stable_steps) / decay_steps, 0.0, 1.0)
            if cfg.decay_shape is DecayShape.LINEAR:
                shape = 1.0 - x
            elif cfg.decay_shape is DecayShape.COSINE:
                shape = 0.5 * (1.0 + jnp.cos(jnp.pi * x))
            else:
                shape = 1.0 - jnp.sqrt(x)
            return end + (peak - end) * shape

        return schedule


# Registered names of the built-in schedules.
SCHEDULES = {"constant": Constant, "cosine": Cosine, "linear_decay": LinearDecay, "wsd": WarmupStableDecay}
