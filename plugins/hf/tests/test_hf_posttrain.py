"""The post-training path of docs/sft.md end to end: import, LoRA SFT, merge, export, with transformers and peft as
the oracle.

The base is a tiny random Llama built by transformers (vocab 320, hidden 32, 2 layers) whose config carries what the
math does not decide (`max_position_embeddings` 8192, bos/eos/pad ids), saved with its tokenizer by
`save_pretrained`, which writes the ChatML template to `chat_template.jinja` (not into tokenizer_config.json). Then:
`axcore convert hf-to-axcore`, `axcore lora init`, `axcore train sft --set init_from=...` (a few steps), `axcore
lora merge`, `axcore convert axcore-to-hf`. transformers loads the export with the original config values and
tokenizer (template included), and its logits equal those of the original transformers model with the run's
adapters (`axcore lora export-peft`) loaded by peft, within 1e-4.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("axcore_tokenizers")

from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from axcore.cli import main  # noqa: E402
from axcore.data.chat import ChatTemplate  # noqa: E402
from axcore.experiment import load_experiment  # noqa: E402

from axcore_hf import hf_to_axcore, testing as checks  # noqa: E402

TOLERANCE = 1e-4
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# What an export must give back as the import had it (none of it follows from the parameters).
KEPT = {"max_position_embeddings": 8192, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 4}
WORDS = "apple river stone cloud music garden window paper silver orange".split()
SFT = ["trainer.max_steps=4", "trainer.eval_every=4", "trainer.eval_batches=1", "trainer.log_every=1",
       "trainer.learner.learning_rate=5e-2", "input.batch_size=2", "input.seq_len=48", "input.shuffle_window=4",
       "trainer.metrics_writers=[{type: jsonl}]", "trainer.checkpoint.async_save=false", "trainer.check_memory=false"]


def _axcore(*args):
    """`axcore ARGS` in a subprocess: (exit status, stdout, stderr lines)."""
    done = subprocess.run([sys.executable, "-m", "axcore.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return done.returncode, done.stdout, done.stderr.strip().splitlines()


def _chats(k):
    a, b = WORDS[k % 10], WORDS[(k // 10) % 10]
    return {"messages": [{"role": "user", "content": f"Tell me about {a}."}, {"role": "assistant", "content": b}]}


def _hf_model():
    """The tiny Llama with the random weights of every family check (axcore_hf.testing.build)."""
    return checks.build(transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, rope_theta=5e5, **KEPT))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(root, HF directory, base run, chats file): the tiny model saved by transformers and imported."""
    root = tmp_path_factory.mktemp("posttrain")
    hf = root / "hf"
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for k in range(100) for m in _chats(k)["messages"]] * 3, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1],
                                                pad_token=SPECIALS[4])
    fast.chat_template = CHATML
    _hf_model().save_pretrained(hf)
    fast.save_pretrained(hf)
    assert (hf / "chat_template.jinja").is_file()  # Where current transformers keeps it...
    assert "chat_template" not in json.loads((hf / "tokenizer_config.json").read_text())  # ...and only there.
    hf_to_axcore(hf, root / "base")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(_chats(k)) + "\n" for k in range(40)))
    return root, hf, root / "base", chats


def test_the_import_carries_the_chat_template_and_sft_renders_with_it(imported):
    _, hf, base, chats = imported
    assert (base / "hf" / "chat_template.jinja").read_text() == CHATML
    experiment = load_experiment("sft", [f"init_from={base}", f"input.source.paths=[{chats}]"])
    tokenizer = experiment.config.tokenizer.instantiate()
    template = ChatTemplate.for_tokenizer(tokenizer, experiment.config.input.source.template)
    assert template.source == CHATML
    reference = transformers.AutoTokenizer.from_pretrained(str(hf))
    messages = _chats(3)["messages"]
    assert template.render(messages) == reference.apply_chat_template(messages, tokenize=False)


def test_generate_chat_on_the_import_uses_its_template(imported, capsys):
    _, hf, base, _ = imported
    assert main(["generate", str(base), "--chat", "Hi", "--max-new-tokens", "2", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    reference = transformers.AutoTokenizer.from_pretrained(str(hf))
    messages = [{"role": "user", "content": "Hi"}]
    assert record["prompt"] == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_a_template_other_than_the_tokenizers_is_warned_about(imported, tmp_path, capsys):
    from axcore.data.chat import DEFAULT_TEMPLATE

    _, hf, base, chats = imported
    common = [f"init_from={base}", f"input.source.paths=[{chats}]"]

    def warnings(*overrides):
        experiment = load_experiment("sft", [*common, *overrides])
        experiment.config.input.check(experiment.config.tokenizer.instantiate())
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("Warning:")]

    assert warnings() == []  # The tokenizer's own template: nothing to say.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((hf / "tokenizer.json").read_bytes())  # The tokenizer without a template.
    (line,) = warnings(f"tokenizer.path={bare / 'tokenizer.json'}")
    assert "input.source.template: the tokenizer (HFTokenizer) has no chat template" in line
    assert "axcore's built-in default" in line
    other = tmp_path / "other.jinja"
    other.write_text(DEFAULT_TEMPLATE)
    (line,) = warnings(f"input.source.template={other}")
    assert f"rendered with '{other}', not the chat template of the tokenizer" in line
    assert (base / "hf" / "chat_template.jinja").read_text() == CHATML  # Untouched.


def test_generate_chat_without_a_template_is_refused_before_loading(tmp_path):
    """A run whose tokenizer (bytes) has no template and that did not train on chat data: refused from its saved
    config alone (this run has no checkpoints/, so a refusal after the restore would name that instead)."""
    from axcore.testing import TINY_OVERRIDES

    load_experiment("default", TINY_OVERRIDES).save(tmp_path / "run")
    status, _, err = _axcore("generate", tmp_path / "run", "--chat", "Hi")
    assert status == 2 and len(err) == 1 and "has no chat template" in err[0], err


def test_lora_sft_merged_and_exported_equals_the_peft_adapted_original(imported):
    """docs/sft.md's LoRA SFT, merged and exported: transformers loads the original config values and tokenizer,
    and gives the logits of peft's model (the original plus the run's exported adapters) within 1e-4."""
    root, hf, base, chats = imported
    lora, sft, merged, exported, adapter = (root / n for n in ("lora", "sft", "merged", "exported", "adapter"))
    assert main(["lora", "init", str(base), str(lora), "--rank", "4", "--alpha", "8"]) == 0
    words = [f"init_from={lora}", f"input.source.paths=[{chats}]", f"trainer.run_dir={sft}", *SFT]
    assert main(["train", "sft", *[a for w in words for a in ("--set", w)]]) == 0
    assert "init_from" in (sft / "config.yaml").read_text()  # The case that broke merge: the saved config keeps it.
    assert main(["lora", "merge", str(sft), str(merged)]) == 0
    assert main(["convert", "axcore-to-hf", str(merged), str(exported)]) == 0
    assert main(["lora", "export-peft", str(sft), str(adapter)]) == 0

    config = json.loads((exported / "config.json").read_text())
    source = json.loads((hf / "config.json").read_text())
    assert config == {k: v for k, v in source.items() if k != "transformers_version"}  # Every value, KEPT's too.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported).float().eval()
    assert {k: getattr(loaded.config, k) for k in KEPT} == KEPT
    original, mine = (transformers.AutoTokenizer.from_pretrained(str(d)) for d in (hf, exported))
    assert mine.chat_template == original.chat_template == CHATML
    assert (mine.bos_token, mine.eos_token, mine.pad_token) == (original.bos_token, original.eos_token, SPECIALS[4])
    text = mine.apply_chat_template(_chats(7)["messages"], tokenize=False)
    assert mine(text)["input_ids"] == original(text)["input_ids"]

    ids = torch.tensor(np.random.default_rng(0).integers(0, 320, size=(2, 12)))
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(_hf_model(), adapter).eval()
        expected, before = adapted(ids).logits.numpy(), _hf_model()(ids).logits.numpy()
        got = loaded(ids).logits.numpy()
    assert np.abs(expected - before).max() > 1e-3  # Training moved the adapters: the test can tell.
    assert np.abs(got - expected).max() < TOLERANCE


def test_exporting_a_lora_run_is_refused_in_one_line(imported, tmp_path):
    _, _, base, _ = imported
    assert main(["lora", "init", str(base), str(tmp_path / "lora"), "--rank", "2"]) == 0
    status, out, err = _axcore("convert", "axcore-to-hf", tmp_path / "lora", tmp_path / "out")
    assert status == 2 and len(err) == 1, err
    assert "trains LoRA adapters" in err[0] and "axcore lora merge" in err[0] and "bare base model" in err[0]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_non_finite_weights_are_refused_naming_the_tensor(imported, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, hf, _, _ = imported
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in hf.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(hf / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, :2] = [np.nan, np.inf]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    status, _, err = _axcore("convert", "hf-to-axcore", broken, tmp_path / "run")
    assert status == 2 and len(err) == 1, err
    assert "tensor 'model.layers.1.mlp.up_proj.weight' holds 1 NaN and 1 infinite" in err[0]
    assert "--allow-nonfinite" in err[0] and not (tmp_path / "run").exists()
    hf_to_axcore(broken, tmp_path / "allowed", allow_nonfinite=True)  # Asked for: imported as it is.
    assert (tmp_path / "allowed" / "checkpoints").is_dir()


def test_merging_an_adapter_only_run_gives_a_plain_run_with_the_imports_metadata(imported, tmp_path):
    """`lora init --adapters-only` (the checkpoint backend wrapped by lora_adapters): the merged run uses the plain
    backend again, holds the base's weights (B = 0: w + a @ 0 = w exactly) and exports the original config.json."""
    from axcore.inference.run_loading import load_model

    _, hf, base, _ = imported
    lora, merged = tmp_path / "lora", tmp_path / "merged"
    assert main(["lora", "init", str(base), str(lora), "--rank", "2", "--adapters-only"]) == 0
    assert main(["lora", "merge", str(lora), str(merged)]) == 0
    plain = load_model(merged)
    assert plain.experiment.config.trainer.checkpoint.backend == "orbax" and "lora" not in plain.experiment.settings
    reference = load_model(base).params
    for a, b in zip(*(jax.tree.leaves(p) for p in (plain.params, reference)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (merged / "hf" / "chat_template.jinja").read_text() == CHATML


def test_the_kept_metadata_is_found_through_init_from(tmp_path, monkeypatch):
    """A run trained with `init_from` (which copies nothing) leads back to the import's hf/: by an absolute path,
    a path relative to where training ran, or to the run's parent; a run made from nothing has none."""
    import yaml

    from axcore_hf.kept import kept_dir

    (tmp_path / "base" / "hf").mkdir(parents=True)
    (tmp_path / "base" / "hf" / "config.json").write_text("{}")
    for run, data in [("sft", {"init_from": str(tmp_path / "base")}), ("again", {"init_from": "sft"}),
                      ("lonely", {"name": "x"}), ("loop", {"init_from": "loop"})]:
        (tmp_path / run).mkdir()
        (tmp_path / run / "config.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path.parent)  # "sft" is relative to the run's parent only.
    assert kept_dir(tmp_path / "again") == kept_dir(tmp_path / "sft") == (tmp_path / "base" / "hf").resolve()
    assert kept_dir(tmp_path / "lonely") is None and kept_dir(tmp_path / "loop") is None
