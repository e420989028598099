"""The GRPO recipe over a JSONL prompt file: chat-templated prompts, metrics per step, a trainable subset."""

import json

import jax
import numpy as np
import pytest

from axcore.data import ByteTokenizer
from axcore.data.chat import DEFAULT_TEMPLATE
from axcore.engine import EngineConfig
from axcore.testing import load_tiny_experiment

import axcore_rl.plugin
from axcore_rl import LoopSettings, Reward, generate_tasks, write_jsonl
from axcore_rl.recipe import PromptFileError, load_prompts, prompt_encoder, train_grpo

METRICS = {"reward_mean", "reward_std", "loss", "kl", "clip_fraction", "ratio", "response_length",
           "logprob_mismatch", "rollout_seconds", "learn_seconds", "rollout_tokens_per_s", "learn_tokens_per_s"}


class Parity(Reward):
    """1 if the completion's first byte is odd: random completions score differently, so the advantages are not 0."""

    def __call__(self, completion, sample):
        return float(len(completion.encode()) > 0 and completion.encode()[0] % 2)


def test_two_steps_on_a_prompt_file_write_metrics_and_train_only_the_trainable_leaves(tmp_path):
    write_jsonl(str(tmp_path / "tasks.jsonl"), generate_tasks("arithmetic", 8, seed=1))
    samples = load_prompts(str(tmp_path / "tasks.jsonl"))
    exp = load_tiny_experiment(["rl"], ["model.position_embedding.max_len=64"], objects={"rl": axcore_rl.plugin})
    model = exp.config.model.clone(vocab_size=128).instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    tokenizer = ByteTokenizer()
    prompt = prompt_encoder(tokenizer, chat=True)(samples[0]["prompt"])
    assert bytes(prompt).decode() == f"<|user|>\n{samples[0]['prompt']}<|end|>\n<|assistant|>\n"
    assert "<|assistant|>" in DEFAULT_TEMPLATE
    reward = exp.registries.rewards["exact_match"].default_config().instantiate()
    final, history = train_grpo(
        model, params, tokenizer, samples, [reward, Parity.default_config().instantiate()], steps=2, learning_rate=1e-2,
        trainable="lm_head", settings=LoopSettings(prompts_per_step=2, group_size=2, max_tokens=3, seq_len=48),
        engine_config=EngineConfig(block_size=8, num_blocks=16, max_seqs=4, max_tokens_per_step=48,
                                   max_model_len=48, batch_buckets=(4,), token_buckets=(1, 48)),
        metrics_path=str(tmp_path / "metrics.jsonl"))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and METRICS <= set(lines[0])
    assert lines[1]["loss"] == history[1]["loss"] and lines[0]["response_length"] == 3.0
    before, after = (dict((jax.tree_util.keystr(k), np.asarray(v)) for k, v in jax.tree_util.tree_leaves_with_path(t))
                     for t in (params, final))
    changed = {name for name in before if not np.array_equal(before[name], after[name])}
    assert changed == {"['lm_head']['weight']"}, changed  # Only the trainable leaf moved (and it did).


def test_the_update_compiles_once_over_three_steps():
    # Parameters placed as a restored run's are (P(None, None) per leaf) came back from the update as the
    # equivalent P(), fresh optimizer state uncommitted as committed: the second step compiled the update again
    # (90 s on the 135M benchmark).
    compiled = []

    def listen(event, seconds, **meta):
        if event == "/jax/core/compile/backend_compile_duration" and "_update_fn" in str(meta.get("fun_name")):
            compiled.append(seconds)

    exp = load_tiny_experiment(["rl"], ["model.position_embedding.max_len=64"], objects={"rl": axcore_rl.plugin})
    model = exp.config.model.clone(vocab_size=128).instantiate(name="model", registries=exp.registries)
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    restored = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(*[None] * x.ndim))), model.initialize(jax.random.key(0)))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        train_grpo(model, restored, ByteTokenizer(), generate_tasks("arithmetic", 8, seed=1),
                   [Parity.default_config().instantiate()], steps=3, learning_rate=1e-2,
                   settings=LoopSettings(prompts_per_step=2, group_size=2, max_tokens=3, seq_len=48),
                   engine_config=EngineConfig(block_size=8, num_blocks=16, max_seqs=4, max_tokens_per_step=48,
                                              max_model_len=48, batch_buckets=(4,), token_buckets=(1, 48)))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(compiled) == 1, compiled


def test_a_bad_prompt_line_is_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(PromptFileError, match=r"bad\.jsonl:2: needs string fields 'prompt' and 'answer'"):
        load_prompts(str(path))
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    assert load_prompts(str(path), prompt_field="question") == [{"question": "1+1=", "prompt": "1+1=", "answer": "2"}]
