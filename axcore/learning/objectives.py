"""Objectives: the training loss as a registered component (`trainer.objective`, e.g. `{type: next_token}`).

The train step (`axcore.trainer.step.TrainStep`) differentiates whatever its objective
returns; everything else in the step (gradient accumulation, clipping, the optimizer,
kernel-state updates, the non-finite check) is shared by every objective.

Contract of `Objective.loss(model, params, batch, *, prng_key, is_training, state)`:

- `model` is the experiment's root module, `params` its parameter tree (non-trainable
  leaves already gradient-stopped), `batch` one (micro)batch of `[rows, seq]` arrays as
  the input pipeline declares them, `prng_key` the step's key (None in evaluation).
- It runs the model itself, as often as it needs, with `axcore.functional(model, params,
  inputs, prng_key, is_training, method=...)`: `method="forward"` gives the model's own
  loss (what `next_token` returns), `method="logits"` the `[rows, seq, vocab]` float32
  logits of a causal LM, for a loss computed here.
- It returns an `ObjectiveOutput`: a float32 scalar `loss` (the quantity differentiated),
  scalar `metrics` (logged as `train/<name>`; a `num_tokens` metric weights microbatches
  when `trainer.microbatches` > 1, otherwise they weigh the same) and the
  `OutputCollection` whose summaries and state updates the step applies (with several
  forward passes: the one of the parameters being trained, e.g. the chosen pass).

How a preference loss (DPO) fits: the pipeline declares the pair's fields (chosen and
rejected rows); `loss` runs `method="logits"` on each (two forward passes, or one over
both stacked along the rows) and compares their log-probabilities with a frozen
reference model's. The reference comes from objective state: `init_state(params)`
returns a tree (e.g. `{"reference": params}`, a copy of the initial or imported
parameters) that the train state holds under `"objective"`, sharded like the parameters
where it is shaped like them (else replicated), saved and restored with every
checkpoint, and passed to `loss` as `state`, never differentiated nor updated. The
default `init_state` returns None and the train state has no `"objective"` entry.

Fields beyond the input pipeline's (`batch_fields`): an objective that reads more than
`axcore.data.schema.BATCH_SCHEMA` (e.g. the sampler's log-probabilities of rollout rows)
declares each as a `BatchField` (`[batch, seq]`, a dtype); the train step is compiled
ahead for the batch schema plus them, and whatever makes its batches (a loop hook's
`next_batch`, `axcore.trainer.hooks`) must add them. Default: none.

Evaluation (`eval_sums`) is the held-out measure logged as `eval/loss`; by default the
model's weighted cross-entropy (`cross_entropy` and `num_tokens` of its `forward`
metrics), which an objective may replace. It gets no objective state.

This file imports neither hookspecs nor the plugin manager (hookspecs validate
registrations against `Objective`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from axcore.config import Configurable
from axcore.data.schema import BatchField
from axcore.module import OutputCollection, functional


class ObjectiveOutput(NamedTuple):
    """What an objective computes from one (micro)batch."""

    # Float32 scalar, the quantity the train step differentiates.
    loss: jax.Array
    # Scalar metrics, logged as train/<name>; "num_tokens" (if present) weights microbatches.
    metrics: dict[str, jax.Array]
    # The output collection whose summaries and state updates the step applies.
    collection: OutputCollection


class Objective(Configurable):
    """Base of registered objectives. Subclasses implement `loss` (see the module docstring)."""

    class Config(Configurable.Config):
        """Configures Objective."""

    def init_state(self, params: Any) -> Any:
        """State the objective keeps in the train state (e.g. a frozen reference copy of `params`); None: none.

        Called inside jit with the initial (or restored parameters-only) parameter tree; must be
        pure. Subtrees shaped like `params` are sharded like them.
        """
        del params
        return None

    def batch_fields(self) -> tuple[BatchField, ...]:
        """The `[batch, seq]` fields `loss` reads beyond BATCH_SCHEMA's (module docstring); () by default."""
        return ()

    def loss(
        self, model: Any, params: Any, batch: dict, *, prng_key: jax.Array | None, is_training: bool, state: Any = None
    ) -> ObjectiveOutput:
        """The objective's loss, metrics and output collection of `batch` (module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss().")

    def eval_sums(self, model: Any, params: Any, batch: dict) -> dict[str, jax.Array]:
        """`{"xent_sum", "tokens"}` float scalars of `batch`: summed over batches, eval/loss is their ratio.

        Default: the model's `forward` metrics, `cross_entropy * num_tokens` and `num_tokens`
        (the weighted cross-entropy, nats per target token).
        """
        (_, metrics), _ = functional(model, params, (batch,), None, False)
        return {"xent_sum": metrics["cross_entropy"] * metrics["num_tokens"], "tokens": metrics["num_tokens"]}


class NextToken(Objective):
    """Next-token prediction: the model's own `forward` loss and metrics.

    For `CausalLM`: the weighted cross-entropy, plus `model.z_loss_scale` x z-loss, plus every
    layer's `aux_loss`; metrics cross_entropy, z_loss, num_tokens and aux_loss. With
    `model.loss_chunk_len` (or the `chunked_loss` mesh-rule modifier) the model computes the
    head and cross-entropy in chunks of positions, never the `[rows, seq, vocab]` logits.
    """

    class Config(Objective.Config):
        """Configures NextToken (no settings: the loss's terms are the model's, e.g. model.z_loss_scale)."""

    def loss(
        self, model: Any, params: Any, batch: dict, *, prng_key: jax.Array | None, is_training: bool, state: Any = None
    ) -> ObjectiveOutput:
        del state
        (loss, metrics), collection = functional(model, params, (batch,), prng_key, is_training)
        return ObjectiveOutput(loss, metrics, collection)


# The built-in objectives by registered name (registered by `axcore.trainer.plugin`).
OBJECTIVES = {"next_token": NextToken}

__all__ = ["OBJECTIVES", "NextToken", "Objective", "ObjectiveOutput"]
