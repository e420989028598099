"""The dpo plugin on the tiny model: the loss and its gradient against a NumPy DPO, log 2 at the reference,
a rising reward margin on learnable preferences, paired rows from the preference source, one-line refusals."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.step import TrainStep

from axcore_dpo import DPO, PreferenceError

BETA = 0.5
SEQ = 64
PAIRED = ["input.packing=none", "input.shuffle=false", "input.long_documents=error", "input.source.eval_fraction=0",
          "trainer.eval_every=0"]
BASE = [*TINY_OVERRIDES, "plugins=[dpo]", f"input.seq_len={SEQ}", f"model.position_embedding.max_len={SEQ}",
        f"trainer.objective={{type: dpo, beta: {BETA}}}", *PAIRED]


def _model(exp):
    return exp.config.model.instantiate(name="model", registries=exp.registries)


def _batch(rows=4, seq=16, vocab=256, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(rows, seq + 1))
    weights = np.zeros((rows, seq), np.float32)
    weights[:, seq // 2:] = 1.0  # The reply: the second half.
    weights[3, -3:] = 0.0  # Replies of different lengths.
    return {"input_ids": ids[:, :-1].astype(np.int32), "target_labels": ids[:, 1:].astype(np.int32),
            "target_weights": weights, "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
            "segment_ids": np.ones((rows, seq), np.int32)}


def _logits(model, params, batch):
    inputs = {k: batch[k] for k in ("input_ids", "positions", "segment_ids")}
    return axcore.functional(model, params, inputs, None, False, method="logits")[0]


def _numpy_dpo(policy_logits, reference_logits, batch, beta):
    """DPO's loss and its gradient with respect to the policy's logits, float64 NumPy."""
    labels, weights = batch["target_labels"], batch["target_weights"].astype(np.float64)

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        top = x.max(-1, keepdims=True)
        return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))

    lp, lr = log_softmax(policy_logits), log_softmax(reference_logits)
    pick = lambda l: (np.take_along_axis(l, labels[..., None], -1)[..., 0] * weights).sum(-1)  # noqa: E731
    delta = beta * (pick(lp) - pick(lr))
    margin = delta[0::2] - delta[1::2]
    loss = np.mean(np.log1p(np.exp(-margin)))
    # d loss / d margin_i = -sigmoid(-margin_i) / pairs; d margin / d s(chosen) = beta = -d margin / d s(rejected).
    d_margin = -1 / (1 + np.exp(margin)) / len(margin)
    d_seq = np.zeros(len(delta))
    d_seq[0::2], d_seq[1::2] = beta * d_margin, -beta * d_margin
    onehot = np.eye(lp.shape[-1])[labels]
    d_logits = d_seq[:, None, None] * weights[..., None] * (onehot - np.exp(lp))
    return loss, d_logits, margin


def test_loss_and_gradient_equal_a_numpy_dpo():
    exp = load_experiment(None, BASE)
    model, objective = _model(exp), exp.config.trainer.objective.instantiate()
    params, reference = model.initialize(jax.random.key(0)), model.initialize(jax.random.key(1))
    batch = _batch()

    def loss_fn(p):
        out = objective.loss(model, p, batch, prng_key=None, is_training=False, state={"reference": reference})
        return out.loss, out.metrics

    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    expected, d_logits, margin = _numpy_dpo(_logits(model, params, batch), _logits(model, reference, batch), batch, BETA)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["reward_margin"]), margin.mean(), rtol=1e-5, atol=1e-6)
    assert abs(expected - math.log(2)) > 0.05  # Policy and reference differ: not the trivial value.
    # The NumPy gradient with respect to the logits, pulled back through the model.
    pull_back = jax.jit(lambda p, g: jax.vjp(lambda q: _logits(model, q, batch), p)[1](g)[0])
    expected_grads = pull_back(params, jnp.asarray(d_logits, jnp.float32))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert any(np.abs(np.asarray(g)).max() > 1e-4 for g in jax.tree.leaves(grads))


def test_identical_policy_and_reference_give_log_2():
    exp = load_experiment(None, BASE)
    model, objective = _model(exp), exp.config.trainer.objective.instantiate()
    params = model.initialize(jax.random.key(0))
    out = objective.loss(model, params, _batch(), prng_key=None, is_training=False, state=objective.init_state(params))
    np.testing.assert_allclose(float(out.loss), math.log(2), rtol=1e-6)
    assert float(out.metrics["reward_margin"]) == 0.0 and float(out.metrics["pairs"]) == 2.0


def _preferences(path, n=32):
    """Prompts 'pick k'; the chosen reply always 'yes k', the rejected one 'no k': learnable."""
    with open(path, "w") as f:
        for k in range(n):
            f.write(json.dumps({"prompt": f"pick {k}", "chosen": f"yes {k}", "rejected": f"no {k}"}) + "\n")
    return path


def test_the_preference_source_gives_paired_rows_weighting_the_replies(tmp_path):
    path = _preferences(tmp_path / "prefs.jsonl")
    exp = load_experiment(None, [*BASE, f"input.source={{type: preference, paths: ['{path}']}}"])
    batch = next(exp.config.input.make_iterator(Split.TRAIN))
    def text(row, mask):  # Target bytes (the first token is no target); ids >= 256 (EOS) and padding (-1) dropped.
        return bytes(int(t) for t, m in zip(batch["target_labels"][row], mask) if m and 0 <= t < 256).decode()

    for pair in range(2):
        c, r = 2 * pair, 2 * pair + 1
        assert text(c, np.ones(SEQ, bool)) == f"|user|>\npick {pair}<|end|>\n<|assistant|>\nyes {pair}<|end|>\n"
        assert text(r, np.ones(SEQ, bool)) == f"|user|>\npick {pair}<|end|>\n<|assistant|>\nno {pair}<|end|>\n"
        # The replies only: what follows the pair's common prefix ('<|assistant|>\n' is shared).
        assert text(c, batch["target_weights"][c] > 0) == f"yes {pair}<|end|>"
        assert text(r, batch["target_weights"][r] > 0) == f"no {pair}<|end|>"


def test_the_reward_margin_rises_over_30_steps(tmp_path):
    path = _preferences(tmp_path / "prefs.jsonl")
    exp = load_experiment(None, [*BASE, f"input.source={{type: preference, paths: ['{path}']}}",
                                 "trainer.learner.learning_rate=0.003", "trainer.learner.schedule.warmup_steps=0",
                                 "trainer.max_steps=30"])
    step = TrainStep(exp)
    state, train = step.init_state(), step.compiled_train_step()
    batches = exp.config.input.make_iterator(Split.TRAIN)
    history = []
    for _ in range(30):
        state, metrics = train(state, next(batches))
        history.append({k: float(v) for k, v in metrics.items()})
    # Policy = reference at step 0: the margin is 0 up to float32 rounding (their log-probabilities come from
    # different fusions, which round differently on some CPUs: 1.9e-6 seen on an AVX-512 Xeon).
    assert abs(history[0]["reward_margin"]) < 1e-5 and abs(history[0]["loss"] - math.log(2)) < 1e-5
    late = np.mean([h["reward_margin"] for h in history[-5:]])
    assert late > 0.5, [round(h["reward_margin"], 3) for h in history]
    assert history[-1]["reward_accuracy"] == 1.0 and history[-1]["loss"] < 0.5


def test_identical_chosen_and_rejected_is_refused_in_one_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "chosen": "same", "rejected": "same"}) + "\n")
    exp = load_experiment(None, [*BASE, f"input.source={{type: preference, paths: ['{path}']}}"])
    with pytest.raises(PreferenceError, match=r"bad\.jsonl:1: 'chosen' and 'rejected' are identical") as error:
        next(exp.config.input.make_iterator(Split.TRAIN))
    # An AxcoreError (a DataError): `axcore train` prints it as one line `axcore: error: ...`, exit status 2.
    assert "\n" not in str(error.value)


def test_rows_that_would_break_the_pairs_are_refused():
    with pytest.raises(axcore.AxcoreError, match=r"'input\.packing' is 'first_fit'.*set input\.packing: none"):
        load_experiment(None, [*BASE, "input.packing=first_fit"])


def test_dpo_with_lora_uses_the_base_as_reference_without_a_copy():
    exp = load_experiment(None, [*BASE, "plugins=[lora, dpo]", "trainer.objective.reference=lora_b"])
    assert isinstance(exp.config.trainer.objective.instantiate(), DPO)
    step = TrainStep(exp)
    assert "objective" not in step.abstract_state()
    model, objective = step.model, step.objective
    params = jax.device_get(model.initialize(jax.random.key(0)))
    out = objective.loss(model, params, _batch(), prng_key=None, is_training=False)
    np.testing.assert_allclose(float(out.loss), math.log(2), rtol=1e-6)  # B = 0: policy = base = reference.


def _readme_experiment() -> str:
    """The experiment YAML block of this plugin's README."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    [block] = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    return block


def _train(cwd, *overrides):
    args = [a for o in [*TINY_OVERRIDES, f"input.seq_len={SEQ}", f"model.position_embedding.max_len={SEQ}", *overrides]
            for a in ("--set", o)]
    return subprocess.run([sys.executable, "-m", "axcore.cli", "train", "exp.yaml", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_the_readme_example_trains_and_one_that_would_evaluate_is_refused_before_compiling(tmp_path):
    _preferences(tmp_path / "prefs.jsonl")
    (tmp_path / "exp.yaml").write_text(_readme_experiment())
    short = ["trainer.max_steps=2", "trainer.sample.num_tokens=0", "trainer.metrics_writers=[{type: jsonl}]"]
    # Evaluating during training: one line naming the setting and its fix, before anything is compiled or written.
    refused = _train(tmp_path, *short, "trainer.eval_every=1", "trainer.run_dir=refused")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines() == [
        "axcore: error: 'trainer.eval_every' is 1, but the dpo objective's preference source holds out nothing (its "
        "eval_fraction is 0, to keep the pairs), so there is nothing to evaluate on; set trainer.eval_every: 0."
    ]
    assert not (tmp_path / "refused").exists()
    # The README's example as written (a tiny model, two steps) trains to its end.
    done = _train(tmp_path, *short, "trainer.run_dir=run")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoints").is_dir() and not (tmp_path / "run" / "FAILED").exists()
    assert "Finished step 2" in done.stderr
