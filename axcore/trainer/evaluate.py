"""One held-out evaluation, used by the trainer and by `axcore eval`.

Loss = sum over every target of `target_weights * cross-entropy` / sum of `target_weights`
(nats per weighted target token) over the batches evaluated. Both sums are accumulated
on the device (float32 scalars, updated by one jitted step per batch) and fetched once,
at the end; `tokens` is the sum of the weights (the number of targets for 0/1 weights).

Which batches: the eval split's pipeline is one pass in order; padding rows carry zero
weight, so the tail of the last batch changes nothing. `max_batches` (the trainer's
`trainer.eval_batches`, `axcore eval --max-batches`) stops earlier; None or 0 evaluates
the whole split. In a multi-process job every process runs the same number of batches:
after each batch the processes agree on "all exhausted" (a small allgather).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class EvalTotals:
    """The result of one evaluation."""

    # Weighted mean cross-entropy, nats per target token (nan when no token counted).
    loss: float
    # Sum of the target weights counted (the number of target tokens for 0/1 weights).
    tokens: float
    # Batches evaluated.
    batches: int
    # Whether the whole split was read (False when max_batches stopped it first).
    complete: bool


def accumulate_step(eval_step: Callable[[Any, dict], dict]) -> Callable:
    """`(params, batch, totals) -> totals`: adds a batch's `xent_sum` and `tokens` on the device.

    `eval_step(params, batch)` returns `{"xent_sum", "tokens"}` float scalars (the trainer's
    `_eval_step`); `totals` is a float32 `[2]` array (donated).
    """

    def step(params, batch, totals):
        out = eval_step(params, batch)
        return totals + jnp.stack([out["xent_sum"], out["tokens"]]).astype(jnp.float32)

    return step


def _all_exhausted(local: bool) -> bool:
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    return bool(np.all(np.asarray(multihost_utils.process_allgather(np.int32(local)))))


def run_evaluation(step: Callable, params: Any, loaded: Iterable[Any], max_batches: int | None) -> EvalTotals:
    """Evaluates `params` on `loaded` (`LoadedBatch`es: `.batch` on devices, `.exhausted`).

    `step` is `jax.jit(accumulate_step(...))`. Stops when every process's pipeline is
    exhausted, at the end of `loaded`, or after `max_batches` (None or 0: no bound).
    """
    totals = jnp.zeros((2,), jnp.float32)
    batches, complete = 0, False
    iterator = iter(loaded)
    while True:
        if max_batches and batches == max_batches:
            break
        try:
            item = next(iterator)
        except StopIteration:
            complete = True
            break
        totals = step(params, item.batch, totals)
        batches += 1
        if _all_exhausted(bool(getattr(item, "exhausted", False))):
            complete = True
            break
    xent, tokens = (float(x) for x in jax.device_get(totals))
    return EvalTotals(xent / tokens if tokens > 0 else float("nan"), tokens, batches, complete)


__all__ = ["EvalTotals", "accumulate_step", "run_evaluation"]
