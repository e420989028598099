"""`axcore train` runs the example `rl` experiment (plugins/rl/examples/rl.yaml): GRPO and online DPO on a tiny model from scratch, rollouts on
the engine from the live train state, metrics per step, checkpoints and a bit-identical resume; bad settings are one
line naming the field.

The task is single-digit addition with answers 0..5 ("2+3=" -> "5") in a 12-token character vocabulary (a
tokenizer this test registers), so an answer is one token, as in test_rl_training.py."""

import io
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import axcore
from axcore.data import Tokenizer
from axcore.experiment import load_experiment
from axcore.observe import read_jsonl_metrics
from axcore.trainer.trainer import Trainer

import axcore_dpo.plugin
import axcore_rl.plugin
from axcore_rl import generate_tasks, write_jsonl

CHARS = "0123456789+="


class Chars(Tokenizer):
    """One token per character of CHARS."""

    class Config(Tokenizer.Config):
        """Configures Chars (no settings)."""

    vocab_size = len(CHARS)

    def encode(self, text):
        return np.asarray([CHARS.index(c) for c in text], np.int32)

    def decode(self, ids):
        return "".join(CHARS[int(i)] for i in ids)


class CharsPlugin:
    @axcore.hookimpl
    def axcore_register_tokenizers(self, register):
        register("chars", Chars)


EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "rl.yaml"
OBJECTS = {"rl": axcore_rl.plugin, "dpo": axcore_dpo.plugin, "chars": CharsPlugin()}
PROMPTS, G = 16, 8


def rl_run(tmp_path, steps, run_dir, *extra, plugins="rl, chars"):
    """The `rl` experiment shrunk to the tiny model and task, `steps` steps into `run_dir`."""
    tasks = tmp_path / "tasks.jsonl"
    if not tasks.exists():
        write_jsonl(str(tasks), generate_tasks("arithmetic", 256, seed=0, max_sum=5))
    return load_experiment(str(EXAMPLE), [
        f"plugins=[{plugins}]", "tokenizer.type=chars", "model.vocab_size=12", "model.dim=32", "model.num_layers=2",
        "model.position_embedding.max_len=16", "model.decoder.layer.self_attention.num_heads=2",
        "model.decoder.layer.feed_forward.hidden_dim=64", f"input.source.paths=[{tasks}]", "input.source.chat=false",
        f"input.batch_size={PROMPTS * G}", "input.seq_len=7", f"rl.group_size={G}", "rl.max_tokens=1",
        "rl.updates_per_rollout=2", "rl.engine.block_size=4", f"rl.engine.batch_buckets=[{PROMPTS * G}]",
        "rl.engine.token_buckets=[1, 8]", "trainer.learner.learning_rate=3e-3", "trainer.learner.max_grad_norm=1e6",
        f"trainer.max_steps={steps}", f"trainer.run_dir={run_dir}", "trainer.log_every=1",
        "trainer.metrics_writers=[{type: jsonl}]", *extra], objects=OBJECTS)


def metrics(run_dir):
    return {r["step"]: r for r in read_jsonl_metrics(run_dir / "metrics.jsonl")}


STEP_KEYS = {"rl/reward_mean", "rl/reward_std", "rl/response_length", "rl/rollout_seconds", "rl/learn_seconds",
             "rl/rollout_tokens_per_s", "rl/learn_tokens_per_s", "train/loss", "train/kl", "train/clip_fraction",
             "train/ratio", "train/max_logprob_gap", "train/step_time"}


def test_axcore_train_runs_grpo_from_the_rl_experiment_and_the_reward_rises(tmp_path):
    run_dir = tmp_path / "run"
    Trainer(rl_run(tmp_path, 80, run_dir, "trainer.checkpoint.every_n_steps=40")).run()
    logged = metrics(run_dir)
    assert sorted(logged) == list(range(1, 81)) and STEP_KEYS <= set(logged[1])
    rewards = [logged[s]["rl/reward_mean"] for s in range(1, 81, 2)]  # One rollout per two updates.
    assert [logged[s + 1]["rl/reward_mean"] for s in range(1, 81, 2)] == rewards  # The second update reuses it.
    assert rewards[0] < 0.2 and np.mean(rewards[-10:]) > 0.7, np.round(rewards, 3)
    # The first update of each rollout recomputes the sampler's log-probabilities: the engine sampled the live state.
    assert max(logged[s]["train/max_logprob_gap"] for s in range(1, 81, 2)) < 1e-5
    assert all(logged[s]["rl/response_length"] == 1.0 for s in logged)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["40", "80"]


def test_a_resumed_rl_run_computes_what_the_run_that_was_not_stopped_did(tmp_path):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    Trainer(rl_run(tmp_path, 6, whole)).run()
    Trainer(rl_run(tmp_path, 2, stopped)).run()  # Stops at a rollout boundary (2 updates per rollout) ...
    log = io.StringIO()
    result = Trainer(rl_run(tmp_path, 6, stopped), stream=log).run()  # ... and resumes from its checkpoint at step 2.
    assert result.step == 6 and f"Resumed from step 2 in {stopped}" in log.getvalue()
    a, b = metrics(whole), metrics(stopped)
    for step in (3, 4, 5, 6):  # Same prompts, same draws, same parameters: the same numbers, bit for bit.
        for key in ("rl/reward_mean", "train/loss", "train/grad_norm", "train/ratio"):
            assert a[step][key] == b[step][key], (step, key)
    trainer = Trainer(rl_run(tmp_path, 6, tmp_path / "unused"))
    states = []
    for run_dir in (whole, stopped):
        store = trainer.step.experiment.registries.checkpoint_backends["orbax"](run_dir / "checkpoints")
        states.append(jax.tree.leaves(store.restore(trainer.step.abstract_state(), step=6)[0]["params"]))
        store.close()
    for x, y in zip(*states):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_an_rl_run_starts_from_another_runs_parameters_with_init_from(tmp_path):
    base, run_dir = tmp_path / "base", tmp_path / "run"
    Trainer(rl_run(tmp_path, 2, base)).run()
    log = io.StringIO()
    Trainer(rl_run(tmp_path, 1, run_dir, f"init_from={base}"), stream=log).run()
    assert f"Initialized from step 2 of {base}" in log.getvalue()
    # The engine sampled the parameters the learner started from (the base run's), not a fresh initialization.
    assert metrics(run_dir)[1]["train/max_logprob_gap"] < 1e-5


def _axcore(*args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # axcore train would echo it on stderr first.
    return subprocess.run([sys.executable, "-m", "axcore.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**env, "JAX_PLATFORMS": "cpu"})


def test_a_group_of_one_completion_is_one_line_naming_the_field(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    write_jsonl(str(tasks), generate_tasks("arithmetic", 4, seed=0))
    done = _axcore("train", str(EXAMPLE), "--set", f"input.source.paths=[{tasks}]", "--set", "rl.group_size=1",
                   "--set", f"trainer.run_dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "'rl.group_size' is 1; sample at least 2" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("rl.rewards=[{type: adamw}]", r"Config 'rl.rewards\[0\]' builds .*which is not a reward"),
    ("rl.rewards=[]", r"'rl.rewards' is empty"),
    ("input.shuffle=true", r"'input.shuffle' is True, but an rl run reads each prompt's rows together"),
    ("input.batch_size=12", r"'input.batch_size' \(12\) is not a multiple of rl.group_size \(8\)"),
    ("trainer.objective.temperature=0.5", r"'trainer.objective.temperature' \(0.5\) differs from rl.temperature"),
    ("rl.algorithm=online_dpo", r"'trainer.objective' is not dpo; .*list dpo in plugins"),
])
def test_bad_rl_settings_are_refused_naming_the_field(tmp_path, override, message):
    with pytest.raises(axcore.AxcoreError, match=message):
        rl_run(tmp_path, 2, tmp_path / "run", override)


def test_a_missing_prompt_file_is_refused_naming_the_path(tmp_path):
    exp = rl_run(tmp_path, 2, tmp_path / "run", f"input.source.paths=[{tmp_path / 'none.jsonl'}]")
    with pytest.raises(axcore.AxcoreError, match=r"input.source.paths\[0\]"):
        Trainer(exp).run()
    assert not (tmp_path / "run").exists()


def test_the_prompts_source_repeats_each_prompt_group_size_times_and_finds_its_sample(tmp_path):
    exp = rl_run(tmp_path, 2, tmp_path / "run")
    assert exp.config.input.source.repeat == G  # Set from rl.group_size by the plugin's transform.
    source = exp.config.input.source.instantiate()
    source.use_tokenizer(Chars(), "input.source")
    samples = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert source.num_documents() == len(samples) * G
    docs = [source.document(i) for i in range(3 * G)]
    for group in range(3):
        tokens = {tuple(d["tokens"].tolist()) for d in docs[group * G:(group + 1) * G]}
        assert len(tokens) == 1 and not any(d["loss_mask"].any() for d in docs)
        sample = source.sample(tokens.pop())
        assert Chars().decode(docs[group * G]["tokens"]) == sample["prompt"]
        assert int(sample["answer"]) == sum(int(x) for x in sample["prompt"][:-1].split("+"))


def test_online_dpo_learns_from_best_and_worst_completions_and_the_reward_rises(tmp_path):
    run_dir = tmp_path / "run"
    exp = rl_run(tmp_path, 40, run_dir, "rl.algorithm=online_dpo", "rl.updates_per_rollout=1",
                 "trainer.objective={type: dpo, beta: 0.1, precomputed_reference: true}", plugins="rl, dpo, chars")
    assert exp.config.trainer.objective.precomputed_reference
    Trainer(exp).run()
    logged = metrics(run_dir)
    rewards = [logged[s]["rl/reward_mean"] for s in range(1, 41)]
    assert abs(logged[1]["train/loss"] - np.log(2)) < 1e-6  # Step 1: policy = reference, every pair's margin 0.
    assert all(0 < logged[s]["rl/pairs"] <= PROMPTS for s in logged) and "train/reward_margin" in logged[1]
    assert rewards[0] < 0.2 and np.mean(rewards[-10:]) > 0.5, np.round(rewards, 3)


def test_the_example_and_the_experiment_files_of_docs_rl_md_resolve(tmp_path, monkeypatch):
    doc = (pathlib.Path(__file__).parents[3] / "docs" / "rl.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    write_jsonl(str(tmp_path / "tasks.jsonl"), generate_tasks("arithmetic", 4, seed=0))
    grpo, dpo = (tmp_path / "grpo.yaml"), (tmp_path / "dpo.yaml")
    grpo.write_text(blocks[0])
    dpo.write_text(blocks[1] + "input: {source: {type: prompts, paths: [tasks.jsonl]}, batch_size: 8, packing: none, "
                               "shuffle: false, long_documents: error}\n")
    monkeypatch.chdir(tmp_path)
    exp = load_experiment(str(grpo), [])
    assert exp.settings["rl"].rewards[1].pattern == r".*\d+" and exp.config.input.source.repeat == 8
    exp = load_experiment(str(dpo), ["trainer.eval_every=0"])  # The rest of the first file, as the doc says.
    assert exp.settings["rl"].algorithm.value == "online_dpo" and exp.config.trainer.objective.precomputed_reference
    exp = load_experiment(str(EXAMPLE), [])  # The example file as it ships.
    assert exp.config.input.batch_size == 64 and exp.config.input.source.repeat == exp.settings["rl"].group_size == 8
