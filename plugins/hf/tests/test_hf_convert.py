"""The hf plugin: Hugging Face Llama-family checkpoints <-> axcore run directories.

Models are tiny (vocab 260, hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate
96, sequences of 12) with random weights drawn here, built and saved by transformers
(eager attention). Logit parity: max |axcore - transformers| over the logits, float32,
tolerance 1e-4. Round trips compare every tensor bit for bit.
"""

import json
import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import axcore  # noqa: E402
from axcore.checkpoint.interop import ConversionError  # noqa: E402
from axcore.cli import main  # noqa: E402
from axcore.errors import DuplicateComponentError, PluginLoadError  # noqa: E402
from axcore.inference.run_loading import load_model, save_model  # noqa: E402

from axcore_hf import LlamaConverter, axcore_to_hf, hf_to_axcore  # noqa: E402
from axcore_rope import RotarySettings, rotary_frequencies  # noqa: E402

TOLERANCE = 1e-4
SEQ = 12
TINY = dict(
    vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-5,
)
LLAMA3 = dict(
    TINY, rope_theta=500000.0,
    # Wavelengths above 16 / 1 positions are divided by 8, those between 16/4 and 16 interpolated: at
    # head_dim 16 and theta 5e5 most of the 8 frequencies change (checked below).
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16},
)
IDS = np.random.default_rng(0).integers(0, TINY["vocab_size"], size=(2, SEQ))


def _save_hf(path, config, dtype=torch.float32, max_shard_size=None):
    """A transformers model of `config` with random weights (std 0.15; norms 1 +- 0.1), saved to `path`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.15)
    model = model.to(dtype).eval()
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def _hf_logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _axcore_logits(run, step=None, ids=IDS, params=None):
    loaded = load_model(run, step=step)
    params = loaded.params if params is None else params
    return np.asarray(axcore.functional(loaded.model, params, (ids,), None, False, method="logits")[0])


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """(HF model, HF dir, imported run dir) of the Llama-3 config with llama3 rope scaling and GQA."""
    root = tmp_path_factory.mktemp("llama3")
    model = _save_hf(root / "hf", transformers.LlamaConfig(**LLAMA3))
    hf_to_axcore(root / "hf", root / "run")
    return model, root / "hf", root / "run"


# -- 1. Logit parity with transformers ---------------------------------------------------


def test_llama3_rope_scaling_and_gqa_logits_match_transformers(llama3):
    model, _, run = llama3
    settings = RotarySettings().set(theta=500000.0, scaling="llama3", scaling_factor=8.0, original_max_len=16)
    scaled, plain = rotary_frequencies(settings, 16), rotary_frequencies(RotarySettings().set(theta=500000.0), 16)
    assert (scaled != plain).sum() >= 4  # The scaling really changes frequencies here.
    diff = np.abs(_axcore_logits(run) - _hf_logits(model)).max()
    assert diff < TOLERANCE, diff  # Measured 4.8e-6 (logits up to 4.5).
    text = (run / "experiment.yaml").read_text()
    assert "plugins:\n- rope\n- swiglu" in text and "scaling: llama3" in text and "num_kv_heads: 2" in text


def test_scanned_import_computes_the_same_logits(llama3, tmp_path):
    model, hf_dir, _ = llama3
    hf_to_axcore(hf_dir, tmp_path / "scan", scan=True)
    loaded = load_model(tmp_path / "scan")
    assert loaded.experiment.config.model.decoder.klass.__name__ == "RepeatedTransformer"
    assert loaded.params["decoder"]["layer"]["self_attention"]["wq"].shape == (2, 64, 4, 16)
    assert np.abs(_axcore_logits(tmp_path / "scan") - _hf_logits(model)).max() < TOLERANCE


def test_yarn_rope_scaling_logits_match_transformers_both_ways(tmp_path):
    # factor 4 over an original context of 8 (< SEQ): the ramp scales the low frequencies and the
    # attention factor 0.1 ln 4 + 1 multiplies q and k.
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 8.0}
    model = _save_hf(tmp_path / "hf", transformers.LlamaConfig(**TINY, rope_scaling=scaling))
    hf_to_axcore(tmp_path / "hf", tmp_path / "run")
    rope = load_model(tmp_path / "run").experiment.settings["rope"]
    assert (rope.scaling.value, rope.scaling_factor, rope.original_max_len, rope.beta_fast) == ("yarn", 4.0, 8, 8.0)
    ours = _axcore_logits(tmp_path / "run")
    assert np.abs(ours - _hf_logits(model)).max() < TOLERANCE
    axcore_to_hf(tmp_path / "run", tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert np.abs(ours - _hf_logits(exported)).max() < TOLERANCE


def test_tied_embedding_llama_logits_match_transformers(tmp_path):
    model = _save_hf(tmp_path / "hf", transformers.LlamaConfig(**TINY, tie_word_embeddings=True))
    hf_to_axcore(tmp_path / "hf", tmp_path / "run")
    loaded = load_model(tmp_path / "run")
    assert loaded.experiment.config.model.lm_head is None and "lm_head" not in loaded.params
    diff = np.abs(_axcore_logits(tmp_path / "run") - _hf_logits(model)).max()
    assert diff < TOLERANCE, diff
    axcore_to_hf(tmp_path / "run", tmp_path / "out")  # No lm_head tensor; config.json says tied.
    assert "lm_head.weight" not in _tensors(tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert exported.config.tie_word_embeddings and np.abs(_hf_logits(exported) - _hf_logits(model)).max() < TOLERANCE


def test_mistral_sliding_window_logits_match_transformers(tmp_path):
    config = transformers.MistralConfig(**TINY, sliding_window=4, head_dim=16)
    model = _save_hf(tmp_path / "hf", config)
    hf_to_axcore(tmp_path / "hf", tmp_path / "run")
    loaded = load_model(tmp_path / "run")
    assert loaded.experiment.config.model.decoder.layer.self_attention.sliding_window == 4
    ours = _axcore_logits(tmp_path / "run")
    diff = np.abs(ours - _hf_logits(model)).max()
    assert diff < TOLERANCE, diff
    # The window matters at this length: without it transformers computes other logits. Equal logits
    # with it mean transformers' mask is axcore's `i - j < window`.
    model.config.sliding_window = None
    assert np.abs(ours - _hf_logits(model)).max() > 1e-2
    axcore_to_hf(tmp_path / "run", tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["model_type"] == "mistral" and exported["sliding_window"] == 4


# -- 2. Exports read back by transformers ------------------------------------------------


def test_perturbed_export_loads_in_transformers_with_the_same_logits(llama3, tmp_path):
    _, _, run = llama3
    loaded = load_model(run)
    scaled = jax.tree.map(lambda p: np.asarray(p) * 1.1, loaded.params)
    save_model(loaded.experiment, scaled, tmp_path / "scaled")
    (tmp_path / "scaled" / "hf").symlink_to(run / "hf")  # The import's record: model type and config fields.
    axcore_to_hf(tmp_path / "scaled", tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ours = _axcore_logits(tmp_path / "scaled")
    assert np.abs(ours - _axcore_logits(run)).max() > 1e-2  # The perturbation shows.
    assert np.abs(ours - _hf_logits(exported)).max() < TOLERANCE


def test_train_resumes_from_the_import_and_its_step_exports(llama3, tmp_path, capsys):
    model, hf_dir, _ = llama3
    run = tmp_path / "run"
    assert main(["convert", "hf-to-axcore", str(hf_dir), str(run)]) == 0
    overrides = ["trainer.max_steps=1", "trainer.eval_every=0", "trainer.sample.num_tokens=0", "input.batch_size=2",
                 "trainer.learner.schedule.warmup_steps=0", "trainer.metrics_writers=[]"]
    assert main(["train", str(run / "config.yaml"), *[a for o in overrides for a in ("--set", o)]]) == 0
    assert "Resumed from step 0" in capsys.readouterr().err
    assert main(["convert", "axcore-to-hf", str(run), str(tmp_path / "out")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    trained = _axcore_logits(run, step=1)
    assert np.abs(trained - _hf_logits(model)).max() > 1e-3  # One step changed the model...
    assert np.abs(trained - _hf_logits(exported)).max() < TOLERANCE  # ...and the export is that model.


def test_generate_on_an_import_matches_transformers_greedy_generate(llama3, capsys):
    """`axcore generate` (KV cache, a batch of two prompts of different lengths) against
    transformers' own greedy `generate` with its own cache, prompt by prompt."""
    model, _, run = llama3
    prompts = ["hello", "Good morning, "]
    assert main(["generate", str(run), "--max-new-tokens", "10", "--json", *[a for p in prompts for a in ("--prompt", p)]]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for prompt, record in zip(prompts, records):
        ids = torch.tensor([list(prompt.encode())])
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        assert record["tokens"] == expected.tolist()


@pytest.mark.slow  # Compiles the engine's program (about 10-30 s on 2 loaded cores).
def test_engine_on_an_import_matches_transformers(llama3):
    """The inference engine's greedy tokens and log-probabilities (axcore_hf.testing.check_engine: mixed lengths,
    requests joining mid-flight, a prefix-cache hit, preemptions, n = 3) equal transformers' (llama3 RoPE, GQA)."""
    from axcore_hf.testing import check_engine

    model, _, run = llama3
    check_engine(model, run)


def test_the_checkpoints_tokenizer_becomes_the_experiments(llama3, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("axcore_tokenizers")
    _, hf_dir, _ = llama3
    source = tmp_path / "hf"
    source.mkdir()
    for name in ("config.json", "model.safetensors"):
        (source / name).symlink_to(hf_dir / name)
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(  # 256 bytes + 2 special tokens <= vocab_size 260.
        vocab_size=258, special_tokens=["<s>", "</s>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["hello world"] * 4, trainer)
    bpe.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>"}))
    hf_to_axcore(source, tmp_path / "run")
    tokenizer = load_model(tmp_path / "run").experiment.config.tokenizer
    assert (tokenizer.path, tokenizer.add_bos) == (str(tmp_path / "run" / "hf" / "tokenizer.json"), True)
    axcore_to_hf(tmp_path / "run", tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


# -- 3. Lossless round trips ------------------------------------------------------------


def _tensors(directory):
    from axcore_hf.files import read_tensors

    return read_tensors(pathlib.Path(directory))


@pytest.mark.parametrize(
    "dtype, shards", [("float32", None), ("bfloat16", None), ("bfloat16", "40KB"), ("float16", "40KB")]
)
def test_round_trip_is_bit_identical(tmp_path, dtype, shards):
    torch_dtype = getattr(torch, dtype)
    _save_hf(tmp_path / "hf", transformers.LlamaConfig(**LLAMA3), dtype=torch_dtype, max_shard_size=shards)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == bool(shards)
    hf_to_axcore(tmp_path / "hf", tmp_path / "run")
    args = ["--max-shard-size", shards] if shards else []
    assert main(["convert", "axcore-to-hf", str(tmp_path / "run"), str(tmp_path / "out"), *args]) == 0
    index = tmp_path / "out" / "model.safetensors.index.json"
    assert index.exists() == bool(shards) and len(list((tmp_path / "out").glob("*.safetensors"))) > (1 if shards else 0)
    before, after = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    want = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    for name, tensor in before.items():
        assert tensor.dtype == after[name].dtype == want and tensor.shape == after[name].shape, name
        assert tensor.tobytes() == after[name].tobytes(), name  # Bit-identical.
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "llama" and (config.get("dtype") or config.get("torch_dtype")) == dtype


# -- 4. Bad inputs: one line, exit status 2, nothing left behind ------------------------------


def _bad_dir(tmp_path, edit):
    """A valid tiny Llama directory (config edited by `edit`) without building a model."""
    directory = tmp_path / "bad"
    directory.mkdir()
    data = transformers.LlamaConfig(**TINY).to_dict()
    edit(data)
    (directory / "config.json").write_text(json.dumps(data))
    return directory


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda c: c.update(model_type="phi3"), "model_type 'phi3' has no converter"),
        (lambda c: c.update(attention_bias=True), "'attention_bias' is true"),
        (lambda c: c.update(mlp_bias=True), "'mlp_bias' is true"),
        (lambda c: c.update(hidden_act="gelu"), "'hidden_act' is 'gelu'"),
        (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
        (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                             "attention_factor": 2.0}), "yarn's attention_factor"),
        (lambda c: c.update(partial_rotary_factor=0.5), "'partial_rotary_factor' is 0.5"),
        (lambda c: c.pop("model_type"), "'model_type' is missing"),
        (lambda c: c.pop("hidden_size"), "'hidden_size' is missing"),
    ],
)
def test_unsupported_configs_exit_2_with_one_line(tmp_path, capsys, edit, expected):
    source = _bad_dir(tmp_path, edit)
    assert main(["convert", "hf-to-axcore", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "config.json" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # Neither OUT nor a temporary directory.


def test_missing_files_and_shape_mismatch_exit_2(llama3, tmp_path, capsys):
    _, hf_dir, _ = llama3
    (tmp_path / "empty").mkdir()
    assert main(["convert", "hf-to-axcore", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "config.json does not exist" in capsys.readouterr().err
    no_weights = _bad_dir(tmp_path, lambda c: None)
    assert main(["convert", "hf-to-axcore", str(no_weights), str(tmp_path / "out")]) == 2
    assert "neither model.safetensors nor model.safetensors.index.json" in capsys.readouterr().err
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    assert main(["convert", "hf-to-axcore", str(wrong), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mlp.gate_proj.weight' has shape [96, 64]" in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    assert main(["convert", "hf-to-axcore", str(hf_dir), str(wrong)]) == 2  # OUT exists.
    assert "already exists" in capsys.readouterr().err


def test_export_refuses_a_model_llama_cannot_express(llama3, tmp_path, capsys):
    _, _, run = llama3
    experiment = axcore.load_experiment(run / "experiment.yaml", ["model.decoder.layer.norm.type=layer_norm"])
    model = experiment.config.model.instantiate(name="model", registries=experiment.registries)
    params = jax.tree.map(lambda a: np.full(a.shape, 0.01, np.float32), model.abstract_parameters())
    save_model(experiment, params, tmp_path / "run")
    assert main(["convert", "axcore-to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.decoder.layer.norm.type is 'layer_norm'" in err, err
    assert not (tmp_path / "out").exists()


# -- The converter registry (hook axcore_register_model_converters) ----------------------------


class MyFamily:
    """A third-party plugin adding a model family."""

    @axcore.hookimpl
    def axcore_register_model_converters(self, register):
        register("my_llama", LlamaConverter(model_type="my_llama", architecture="MyLlamaForCausalLM"))


class Clash:
    @axcore.hookimpl
    def axcore_register_model_converters(self, register):
        register("llama", LlamaConverter())


class NotAConverter:
    @axcore.hookimpl
    def axcore_register_model_converters(self, register):
        register("broken", object())


def test_plugins_register_model_converters_by_model_type():
    registries = axcore.create_plugin_manager(["hf", "mine"], objects={"mine": MyFamily()}).registries
    assert {"llama", "mistral", "my_llama"} <= set(registries.model_converters)
    assert registries.model_converters.entry("llama").provenance.plugin == "hf"
    with pytest.raises(DuplicateComponentError, match="llama"):
        _ = axcore.create_plugin_manager(["hf", "clash"], objects={"clash": Clash()}).registries
    with pytest.raises(PluginLoadError, match="model converter 'broken'"):
        _ = axcore.create_plugin_manager(["bad"], objects={"bad": NotAConverter()}).registries


def test_converter_errors_name_the_file_and_field():
    with pytest.raises(ConversionError, match=r"x/config.json: 'num_attention_heads' is missing"):
        LlamaConverter().experiment({"hidden_size": 8}, "x/config.json")


def test_unplaced_tensors_lists_what_an_import_left_unused():
    from axcore_hf.llama import unplaced_tensors

    tensors = dict.fromkeys(["a", "b", "lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"])
    assert unplaced_tensors(tensors, {"a"}, tied=True) == "b"  # RoPE buffers and a tied head are not lost weights.
    assert unplaced_tensors(tensors, {"a"}, tied=False) == "b, lm_head.weight"
    assert unplaced_tensors(tensors, {"a", "b"}, tied=True) == ""
    many = dict.fromkeys(f"t{i}" for i in range(7))
    assert unplaced_tensors(many, set(), tied=False) == "t0, t1, t2, t3, t4 ..."


def test_a_checkpoint_tensor_with_no_place_is_refused_in_one_line(llama3, tmp_path, capsys):
    from safetensors.numpy import save_file

    _, hf_dir, _ = llama3
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = {k: np.asarray(v, np.float32) for k, v in _tensors(hf_dir).items()}
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(tensors["model.layers.0.self_attn.q_proj.weight"].shape[0],
                                                                np.float32)
    save_file(tensors, str(extra / "model.safetensors"))
    assert main(["convert", "hf-to-axcore", str(extra), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensors model.layers.0.self_attn.q_proj.bias have no place" in err, err
    assert not (tmp_path / "out").exists()
