"""PEFT interop of the lora plugin, with `peft` and `transformers` as the oracle.

A tiny random Llama (as plugins/hf/tests/test_hf_convert.py builds it) is imported with the
hf plugin; a PEFT LoRA adapter with random (non-zero) A and B is made by `peft` on the
transformers model. Imported into axcore (`axcore lora import-peft`), the LoRA run's
logits equal the PEFT model's within 1e-4; exported back (`export-peft`) the files hold
the same tensors bit for bit and `peft` loads them onto the base; the merged run
(`merge`) holds w + B.A.(alpha/rank) in float32, and its logits match too, in axcore and
exported to Hugging Face (`axcore convert axcore-to-hf`) in transformers alone. An adapter
made for a wider base is refused in one line, exit status 2.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.numpy import load_file, save_file  # noqa: E402

import axcore  # noqa: E402
from axcore.cli import main  # noqa: E402
from axcore.inference.run_loading import load_model  # noqa: E402

from axcore_hf import hf_to_axcore  # noqa: E402

TOLERANCE = 1e-4
RANK, ALPHA = 4, 8
TINY = dict(vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-5)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = np.random.default_rng(0).integers(0, TINY["vocab_size"], size=(2, 12))


def _hf_model(config, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.15)
    return model.float().eval()


def _adapter(base, path, seed=1):
    """A PEFT LoRA model on `base` with random A and B (std 0.1), saved to `path`."""
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    model.eval().save_pretrained(path)
    return model


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


def _axcore_logits(run):
    loaded = load_model(run)
    return np.asarray(axcore.functional(loaded.model, loaded.params, (IDS,), None, False, method="logits")[0])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(peft model, base HF model, paths) with the adapter imported into axcore."""
    root = tmp_path_factory.mktemp("peft")
    config = transformers.LlamaConfig(**TINY)
    _hf_model(config).save_pretrained(root / "hf")
    hf_to_axcore(root / "hf", root / "base")
    peft_model = _adapter(_hf_model(config), root / "adapter")
    assert main(["lora", "import-peft", str(root / "base"), str(root / "adapter"), str(root / "lora")]) == 0
    return peft_model, config, root


def test_an_imported_peft_adapter_gives_peft_logits(imported):
    peft_model, config, root = imported
    expected = _logits(peft_model)
    assert np.abs(expected - _logits(_hf_model(config))).max() > 0.05  # The adapter changes the logits.
    assert np.abs(_axcore_logits(root / "lora") - expected).max() < TOLERANCE


def test_export_round_trips_and_peft_loads_it(imported):
    peft_model, config, root = imported
    assert main(["lora", "export-peft", str(root / "lora"), str(root / "exported")]) == 0
    original, exported = load_file(str(root / "adapter" / "adapter_model.safetensors")), \
        load_file(str(root / "exported" / "adapter_model.safetensors"))
    assert sorted(original) == sorted(exported)
    for key in original:
        np.testing.assert_array_equal(exported[key], original[key], err_msg=key)
    settings = json.loads((root / "exported" / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["peft_type"]) == (RANK, ALPHA, "LORA")
    loaded = peft.PeftModel.from_pretrained(_hf_model(config), root / "exported").eval()
    assert np.abs(_logits(loaded) - _axcore_logits(root / "lora")).max() < TOLERANCE


def test_merged_export_is_the_base_plus_the_scaled_product(imported):
    peft_model, config, root = imported
    assert main(["lora", "merge", str(root / "lora"), str(root / "merged")]) == 0
    merged, base = load_model(root / "merged"), load_model(root / "base")
    assert "lora" not in merged.experiment.settings
    tensors = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    for i in range(TINY["num_hidden_layers"]):
        for hf, path in [("self_attn.q_proj", ("self_attention", "wq")), ("self_attn.o_proj", ("self_attention", "wo")),
                         ("mlp.down_proj", ("feed_forward", "down_proj", "weight"))]:
            a = tensors[f"base_model.model.model.layers.{i}.{hf}.lora_A.weight"]
            b = tensors[f"base_model.model.model.layers.{i}.{hf}.lora_B.weight"]
            w_hf = np.asarray(_get(base.params["decoder"][f"layer{i}"], path))
            got = np.asarray(_get(merged.params["decoder"][f"layer{i}"], path))
            # In Hugging Face's [out, in] layout: W + B @ A * alpha / r (float64 oracle, float32 result).
            w_out_in = w_hf.reshape(-1, w_hf.shape[-1]).T if hf.endswith("o_proj") or "mlp" in hf else \
                w_hf.reshape(w_hf.shape[0], -1).T
            expected = w_out_in.astype(np.float64) + b.astype(np.float64) @ a.astype(np.float64) * (ALPHA / RANK)
            got_out_in = got.reshape(-1, got.shape[-1]).T if hf.endswith("o_proj") or "mlp" in hf else \
                got.reshape(got.shape[0], -1).T
            np.testing.assert_allclose(got_out_in, expected, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(expected).max())
    assert np.abs(_axcore_logits(root / "merged") - _logits(peft_model)).max() < TOLERANCE
    # A plain run: the hf plugin exports it, and transformers alone gives the PEFT model's logits.
    assert main(["convert", "axcore-to-hf", str(root / "merged"), str(root / "merged_hf")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "merged_hf").float().eval()
    assert np.abs(_logits(exported) - _logits(peft_model)).max() < TOLERANCE


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def test_an_adapter_for_another_base_is_refused_in_one_line(imported, tmp_path, capsys):
    _, _, root = imported
    wider = transformers.LlamaConfig(**{**TINY, "hidden_size": 96})
    _adapter(_hf_model(wider), tmp_path / "other")
    assert main(["lora", "import-peft", str(root / "base"), str(tmp_path / "other"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the adapter was trained for another base model" in err[0], err
    assert not (tmp_path / "out").exists()


def test_after_training_the_exported_adapter_gives_axcores_logits_in_peft(imported, tmp_path):
    """The imported LoRA run fine-tuned by `axcore train` (3 steps), then exported: PEFT agrees within 1e-4."""
    _, config, root = imported
    run = tmp_path / "trained"
    assert main(["lora", "import-peft", str(root / "base"), str(root / "adapter"), str(run)]) == 0
    before = _axcore_logits(run)
    assert main(["train", str(run / "config.yaml"), "--set", "trainer.max_steps=3", "--set", "input.seq_len=32",
                 "--set", "input.batch_size=2", "--set", "trainer.sample.num_tokens=0"]) == 0
    after = _axcore_logits(run)
    assert np.abs(after - before).max() > 1e-3  # Training moved the adapters.
    assert [p.name for p in (root / "base" / "checkpoints").iterdir()] == ["0"]  # The base run is untouched.
    assert main(["lora", "export-peft", str(run), str(tmp_path / "exported")]) == 0
    loaded = peft.PeftModel.from_pretrained(_hf_model(config), tmp_path / "exported").eval()
    assert np.abs(_logits(loaded) - after).max() < TOLERANCE


def test_init_adds_fresh_adapters_that_change_nothing(imported, tmp_path, capsys):
    _, config, root = imported
    run = tmp_path / "fresh"
    assert main(["lora", "init", str(root / "base"), str(run), "--rank", "2", "--target", "q|v"]) == 0
    loaded = load_model(run)
    assert (loaded.experiment.settings["lora"].rank, loaded.experiment.settings["lora"].target) == (2, "q|v")
    attention = loaded.params["decoder"]["layer0"]["self_attention"]["kernel_state"]
    assert sorted(attention) == ["q_proj", "v_proj"] and attention["q_proj"]["lora_a"].shape == (64, 2)
    np.testing.assert_array_equal(_axcore_logits(run), _axcore_logits(root / "base"))  # B = 0.
    # A rank above a projection (k_proj: [64 -> 2 heads x 16 = 32]) is refused in one line, exit 2.
    assert main(["lora", "init", str(root / "base"), str(tmp_path / "big"), "--rank", "48"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'lora.rank' (48) is larger than projection decoder.layer0.self_attention.k_proj" in err[0]


def test_qlora_init_quantizes_the_imported_base_and_merge_dequantizes_it(imported, tmp_path):
    """`lora init --base-format nf4`: the targeted weights are stored as NF4 bytes ([blocks of 64, 32 code bytes +
    a float32 absmax]); merged (B = 0) they come back within NF4's bound of the base: absmax x 0.304 / 2 (the
    widest gap of the code, -1 -> -0.6962), and the QLoRA run's logits are the merged run's."""
    _, _, root = imported
    run, merged_run = tmp_path / "qlora", tmp_path / "merged"
    assert main(["lora", "init", str(root / "base"), str(run), "--rank", "2", "--base-format", "nf4"]) == 0
    loaded, base = load_model(run), load_model(root / "base")
    assert loaded.experiment.settings["lora"].base_format == "nf4"
    stored = np.asarray(loaded.params["decoder"]["layer0"]["self_attention"]["wq"])
    assert stored.dtype == np.uint8 and stored.shape == (64 * 64 // 64, 36)
    assert main(["lora", "merge", str(run), str(merged_run)]) == 0
    merged = load_model(merged_run)
    for i in range(TINY["num_hidden_layers"]):
        for path in [("self_attention", "wq"), ("self_attention", "wo"), ("feed_forward", "down_proj", "weight")]:
            w = np.asarray(_get(base.params["decoder"][f"layer{i}"], path))
            got = np.asarray(_get(merged.params["decoder"][f"layer{i}"], path))
            in_dims = 2 if path[-1] == "wo" else 1  # [out, in] rows, blocks of 64 along in.
            rows, got_rows = (x.reshape(int(np.prod(x.shape[:in_dims])), -1).T.reshape(-1, 64) for x in (w, got))
            bound = np.abs(rows).max(axis=1, keepdims=True) * (1.0 - 0.6961928009986877) / 2
            assert np.all(np.abs(got_rows - rows) <= bound * (1 + 1e-6)) and np.abs(got_rows - rows).max() > 0, path
    np.testing.assert_allclose(_axcore_logits(run), _axcore_logits(merged_run), rtol=1e-5, atol=1e-5)


# -- import-peft refuses a broken adapter before writing anything (a subprocess each) ---------------------


def _axcore(*args):
    return subprocess.run([sys.executable, "-m", "axcore.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _edit_config(change):
    def edit(adapter):
        path = adapter / "adapter_config.json"
        config = json.loads(path.read_text())
        change(config)
        path.write_text(json.dumps(config))
    return edit


def _edit_tensors(change):
    def edit(adapter):
        path = adapter / "adapter_model.safetensors"
        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return edit


def _truncate(adapter):
    path = adapter / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
BROKEN = {  # case -> (edit of a copy of the peft-saved adapter, file named, words of the one line)
    "garbage_config": (lambda d: (d / "adapter_config.json").write_text("{r: 4,,"), "adapter_config.json",
                       "is not JSON"),
    "r_missing": (_edit_config(lambda c: c.pop("r")), "adapter_config.json", "key 'r' is missing"),
    "r_a_string": (_edit_config(lambda c: c.update(r="four")), "adapter_config.json",
                   "key 'r' is \"four\"; it must be a positive integer"),
    "truncated_weights": (_truncate, "adapter_model.safetensors", "is not a readable safetensors file"),
    "targets_name_nothing": (_edit_config(lambda c: c.update(target_modules=["qkv_proj", "q_proj"])),
                             "adapter_config.json", "target_modules entry 'qkv_proj' names no projection"),
    "targets_a_plain_string": (_edit_config(lambda c: c.update(target_modules="q_proj")), "adapter_config.json",
                               "target_modules entry 'q_proj' names no projection"),
    "lora_a_int32": (_edit_tensors(lambda t: t.update({f"{Q0}.lora_A.weight": t[f"{Q0}.lora_A.weight"].astype(np.int32)})),
                     "adapter_model.safetensors", f"tensor {Q0}.lora_A.weight is stored as I32"),
    "lora_a_missing": (_edit_tensors(lambda t: t.pop(f"{Q0}.lora_A.weight")), "adapter_model.safetensors",
                       f"tensor {Q0}.lora_A.weight is missing beside {Q0}.lora_B.weight"),
    "dora": (_edit_config(lambda c: c.update(use_dora=True)), "adapter_config.json", "key 'use_dora' is true"),
    "nan_weight": (_edit_tensors(lambda t: t[f"{Q0}.lora_B.weight"].__setitem__((0, 0), np.nan)),
                   "adapter_model.safetensors", f"tensor {Q0}.lora_B.weight has 1 NaN or infinite values"),
    "a_module_missing": (_edit_tensors(lambda t: [t.pop(f"{Q0}.lora_{w}.weight") for w in "AB"]),
                         "adapter_model.safetensors",
                         "has no lora_A/lora_B tensors for model.layers.0.self_attn.q_proj, which target_modules"),
    "config_and_weights_disagree": (_edit_config(lambda c: c.update(target_modules=["q_proj"])),
                                    "adapter_model.safetensors", "target_modules ([\"q_proj\"]) does not select"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_adapter_is_refused_in_one_line_before_anything_is_written(case, imported, tmp_path):
    _, _, root = imported
    edit, file, words = BROKEN[case]
    adapter = tmp_path / "adapter"
    shutil.copytree(root / "adapter", adapter)
    edit(adapter)
    result = _axcore("lora", "import-peft", str(root / "base"), str(adapter), str(tmp_path / "out"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert str(adapter / file) in lines[0] and words in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_target_modules_as_one_regular_expression_selects_as_in_peft(imported, tmp_path):
    """PEFT's other form: a string fully matched against each module's name. Imported, the logits are PEFT's."""
    _, config, root = imported
    peft_config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=r".*\.(q_proj|down_proj)")
    model = peft.get_peft_model(_hf_model(config), peft_config)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    model.eval().save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"] == \
        r".*\.(q_proj|down_proj)"
    assert main(["lora", "import-peft", str(root / "base"), str(tmp_path / "adapter"), str(tmp_path / "run")]) == 0
    attention = load_model(tmp_path / "run").params["decoder"]["layer0"]["self_attention"]["kernel_state"]
    assert sorted(attention) == ["q_proj"]
    assert np.abs(_axcore_logits(tmp_path / "run") - _logits(model)).max() < TOLERANCE


def test_exporting_a_qlora_run_warns_that_the_adapters_belong_to_the_quantized_base(imported, tmp_path):
    """export-peft of a run trained against an nf4 base still writes the adapters (exit 0), and says in a warning
    and in the directory's README.md which base they belong to; a float LoRA run's export says nothing."""
    _, _, root = imported
    run = tmp_path / "qlora"
    assert main(["lora", "init", str(root / "base"), str(run), "--rank", "2", "--base-format", "nf4"]) == 0
    result = _axcore("lora", "export-peft", str(run), str(tmp_path / "exported"))
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and f"run {run} was trained against a nf4-quantized base" in warning[0], result.stderr
    assert "axcore lora merge" in warning[0]
    assert "belong to that quantized base" in (tmp_path / "exported" / "README.md").read_text()
    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == \
        ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    plain = _axcore("lora", "export-peft", str(root / "lora"), str(tmp_path / "plain"))
    assert plain.returncode == 0 and "warning" not in plain.stderr, plain.stderr
    assert not (tmp_path / "plain" / "README.md").exists()
