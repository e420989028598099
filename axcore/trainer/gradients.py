"""Gradients of the objective over one batch, with gradient accumulation (`trainer.microbatches`).

Both functions take the `TrainStep` (its model, objective, config, masks and shardings)
and return `(loss, metrics, summaries, state_updates, raw_grads)`: the objective's loss
and metrics, the output collection's summaries and state updates, and `raw_grads`, which
holds, for overwrite-with-gradient leaves, their new values (a kernel's custom VJP
returns them as the cotangent) and the gradient for every other leaf.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def batch_gradients(step: Any, params: dict, batch: dict, key: jax.Array, objective_state: Any = None) -> tuple:
    """The objective's loss, metrics, summaries, state updates and raw gradients of one (micro)batch."""
    trainable, owg = step.trainable, step.overwrite_with_gradient

    def loss_fn(params):
        # Non-trainable parameters (kernel state) get no gradient, except those whose gradient is
        # their new value (overwrite_with_gradient: a kernel's custom VJP returns it as the cotangent).
        params = jax.tree.map(lambda t, o, p: p if t or o else jax.lax.stop_gradient(p), trainable, owg, params)
        out = step.objective.loss(step.model, params, batch, prng_key=key, is_training=True, state=objective_state)
        return out.loss, (out.metrics, out.collection.summaries, out.collection.state_updates)

    # allow_int: a kernel may store a frozen weight as integers (a quantized base, `weight_spec`); its
    # float0 "gradient" becomes zeros of its dtype, which every later step (optimizer, norms) accepts.
    (loss, (metrics, summaries, state_updates)), raw_grads = jax.value_and_grad(loss_fn, has_aux=True, allow_int=True)(
        params
    )
    raw_grads = jax.tree.map(lambda p, g: jnp.zeros_like(p) if g.dtype == jax.dtypes.float0 else g, params, raw_grads)
    return loss, metrics, summaries, state_updates, raw_grads


def accumulated_gradients(step: Any, params: dict, batch: dict, key: jax.Array, objective_state: Any = None) -> tuple:
    """`batch_gradients` over `trainer.microbatches` microbatches, combined as one batch would be.

    Microbatch i holds rows i, i + m, i + 2m, ... of the batch, so each device keeps
    its own rows (no resharding). Loss, gradients and metrics are averaged weighted by
    each microbatch's `num_tokens` metric (equal weights if the objective reports none), so
    the result is the full batch's up to float rounding; `num_tokens` is summed;
    summaries are averaged; overwrite-with-gradient values are combined by elementwise
    maximum (amax histories see the largest value of the step); state updates are the
    last microbatch's.
    """
    m = step.cfg.trainer.microbatches
    if m == 1:
        return batch_gradients(step, params, batch, key, objective_state)
    spec = step.batch_sharding.spec
    micro_sharding = jax.sharding.NamedSharding(step.mesh, jax.sharding.PartitionSpec(None, *spec))

    def split(x):
        x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, micro_sharding)

    micro = jax.tree.map(split, batch)
    owg = step.overwrite_with_gradient

    def one(i, microbatch):
        loss, metrics, summaries, updates, grads = batch_gradients(
            step, params, microbatch, jax.random.fold_in(key, i), objective_state
        )
        weight = metrics["num_tokens"].astype(jnp.float32) if "num_tokens" in metrics else jnp.float32(1.0)
        return weight, loss, metrics, summaries, updates, grads

    shapes = jax.eval_shape(one, 0, jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    # Overwrite-with-gradient leaves start at -inf: their combination is a maximum.
    init_grads = jax.tree.map(lambda o, g: jnp.full_like(g, -jnp.inf) if o else g, owg, zeros[5])

    def body(acc, xs):
        weight, loss, metrics, summaries, updates, grads = one(*xs)
        acc_weight, acc_loss, acc_metrics, acc_summaries, _, acc_grads = acc
        metrics = {
            k: acc_metrics[k] + (v if k == "num_tokens" else weight * v.astype(acc_metrics[k].dtype))
            for k, v in metrics.items()
        }
        summaries = jax.tree.map(lambda a, v: a + v / m, acc_summaries, summaries)
        grads = jax.tree.map(
            lambda o, a, g: jnp.maximum(a, g) if o else a + (weight * g).astype(a.dtype), owg, acc_grads, grads
        )
        return (acc_weight + weight, acc_loss + weight * loss, metrics, summaries, updates, grads), None

    init = (zeros[0], zeros[1], zeros[2], zeros[3], zeros[4], init_grads)
    (total, loss, metrics, summaries, updates, grads), _ = jax.lax.scan(body, init, (jnp.arange(m), micro))
    metrics = {k: v if k == "num_tokens" else (v / total).astype(v.dtype) for k, v in metrics.items()}
    grads = jax.tree.map(lambda o, g: g if o else (g / total).astype(g.dtype), owg, grads)
    return loss / total, metrics, summaries, updates, grads
