"""Rollouts on the engine: the sampler's log-probabilities equal the learner's (zero mismatch, float32), the
rows land where the grpo objective reads them, and `update_weights` makes the next rollout sample the new
parameters (no copy)."""

import jax
import numpy as np
import pytest

import axcore
from axcore.engine import Engine, EngineConfig
from axcore.testing import load_tiny_experiment

import axcore_rl.plugin
from axcore_rl import GrpoError, group_advantages, rollout_batch, sample_rollouts, token_log_probs

VOCAB, G, MAX_TOKENS, SEQ = 32, 4, 6, 16
PROMPTS = [[1, 2, 3, 10], [5, 6, 7, 8, 9, 11, 12], [4]]
# One model call per step (split_mixed_steps=False): a step's decode rows computed apart from its prefill
# chunks round differently in float32 (1.7e-5 apart from the learner here, against 2.6e-6 in one call).
# The reference paged attention and dot for the same reason (the CPU decode kernel: 4.3e-6; axcore-cpu's
# OpenBLAS dot: 5.7e-6), as an rl run's engine (`rl.engine.reference_kernels`).
CONFIG = EngineConfig(block_size=4, num_blocks=40, max_seqs=12, max_tokens_per_step=16, max_model_len=16,
                      batch_buckets=(12,), token_buckets=(1, 16), split_mixed_steps=False,
                      kernels={"paged_attention": "xla", "dot": "xla"})


@pytest.fixture(scope="module")
def setup():
    exp = load_tiny_experiment(["rl"], ["trainer.objective={type: grpo}"], objects={"rl": axcore_rl.plugin})
    model = exp.config.model.clone(vocab_size=VOCAB).instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    engine = Engine(model, params, None, config=CONFIG, eos_token_ids=(31,))
    yield model, params, engine, exp.config.trainer.objective.instantiate()
    engine.close()


def _learner_logprobs(model, params, batch):
    """The learner's log-probabilities of the batch's targets: the full forward pass (no cache)."""
    inputs = {k: batch[k] for k in ("input_ids", "positions", "segment_ids")}
    logits = axcore.functional(model, params, inputs, None, False, method="logits")[0]
    return np.asarray(token_log_probs(logits, batch["target_labels"]))


def test_sampler_and_learner_log_probs_match_on_the_same_params(setup):
    model, params, engine, objective = setup
    rollout = sample_rollouts(engine, PROMPTS, G, max_tokens=MAX_TOKENS, seed=7)
    assert len(rollout.completions) == len(PROMPTS) * G and rollout.num_tokens > len(PROMPTS) * G
    assert len({tuple(c) for c in rollout.completions[:G]}) > 1  # A group's choices differ.
    batch = rollout_batch(rollout, np.zeros(len(rollout.completions), np.float32), SEQ)
    mask = batch["target_weights"] > 0
    assert mask.sum() == rollout.num_tokens
    learner = _learner_logprobs(model, params, batch)
    gap = np.abs(learner - batch["old_logprobs"])[mask].max()
    np.testing.assert_allclose(learner[mask], batch["old_logprobs"][mask], rtol=1e-6, atol=1e-6)
    # Row i holds prompt + completion; completion token k is the target at index len(prompt) - 1 + k.
    i = G + 1
    prompt, completion = rollout.prompt_of(i), rollout.completions[i]
    assert batch["target_labels"][i, len(prompt) - 1:len(prompt) - 1 + len(completion)].tolist() == completion
    assert batch["input_ids"][i, :len(prompt)].tolist() == PROMPTS[1]
    # The objective sees ratio 1 on the rollout's own parameters: nothing clipped.
    batch["advantages"] = group_advantages(np.arange(len(rollout.completions), dtype=np.float64) % 3, G)
    out = objective.loss(model, params, batch, prng_key=None, is_training=False)
    assert float(out.metrics["clip_fraction"]) == 0.0 and abs(float(out.metrics["ratio"]) - 1) < 1e-6
    print(f"largest |sampler - learner| log-probability: {gap:.3g}")


def test_update_weights_makes_the_next_rollout_sample_the_new_params(setup):
    model, params, engine, _ = setup
    moved = jax.tree.map(lambda w: w * 1.5, params)
    engine.update_weights(moved)
    try:
        rollout = sample_rollouts(engine, PROMPTS[:2], G, max_tokens=MAX_TOKENS, seed=8)
    finally:
        engine.update_weights(params)
    batch = rollout_batch(rollout, np.zeros(len(rollout.completions), np.float32), SEQ)
    mask = batch["target_weights"] > 0
    np.testing.assert_allclose(_learner_logprobs(model, moved, batch)[mask], batch["old_logprobs"][mask],
                               rtol=1e-6, atol=1e-6)
    assert np.abs(_learner_logprobs(model, params, batch) - batch["old_logprobs"])[mask].max() > 1e-3


def test_a_completion_longer_than_the_rows_is_refused(setup):
    _, _, engine, _ = setup
    rollout = sample_rollouts(engine, PROMPTS[1:2], 2, max_tokens=MAX_TOKENS, seed=9)
    longest = max(len(c) for c in rollout.completions) + len(PROMPTS[1]) - 1
    with pytest.raises(GrpoError, match=f"need seq_len >= {longest}, the batch has 4"):
        rollout_batch(rollout, np.zeros(2, np.float32), 4)
    with pytest.raises(GrpoError, match="sample at least 2"):
        sample_rollouts(engine, PROMPTS, 1, max_tokens=2)
