"""The `grpo` objective: group relative policy optimization (Shao et al. 2024, DeepSeekMath) on rollout rows.

Batch contract (what `axcore_rl.rollout.rollout_batch` builds): one row per completion,
the prompt then the completion, `[rows, seq]` arrays `input_ids`, `positions`,
`segment_ids`, `target_labels` and `target_weights` (1 on the completion's targets, 0 on
the prompt's and on padding), plus `old_logprobs` `[rows, seq]` float32 (the sampler's
log-probability of each completion token, at its target index; 0 elsewhere),
`advantages` `[rows]` float32 (`group_advantages`; or `[rows, seq]`, each token's, as
`axcore train` batches carry them) and, optionally, `ref_logprobs`
`[rows, seq]` (the reference's log-probabilities, computed once per rollout batch by
`reference_logprobs`; without them the loss computes them itself when `beta` > 0).

With `logp` the policy's log-probability of each target (of the logits divided by
`temperature`, the sampler's), `r = exp(logp - old_logprobs)` and, per completion i and
token t with mask m (the target weights):

    L[i, t] = -min(r A_i, clip(r, 1 - epsilon, 1 + epsilon_high) A_i) + beta * KL[i, t]
    KL[i, t] = exp(ref - logp) - (ref - logp) - 1          (Schulman's k3 estimator, >= 0)

and the loss normalises `sum_t m L` by `loss_type`:

    sequence: mean over completions of sum_t m L / sum_t m       (GRPO as published)
    token:    sum over completions and t of m L / sum of m       (DAPO's token level)
    dr_grpo:  sum over completions and t of m L / (completions * max_len)   (Dr. GRPO, Liu et al. 2025)

where completions are the rows with any weight and `max_len` is `dr_grpo_length` (None:
the batch's `seq`). Dr. GRPO pairs with `group_advantages(..., scale=False)`.

Metrics: `kl` (mean of KL over completion tokens; 0 without a reference), `clip_fraction`
(fraction of completion tokens whose clipped term is the smaller, so they get no
gradient), `ratio` (mean of r), `max_logprob_gap` (largest |logp - old_logprobs|: on a
rollout's first update, the sampler-learner mismatch), `response_length` (mean completion tokens), `completions`,
and `num_tokens` (completion tokens for `token`, completions otherwise: it weights
microbatches so that their mean is the loss of the whole batch).

The reference (only with `beta` > 0), as the dpo plugin's: `reference: null` a frozen
copy of the initial parameters held as objective state; `reference: <regex>` the
policy's parameters with every matching leaf zeroed (`lora_b` under the lora plugin: the
base model, no copy).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from axcore import AxcoreError
from axcore.config import Positive
from axcore.data.schema import BatchField
from axcore.learning.objectives import Objective, ObjectiveOutput
from axcore.module import functional

INPUTS = ("input_ids", "positions", "segment_ids")


class GrpoError(AxcoreError):
    """The grpo objective's input or settings do not fit its contract (names the field and what to do)."""


def token_log_probs(logits: jax.Array, labels: jax.Array, temperature: float = 1.0) -> jax.Array:
    """`[rows, seq]` float32: `log_softmax(logits / temperature)[labels]` (0 where a label is negative).

    `logits` `[rows, seq, vocab]`, `labels` int `[rows, seq]`.
    """
    logits = logits.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(labels >= 0, picked - jax.nn.logsumexp(logits, axis=-1), 0.0)


def group_advantages(rewards: np.ndarray, group_size: int, *, scale: bool = True, eps: float = 1e-4) -> np.ndarray:
    """`[n]` float32 advantages of `[n]` rewards in consecutive groups of `group_size` (one prompt's completions).

    `A = (r - mean of its group) / (std of its group + eps)` (the unbiased std, as TRL), or
    without `scale` (Dr. GRPO) `A = r - mean of its group`. A group whose rewards are all
    equal gets advantages 0.

    >>> group_advantages(np.array([1., 0., 0., 0.]), 2, scale=False).tolist()
    [0.5, -0.5, 0.0, 0.0]
    """
    rewards = np.asarray(rewards, np.float64)
    if group_size < 2 or rewards.size % group_size:
        raise GrpoError(f"group_size {group_size}: need at least 2 completions per prompt and {rewards.size} rewards "
                        f"in whole groups; set the number of completions per prompt to 2 or more.")
    groups = rewards.reshape(-1, group_size)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (groups.std(axis=1, ddof=1, keepdims=True) + eps)
    return centred.reshape(-1).astype(np.float32)


def reference_params(params: Any, state: Any, reference: str | None) -> Any:
    """The reference's parameters: `state["reference"]` (a frozen copy) when `reference` is None, else
    `params` with every leaf whose '/'-joined path matches the regex `reference` zeroed (gradient-stopped)."""
    if reference is None:
        if not state or "reference" not in state:
            raise GrpoError("The grpo objective has beta > 0 and reference: null, but no reference copy was given "
                            "as objective state; pass state=objective.init_state(initial params).")
        return jax.lax.stop_gradient(state["reference"])
    regex = re.compile(reference)

    def zero(path, leaf):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return jnp.zeros_like(leaf) if regex.search(name) else leaf

    return jax.lax.stop_gradient(jax.tree_util.tree_map_with_path(zero, params))


class GRPO(Objective):
    """Group relative policy optimization on rollout rows (module docstring)."""

    class Config(Objective.Config):
        """Configures GRPO."""

        # Lower clip range of the importance ratio: r is clipped to [1 - epsilon, 1 + epsilon_high].
        epsilon: Annotated[float, Positive] = 0.2
        # Upper clip range; None = epsilon (DAPO's clip-higher sets it larger).
        epsilon_high: float | None = None
        # Weight of the k3 KL estimate to the reference; 0 = no reference (no copy, no extra pass).
        beta: float = 0.0
        # How the per-token losses are averaged: sequence (GRPO), token (DAPO), dr_grpo (Dr. GRPO's constant).
        loss_type: Literal["sequence", "token", "dr_grpo"] = "sequence"
        # dr_grpo's constant length (the generation budget); None = the batch's sequence length.
        dr_grpo_length: int | None = None
        # The sampler's temperature: the learner's log-probabilities are those of logits / temperature.
        temperature: Annotated[float, Positive] = 1.0
        # None: a frozen copy of the initial parameters; a regex: the parameters with matching leaves zeroed.
        reference: str | None = None

    def init_state(self, params: Any) -> Any:
        cfg = self.config
        return {"reference": params} if cfg.beta > 0 and cfg.reference is None else None

    def batch_fields(self) -> tuple[BatchField, ...]:
        """`old_logprobs` and `advantages` (`[rows, seq]` under `axcore train`), and `ref_logprobs` with `beta` > 0."""
        fields = [BatchField("old_logprobs", "float32", 0.0, doc="the sampler's log-probability of each target"),
                  BatchField("advantages", "float32", 0.0, doc="the advantage of each target's completion")]
        if self.config.beta > 0:
            fields.append(BatchField("ref_logprobs", "float32", 0.0, doc="the reference's log-probability of each target"))
        return tuple(fields)

    def reference_logprobs(self, model: Any, params: Any, batch: dict, state: Any = None) -> jax.Array:
        """`[rows, seq]` float32 log-probabilities of the targets under the reference (no dropout, no gradient)."""
        ref = reference_params(params, state, self.config.reference)
        logits, _ = functional(model, ref, {k: batch[k] for k in INPUTS}, None, False, method="logits")
        return jax.lax.stop_gradient(token_log_probs(logits, batch["target_labels"], self.config.temperature))

    def loss(self, model, params, batch, *, prng_key, is_training, state=None) -> ObjectiveOutput:
        cfg = self.config
        for field in ("old_logprobs", "advantages"):
            if field not in batch:
                raise GrpoError(f"The grpo objective needs batch field '{field}' (rollout rows from "
                                f"axcore_rl.rollout.rollout_batch); the batch has {sorted(batch)}.")
        logits, collection = functional(model, params, {k: batch[k] for k in INPUTS}, prng_key, is_training,
                                        method="logits")
        logp = token_log_probs(logits, batch["target_labels"], cfg.temperature)
        if cfg.beta > 0:
            ref = batch["ref_logprobs"] if "ref_logprobs" in batch else self.reference_logprobs(
                model, params, batch, state)
        else:
            ref = None
        loss, metrics = grpo_loss(logp, batch["old_logprobs"], batch["advantages"], batch["target_weights"],
                                  ref_logprobs=ref, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                                  loss_type=cfg.loss_type, dr_grpo_length=cfg.dr_grpo_length)
        return ObjectiveOutput(loss, metrics, collection)


def grpo_loss(logp, old_logprobs, advantages, weights, *, ref_logprobs=None, epsilon=0.2, epsilon_high=None,
              beta=0.0, loss_type="sequence", dr_grpo_length=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss (module docstring) and its metrics from per-token log-probabilities.

    `logp`, `old_logprobs`, `weights` (and `ref_logprobs`, needed when `beta` > 0) `[rows, seq]`;
    `advantages` `[rows]` (or `[rows, seq]`). Returns (float32 scalar loss, scalar metrics).
    """
    mask = weights.astype(jnp.float32)
    adv = advantages.astype(jnp.float32)
    adv = adv if adv.ndim == 2 else adv[:, None]
    ratio = jnp.exp(logp - old_logprobs.astype(jnp.float32))
    high = epsilon if epsilon_high is None else epsilon_high
    unclipped, clipped = ratio * adv, jnp.clip(ratio, 1.0 - epsilon, 1.0 + high) * adv
    per_token = -jnp.minimum(unclipped, clipped)
    if beta > 0:
        delta = ref_logprobs.astype(jnp.float32) - logp
        kl = jnp.exp(delta) - delta - 1.0
        per_token = per_token + beta * kl
    else:
        kl = jnp.zeros_like(per_token)
    lengths = jnp.sum(mask, axis=-1)
    valid = (lengths > 0).astype(jnp.float32)
    completions, tokens = jnp.sum(valid), jnp.sum(mask)
    summed = jnp.sum(per_token * mask, axis=-1)
    if loss_type == "sequence":
        loss = jnp.sum(summed / jnp.maximum(lengths, 1.0)) / jnp.maximum(completions, 1.0)
    elif loss_type == "token":
        loss = jnp.sum(summed) / jnp.maximum(tokens, 1.0)
    elif loss_type == "dr_grpo":
        length = mask.shape[-1] if dr_grpo_length is None else dr_grpo_length
        loss = jnp.sum(summed) / (jnp.maximum(completions, 1.0) * length)
    else:
        raise GrpoError(f"loss_type {loss_type!r}: use sequence, token or dr_grpo.")
    count = jnp.maximum(tokens, 1.0)
    metrics = {
        "kl": jnp.sum(kl * mask) / count,
        "clip_fraction": jnp.sum((clipped < unclipped).astype(jnp.float32) * mask) / count,
        "ratio": jnp.sum(ratio * mask) / count,
        "max_logprob_gap": jnp.max(jnp.abs(logp - old_logprobs) * mask),
        "response_length": tokens / jnp.maximum(completions, 1.0),
        "completions": completions,
        "num_tokens": tokens if loss_type == "token" else completions,
    }
    return loss, metrics


__all__ = ["GRPO", "GrpoError", "group_advantages", "grpo_loss", "reference_params", "token_log_probs"]
