"""Optimizers: registered update rules that configs name with `type: <name>`.

An optimizer is a `Configurable` whose `transform()` returns an optax
`GradientTransformation` turning (clipped) gradients into an update *direction*;
the learner (`axcore.trainer.learner`) adds decoupled weight decay and multiplies
by the negated learning rate, so every optimizer gets the schedule, clipping,
weight-decay scales and the freezing of non-trainable parameters for free.

Built-ins (registered by the built-in plugin `axcore.trainer.plugin`):
`adamw` (Adam with configurable moment dtypes), `adafactor`, `lion` and `sgd`.

This file imports neither hookspecs nor the plugin manager (hookspecs validate
registrations against `Optimizer`).
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from axcore.config import Configurable, DType, Floating, NonNegative, Positive, Probability, UnitInterval


class Optimizer(Configurable):
    """Base of registered optimizers. Subclasses implement `transform()`."""

    class Config(Configurable.Config):
        """Configures Optimizer."""

    def transform(self) -> optax.GradientTransformation:
        """The update direction from gradients: an optax transformation.

        `update(grads, state, params)` gets the trainable parameters' gradients
        (after global-norm clipping) and returns a direction the learner scales by
        `-learning_rate` after adding weight decay. Its state may hold trees like
        the parameters (they are sharded like the parameters).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement transform().")


class ScaleByAdamState(NamedTuple):
    """State of `scale_by_adam`."""

    # Steps taken, int32 [].
    count: jax.Array
    # First moment m, a tree like the parameters.
    mu: Any
    # Second moment v, a tree like the parameters.
    nu: Any


def scale_by_adam(b1: float, b2: float, eps: float, moment_dtype: Any = None) -> optax.GradientTransformation:
    """Adam's direction (Kingma & Ba, Algorithm 1), both moments stored in `moment_dtype`.

        m_t = b1 m_{t-1} + (1 - b1) g_t          v_t = b2 v_{t-1} + (1 - b2) g_t^2
        m^_t = m_t / (1 - b1^t)                  v^_t = v_t / (1 - b2^t)
        direction = m^_t / (sqrt(v^_t) + eps)

    Arithmetic is in float32; m_t and v_t are rounded to `moment_dtype` (None: each
    parameter's dtype) when stored, and the direction is computed from the stored
    values, so the update is a function of the state alone.
    """

    def init(params):
        def zeros(p):
            return jnp.zeros(p.shape, p.dtype if moment_dtype is None else moment_dtype)

        return ScaleByAdamState(jnp.zeros([], jnp.int32), jax.tree.map(zeros, params), jax.tree.map(zeros, params))

    def update(grads, state, params=None):
        del params
        count = optax.safe_int32_increment(state.count)
        t = count.astype(jnp.float32)

        def moments(g, m, v):
            g = g.astype(jnp.float32)
            m_new = (b1 * m.astype(jnp.float32) + (1 - b1) * g).astype(m.dtype)
            v_new = (b2 * v.astype(jnp.float32) + (1 - b2) * g * g).astype(v.dtype)
            return m_new, v_new

        def direction(g, m, v):
            m_hat = m.astype(jnp.float32) / (1 - b1**t)
            v_hat = v.astype(jnp.float32) / (1 - b2**t)
            return (m_hat / (jnp.sqrt(v_hat) + eps)).astype(g.dtype)

        pairs = jax.tree.map(moments, grads, state.mu, state.nu)
        mu = jax.tree.map(lambda _, pair: pair[0], grads, pairs)
        nu = jax.tree.map(lambda _, pair: pair[1], grads, pairs)
        return jax.tree.map(direction, grads, mu, nu), ScaleByAdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


class AdamW(Optimizer):
    """Adam (the learner adds decoupled weight decay, which makes it AdamW)."""

    class Config(Optimizer.Config):
        """Configures AdamW."""

        # Decay of the first moment (mean of gradients).
        b1: Annotated[float, Probability] = 0.9
        # Decay of the second moment (mean of squared gradients).
        b2: Annotated[float, Probability] = 0.95
        # Added to the root of the second moment.
        eps: Annotated[float, NonNegative] = 1e-8
        # Storage dtype of both moments; None = each parameter's dtype (float32 master weights).
        moment_dtype: Annotated[DType, Floating] | None = None

    def transform(self) -> optax.GradientTransformation:
        cfg = self._config
        return scale_by_adam(cfg.b1, cfg.b2, cfg.eps, cfg.moment_dtype)


class Adafactor(Optimizer):
    """Adafactor (Shazeer & Stern, 2018): factored second moments, optional update clipping."""

    class Config(Optimizer.Config):
        """Configures Adafactor."""

        # Decay exponent of the second-moment estimate (the decay at step t is 1 - t^-decay_rate).
        decay_rate: Annotated[float, UnitInterval] = 0.8
        # Added to the squared gradients.
        epsilon: Annotated[float, NonNegative] = 1e-30
        # Factor the second moment of a matrix only if both of its last two dimensions are this large.
        min_dim_size_to_factor: Annotated[int, NonNegative] = 128
        # Clip each update to this root-mean-square; None disables it.
        clipping_threshold: Annotated[float, Positive] | None = 1.0
        # Momentum on the clipped updates; None disables it.
        momentum: Annotated[float, Probability] | None = None

    def transform(self) -> optax.GradientTransformation:
        cfg = self._config
        parts = [
            optax.scale_by_factored_rms(
                decay_rate=cfg.decay_rate, epsilon=cfg.epsilon, min_dim_size_to_factor=cfg.min_dim_size_to_factor
            )
        ]
        if cfg.clipping_threshold is not None:
            parts.append(optax.clip_by_block_rms(cfg.clipping_threshold))
        if cfg.momentum is not None:
            parts.append(optax.ema(cfg.momentum, debias=False))
        return optax.chain(*parts)


class Lion(Optimizer):
    """Lion (Chen et al., 2023): the sign of an interpolated momentum."""

    class Config(Optimizer.Config):
        """Configures Lion."""

        # Interpolation between momentum and gradient for the update.
        b1: Annotated[float, Probability] = 0.9
        # Decay of the momentum.
        b2: float = 0.99
        # Storage dtype of the momentum; None = each parameter's dtype.
        moment_dtype: Annotated[DType, Floating] | None = None

    def transform(self) -> optax.GradientTransformation:
        cfg = self._config
        return optax.scale_by_lion(b1=cfg.b1, b2=cfg.b2, mu_dtype=cfg.moment_dtype)


class SGD(Optimizer):
    """Stochastic gradient descent, with optional (Nesterov) momentum."""

    class Config(Optimizer.Config):
        """Configures SGD."""

        # Momentum decay; 0 is plain SGD (no state).
        momentum: Annotated[float, Probability] = 0.0
        # Nesterov momentum instead of heavy ball.
        nesterov: bool = False

    def transform(self) -> optax.GradientTransformation:
        cfg = self._config
        if not cfg.momentum:
            return optax.identity()
        return optax.trace(decay=cfg.momentum, nesterov=cfg.nesterov)


# Registered names of the built-in optimizers.
OPTIMIZERS = {"adamw": AdamW, "adafactor": Adafactor, "lion": Lion, "sgd": SGD}
