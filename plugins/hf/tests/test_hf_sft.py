"""Supervised fine-tuning (the built-in `sft` experiment) and `axcore generate --chat` on a tiny import.

The base is a tiny random Llama (vocab 320, hidden 32, 2 layers) built by transformers,
with a byte-level BPE tokenizer trained here whose `tokenizer_config.json` carries a
ChatML template (end of turn `<|im_end|>`, distinct from the EOS `<|end_of_text|>`),
imported with `axcore convert hf-to-axcore`. The chat data is generated here: every
reply is "Sure thing.", so a few dozen steps learn it.

Independent references: transformers' `apply_chat_template` renders the text; the
expected ids and weights come from tokenizing the conversation written out by hand as
(text, weighted) segments with the `tokenizers` library, one segment at a time (segment
boundaries are pre-token boundaries, so the ids equal tokenizing the whole text; checked).
"""

import json

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("axcore_tokenizers")

from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from axcore.cli import main  # noqa: E402
from axcore.data import Split  # noqa: E402
from axcore.errors import ConfigError  # noqa: E402
from axcore.experiment import load_experiment  # noqa: E402
from axcore.inference.run_loading import save_model  # noqa: E402

from axcore_hf import hf_to_axcore  # noqa: E402

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
REPLY = "Sure thing."
WORDS = "apple river stone cloud music garden window paper silver orange".split()
MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Where is the apple?"},
    {"role": "assistant", "content": "In the garden."},
    {"role": "user", "content": "And the stone?"},
]
TRAIN = ["trainer.max_steps=30", "trainer.eval_every=30", "trainer.eval_batches=2", "trainer.log_every=1",
         "trainer.learner.learning_rate=2e-2", "trainer.learner.schedule.warmup_fraction=0.07", "input.batch_size=4",
         "input.seq_len=96", "input.shuffle_window=8", "trainer.metrics_writers=[{type: jsonl}]",
         "trainer.checkpoint.async_save=false", "trainer.check_memory=false"]


def _conversation(k):
    a, b = WORDS[k % 10], WORDS[(k // 10) % 10]
    messages = [{"role": "user", "content": f"Tell me about {a} and {b}."}, {"role": "assistant", "content": REPLY}]
    if k % 3 == 0:
        messages = [{"role": "system", "content": f"Talk of {b}."}, *messages,
                    {"role": "user", "content": f"More {a}?"}, {"role": "assistant", "content": REPLY}]
    return messages


def _segments(messages):
    """The ChatML text of `messages` as (text, weighted) pieces, written out by hand."""
    out = []
    for m in messages:
        weighted = m["role"] == "assistant"
        out += [(f"<|im_start|>{m['role']}\n", False), (m["content"] + "<|im_end|>", weighted), ("\n", False)]
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base run, transformers model, chat file, library tokenizer, transformers tokenizer)."""
    root = tmp_path_factory.mktemp("sft")
    hf = root / "hf"
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for k in range(100) for m in _conversation(k)] + ["system user assistant"] * 20
    tok.train_from_iterator(corpus * 3, trainer)
    hf.mkdir()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": CHATML}))
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128,
                                      rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(hf)
    hf_to_axcore(hf, root / "base")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": _conversation(k)}) + "\n" for k in range(100)))
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf), local_files_only=True)
    return root / "base", model, chats, tokenizers.Tokenizer.from_file(str(hf / "tokenizer.json")), reference


def _overrides(setup, *more):
    base, _, chats, _, _ = setup
    words = [f"init_from={base}", f"input.source.paths=[{chats}]", *TRAIN, *more]
    return [a for o in words for a in ("--set", o)]


def test_sft_batches_weight_exactly_the_assistant_tokens(setup):
    base, _, chats, library, reference = setup
    exp = load_experiment("sft", [f"init_from={base}", f"input.source.paths=[{chats}]", *TRAIN])
    assert exp.config.tokenizer.path == str(base / "hf" / "tokenizer.json")  # The base's tokenizer...
    assert exp.config.input.source.paths == [str(chats)] and exp.config.input.source.train_on.value == "assistant"
    # ...its plugins and model, under the recipe's settings; never its run directory.
    assert "rope" in exp.config.plugins and exp.config.trainer.learner.learning_rate == 2e-2
    assert exp.config.model.vocab_size == 320 and exp.config.name == "sft" and exp.config.trainer.run_dir is None
    with pytest.raises(ConfigError, match=r"init_from '.*nowhere' is not a run directory"):
        load_experiment("sft", [f"init_from={base.parent / 'nowhere'}"])
    # Each conversation's expected (ids, weights), from the hand-written segments and transformers' text.
    expected = {}
    for k in range(100):
        messages = _conversation(k)
        segments = _segments(messages)
        text = "".join(t for t, _ in segments)
        assert reference.apply_chat_template(messages, tokenize=False) == text
        ids, weights = [], []
        for piece, weighted in segments:
            piece_ids = library.encode(piece, add_special_tokens=False).ids
            ids += piece_ids
            weights += [weighted] * len(piece_ids)
        assert library.encode(text, add_special_tokens=False).ids == ids
        expected[tuple(ids[1:])] = np.asarray(weights[1:], np.float32)  # Targets: token i predicted from i - 1.
    tokenizer = exp.config.tokenizer.instantiate()
    pipeline = exp.config.input.make_pipeline(Split.TRAIN, tokenizer)
    seen = 0
    for _ in range(6):
        batch = next(pipeline)
        for row in range(batch["input_ids"].shape[0]):
            segments = batch["segment_ids"][row]
            for s in set(segments.tolist()) - {0}:
                at = segments == s
                targets = tuple(batch["target_labels"][row][at].tolist())
                weights = batch["target_weights"][row][at]
                assert targets in expected, "a packed segment is not a whole conversation"
                np.testing.assert_array_equal(weights, expected[targets])
                seen += 1
    assert seen >= 20


def test_sft_from_an_import_lowers_the_loss_and_chat_generation_stops_at_end_of_turn(setup, tmp_path, capsys):
    base, model, chats, library, _ = setup
    run = tmp_path / "run"
    assert main(["train", "sft", *_overrides(setup, f"trainer.run_dir={run}")]) == 0
    err = capsys.readouterr().err
    assert f"Initialized from step 0 of {base}" in err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3]), losses
    assert any("eval/loss" in r for r in records)  # Held-out evaluation ran.
    # Step 1 (learning rate 0 at step 0) computed the loss of the import's parameters: transformers' weighted
    # cross-entropy of the same first batch, conversation by conversation, over the assistant targets only.
    exp = load_experiment("sft", [f"init_from={base}", f"input.source.paths=[{chats}]", *TRAIN])
    batch = next(exp.config.input.make_pipeline(Split.TRAIN, exp.config.tokenizer.instantiate()))
    total = weight = 0.0
    for row in range(batch["input_ids"].shape[0]):
        for s in set(batch["segment_ids"][row].tolist()) - {0}:
            at = batch["segment_ids"][row] == s
            ids = torch.tensor([[*batch["input_ids"][row][at].tolist(), int(batch["target_labels"][row][at][-1])]])
            with torch.no_grad():
                logits = model(ids).logits[0, :-1].double()
            nll = -torch.log_softmax(logits, -1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]].numpy()
            total += float((nll * batch["target_weights"][row][at]).sum())
            weight += float(batch["target_weights"][row][at].sum())
    assert records[0]["train/learning_rate"] == 0 and records[0]["train/num_tokens"] == weight
    assert abs(records[0]["train/cross_entropy"] - total / weight) < 1e-4
    # The fine-tuned model replies with the trained reply and stops at <|im_end|> (not at EOS, not at the limit).
    assert main(["generate", str(run), "--chat", "Tell me about paper and music.", "--max-new-tokens", "12",
                 "--json"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["reply"] == REPLY and record["ended"]
    assert record["tokens"][-1] == library.token_to_id("<|im_end|>") and len(record["tokens"]) < 12


def test_generate_chat_renders_transformers_apply_chat_template(setup, tmp_path, capsys):
    base, _, _, _, reference = setup
    conversations = tmp_path / "multi.jsonl"
    conversations.write_text(json.dumps({"messages": MULTI_TURN}) + "\n")
    assert main(["generate", str(base), "--chat", "Hi", "--system", "Be brief.", "--chat-file", str(conversations),
                 "--max-new-tokens", "2", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    single = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for record, messages in zip(records, [single, MULTI_TURN], strict=True):
        expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert record["prompt"] == expected and expected.endswith("<|im_start|>assistant\n")
        assert record["messages"] == messages


def test_chat_refusals_are_one_line_exit_2(setup, tmp_path, capsys):
    # A record without an assistant turn: named by file and line (the chat source and prepare render alike).
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": _conversation(1)}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "Anyone?"}]}) + "\n")
    assert main(["prepare", str(bad), "-o", str(tmp_path / "prepared"), "--format", "chat"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("prepare: ")]  # Its plan.
    assert len(err) == 1 and "bad.jsonl' line 2" in err[0] and "no assistant message" in err[0], err
    # A run whose tokenizer (bytes) has no chat template and that did not train on chat data.
    from axcore.testing import TINY_OVERRIDES

    run = tmp_path / "bytes"
    exp = load_experiment("default", TINY_OVERRIDES)
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    save_model(exp, jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), model.abstract_parameters()), run)
    assert main(["generate", str(run), "--chat", "Hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no chat template" in err[0], err


def test_generate_chat_uses_the_template_the_run_trained_with(tmp_path):
    """A run trained on chat data chats with its chat source's template (here the built-in default, the bytes
    tokenizer having none; a `template` file when the source names one), whatever its tokenizer."""
    import argparse

    from axcore.cli.generate import GenerateError, chat_template
    from axcore.data import ByteTokenizer
    from axcore.data.chat import DEFAULT_TEMPLATE

    args = argparse.Namespace(chat_template=None, run="RUN")
    assert chat_template(args, load_experiment("sft"), ByteTokenizer()).source == DEFAULT_TEMPLATE
    custom = tmp_path / "t.jinja"
    custom.write_text("{{ messages[0]['content'] }}")
    chat_run = load_experiment("sft", [f"input.source.template={custom}"])
    assert chat_template(args, chat_run, ByteTokenizer()).source == custom.read_text()
    with pytest.raises(GenerateError, match="has no chat template"):
        chat_template(args, load_experiment("default"), ByteTokenizer())
