"""The `dpo` objective: direct preference optimization (Rafailov et al. 2023) on paired rows.

Batch contract (what the `preference` source gives with `input.packing: none` and
`input.shuffle: false`, see `axcore_dpo.data`): rows come in pairs, row 2i the prompt
and the chosen reply, row 2i+1 the same prompt and the rejected reply, one document per
row; `target_weights` is 1 on the reply's targets (the tokens after the prompt) and 0
elsewhere. With `s(row) = sum_t target_weights[t] * log p(target_labels[t] | tokens < t)`:

    r_c = beta * (s_policy(chosen) - s_reference(chosen))
    r_r = beta * (s_policy(rejected) - s_reference(rejected))
    loss = mean over pairs of -log sigmoid(r_c - r_r)

A pair whose two rows carry no weight (padding rows) is left out of the mean. Metrics:
`rewards_chosen` and `rewards_rejected` (means of r_c and r_r), `reward_margin` (mean of
r_c - r_r), `reward_accuracy` (fraction of pairs with r_c > r_r), `pairs`, and
`num_tokens` = the number of pairs (it weights microbatches). At identical policy and
reference every reward is 0 and the loss is log 2.

The reference: with `reference: null` (default) a frozen copy of the initial (or
imported) parameters held as objective state (`init_state`), sharded like the
parameters, checkpointed, never trained. With `reference: <regex>` no copy: the
reference is the policy's parameters with every leaf whose '/'-joined path the regex
matches set to zero, e.g. `lora_b` with the lora plugin (B = 0 is the base model, so the
reference costs one more forward pass and no memory). The reference pass runs without
dropout and its log-probabilities are gradient-stopped.

With `precomputed_reference: true` the objective runs no reference pass: the batch
carries `ref_logprobs` `[rows, seq]` float32, the reference's log-probability of each
target (a declared batch field, `batch_fields`), which whatever makes the batches
computes once per batch (the rl plugin's online DPO, reused over several updates).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import jax
import jax.numpy as jnp

from axcore import AxcoreError
from axcore.config import Positive
from axcore.data.schema import BatchField
from axcore.learning.objectives import Objective, ObjectiveOutput
from axcore.module import functional

INPUTS = ("input_ids", "positions", "segment_ids")


class DpoError(AxcoreError):
    """The dpo objective's input does not fit its contract (names the field and what to do)."""


def sequence_log_probs(logits: jax.Array, labels: jax.Array, weights: jax.Array) -> jax.Array:
    """`[rows]` float32: sum over t of `weights[r, t] * log_softmax(logits[r, t])[labels[r, t]]`.

    `logits` `[rows, seq, vocab]`, `labels` int `[rows, seq]` (negative = none; weight 0 there), `weights` `[rows, seq]`.
    """
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum((picked - jax.nn.logsumexp(logits, axis=-1)) * weights.astype(jnp.float32), axis=-1)


class DPO(Objective):
    """Direct preference optimization on paired rows (module docstring)."""

    class Config(Objective.Config):
        """Configures DPO."""

        # Inverse temperature of the implicit reward beta * log(pi / pi_ref) (DPO's beta).
        beta: Annotated[float, Positive] = 0.1
        # None: a frozen copy of the initial parameters; a regex: the parameters with matching leaves zeroed
        # (e.g. 'lora_b' under the lora plugin: the base model, no copy).
        reference: str | None = None
        # True: the batch carries the reference's per-token log-probabilities (`ref_logprobs`), computed once per
        # batch by what makes it (the rl plugin's online DPO); no reference pass in the loss.
        precomputed_reference: bool = False

    def batch_fields(self) -> tuple[BatchField, ...]:
        if not self.config.precomputed_reference:
            return ()
        return (BatchField("ref_logprobs", "float32", 0.0, doc="the reference's log-probability of each target"),)

    def reference_token_logprobs(self, model: Any, params: Any, batch: dict, state: Any = None) -> jax.Array:
        """`[rows, seq]` float32: the reference's log-probability of each target (0 where the label is negative;
        no dropout, no gradient): what `precomputed_reference` batches carry as `ref_logprobs`."""
        inputs = {k: batch[k] for k in INPUTS}
        reference_params = jax.lax.stop_gradient(self._reference(params, state))
        logits, _ = functional(model, reference_params, inputs, None, False, method="logits")
        labels = batch["target_labels"]
        logits = logits.astype(jnp.float32)
        picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        return jax.lax.stop_gradient(jnp.where(labels >= 0, picked - jax.nn.logsumexp(logits, axis=-1), 0.0))

    def init_state(self, params: Any) -> Any:
        return {"reference": params} if self.config.reference is None else None

    def _reference(self, params: Any, state: Any) -> Any:
        if self.config.reference is None:
            return state["reference"]
        regex = re.compile(self.config.reference)

        def zero(path, leaf):
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            return jnp.zeros_like(leaf) if regex.search(name) else leaf

        return jax.tree_util.tree_map_with_path(zero, params)

    def loss(self, model, params, batch, *, prng_key, is_training, state=None) -> ObjectiveOutput:
        inputs = {k: batch[k] for k in INPUTS}
        labels, weights = batch["target_labels"], batch["target_weights"]
        if labels.shape[0] % 2:
            raise DpoError(
                f"The dpo objective takes rows in (chosen, rejected) pairs, but a (micro)batch has {labels.shape[0]} "
                f"rows; make input.batch_size (divided by trainer.microbatches) even."
            )
        logits, collection = functional(model, params, inputs, prng_key, is_training, method="logits")
        policy = sequence_log_probs(logits, labels, weights)
        if self.config.precomputed_reference:
            if "ref_logprobs" not in batch:
                raise DpoError(f"The dpo objective has precomputed_reference: true but the batch has no "
                               f"'ref_logprobs' (it has {sorted(batch)}); set it false, or make batches that carry it.")
            reference = jax.lax.stop_gradient(jnp.sum(batch["ref_logprobs"] * weights.astype(jnp.float32), axis=-1))
        else:
            reference_params = jax.lax.stop_gradient(self._reference(params, state))
            ref_logits, _ = functional(model, reference_params, inputs, None, False, method="logits")
            reference = jax.lax.stop_gradient(sequence_log_probs(ref_logits, labels, weights))
        beta = self.config.beta
        rewards = beta * (policy - reference)
        chosen, rejected = rewards[0::2], rewards[1::2]
        margin = chosen - rejected
        tokens = jnp.sum(weights, axis=-1)
        valid = jnp.logical_or(tokens[0::2] > 0, tokens[1::2] > 0).astype(jnp.float32)
        pairs = jnp.sum(valid)
        count = jnp.maximum(pairs, 1.0)

        def mean(x):
            return jnp.sum(x * valid) / count

        loss = mean(-jax.nn.log_sigmoid(margin))
        metrics = {
            "rewards_chosen": mean(chosen), "rewards_rejected": mean(rejected), "reward_margin": mean(margin),
            "reward_accuracy": mean((margin > 0).astype(jnp.float32)), "pairs": pairs, "num_tokens": pairs,
        }
        return ObjectiveOutput(loss, metrics, collection)
