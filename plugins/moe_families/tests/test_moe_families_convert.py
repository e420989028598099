"""Plugin moe_families: Mixtral and Qwen3-MoE exports, round trips and refusals.

Tiny random models (moe_family_models.py). Exports read back by transformers'
`from_pretrained` with the same logits; HF -> axcore -> HF bit-identical in float32,
bfloat16 and float16; unsupported config fields refused in one line naming them.
"""

import json
import pathlib

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("axcore_moe_families")

from moe_family_models import CONFIGS, TOLERANCE, axcore_logits, hf_logits, save_hf  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import axcore  # noqa: E402
from axcore.cli import main  # noqa: E402
from axcore.inference.run_loading import load_model, save_model  # noqa: E402

from axcore_hf import axcore_to_hf, hf_to_axcore  # noqa: E402
from axcore_hf.files import DTYPES, read_config, read_tensors, write_config  # noqa: E402
from axcore_moe_families import MIXTRAL, QWEN3_MOE, MoEConverter, converter  # noqa: E402


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    """(model_type, HF model, HF dir, imported run dir) of each family's tiny model."""
    root = tmp_path_factory.mktemp(request.param)
    model = save_hf(root / "hf", CONFIGS[request.param]())
    hf_to_axcore(root / "hf", root / "run")
    return request.param, model, root / "hf", root / "run"


def test_export_loads_in_transformers_with_the_same_logits(family, tmp_path):
    name, model, hf_dir, run = family
    axcore_to_hf(run, tmp_path / "out")
    config = read_config(tmp_path / "out")
    assert config["model_type"] == name and config["num_experts_per_tok"] == 2
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(exported) is type(model)
    assert np.abs(hf_logits(exported) - axcore_logits(run)).max() < TOLERANCE
    assert sorted(read_tensors(tmp_path / "out")) == sorted(read_tensors(hf_dir))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_is_bit_identical(family, tmp_path, dtype):
    _, _, hf_dir, _ = family
    source = tmp_path / "hf"  # The float32 checkpoint stored in `dtype` (rounded once, here).
    source.mkdir()
    save_file({k: v.astype(DTYPES[dtype]) for k, v in read_tensors(hf_dir).items()}, source / "model.safetensors")
    write_config(source, {**read_config(hf_dir), "dtype": dtype})
    hf_to_axcore(source, tmp_path / "run")
    axcore_to_hf(tmp_path / "run", tmp_path / "out")
    before, after = read_tensors(source), read_tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == DTYPES[dtype] and tensor.tobytes() == after[name].tobytes(), name


def _bad(tmp_path, family, **fields):
    directory = tmp_path / "bad"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**CONFIGS[family]().to_dict(), **fields}))
    return directory


@pytest.mark.parametrize(
    "family, fields, expected",
    [
        ("mixtral", {"router_jitter_noise": 0.1}, "'router_jitter_noise' is 0.1"),
        ("mixtral", {"num_experts_per_tok": 5}, "'num_experts_per_tok' (5) exceeds"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "'mlp_only_layers' is [1]"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "'decoder_sparse_step' is 2"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 32}, "'shared_expert_intermediate_size' is 32"),
        ("qwen3_moe", {"attention_bias": True}, "'attention_bias' is true"),
        ("qwen3_moe", {"num_experts": 0, "num_local_experts": 0}, "'num_local_experts' is 0"),
    ],
)
def test_unsupported_configs_exit_2_with_one_line(tmp_path, capsys, family, fields, expected):
    source = _bad(tmp_path, family, **fields)
    assert main(["convert", "hf-to-axcore", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "config.json" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_missing_expert_tensor_is_named(family, tmp_path, capsys):
    name, _, hf_dir, _ = family
    source = tmp_path / "hf"
    source.mkdir()
    tensors = read_tensors(hf_dir)
    block = "block_sparse_moe" if name == "mixtral" else "mlp"
    missing = f"model.layers.1.{block}.experts.3.{'w2' if name == 'mixtral' else 'down_proj'}.weight"
    save_file({k: v for k, v in tensors.items() if k != missing}, source / "model.safetensors")
    write_config(source, read_config(hf_dir))
    assert main(["convert", "hf-to-axcore", str(source), str(tmp_path / "out")]) == 2
    assert f"tensor '{missing}' is missing" in capsys.readouterr().err


def test_families_are_registered_by_model_type():
    registries = axcore.create_plugin_manager(["hf", "moe_families"]).registries
    assert {"mixtral", "qwen3_moe"} <= set(registries.model_converters)
    assert registries.model_converters.entry("qwen3_moe").provenance.plugin == "moe_families"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("moe.capacity_factor=1.25", "feed_forward.capacity_factor is 1.25 (the exported config.json gives None)"),
        ("moe.every=2", "feed_forward is 'gated_feed_forward'; a "),
    ],
)
def test_export_refuses_what_the_family_cannot_express(family, tmp_path, capsys, override, expected):
    _, _, _, run = family
    experiment = axcore.load_experiment(run / "experiment.yaml", [override])
    model = experiment.config.model.instantiate(name="model", registries=experiment.registries)
    save_model(experiment, jax.tree.map(lambda a: np.zeros(a.shape, np.float32), model.abstract_parameters()),
               tmp_path / "run")
    (tmp_path / "run" / "hf").symlink_to(run / "hf")  # The import's record: model type and config fields.
    assert main(["convert", "axcore-to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists()


def test_qwen3_moe_without_norm_topk_prob_does_not_renormalize():
    # transformers' Qwen3MoeConfig defaults norm_topk_prob to false; Mixtral always renormalizes.
    config = {k: v for k, v in CONFIGS["qwen3_moe"]().to_dict().items() if k != "norm_topk_prob"}
    assert MoEConverter(QWEN3_MOE).experiment(config, "config.json")["moe"]["gates"] == "probabilities"
    config = {**CONFIGS["mixtral"]().to_dict(), "norm_topk_prob": False}
    assert MoEConverter(MIXTRAL).experiment(config, "config.json")["moe"]["gates"] == "renormalized"


def test_the_core_holds_no_line_of_these_families():
    # Their names and distinctive config.json keys and tensor names appear only in the plugins.
    words = ("mixtral", "qwen3_moe", "qwen3moe", "norm_topk_prob", "num_local_experts", "num_experts_per_tok",
             "block_sparse_moe", "moe_intermediate_size", "decoder_sparse_step", "router_jitter_noise")
    core = pathlib.Path(axcore.__file__).parent
    found = [f"{path.relative_to(core)}: {word}" for path in core.rglob("*.py")
             for word in words if word in path.read_text("utf-8").lower()]
    assert found == []
    plugin = "".join(path.read_text("utf-8").lower() for path in pathlib.Path(converter.__file__).parent.glob("*.py"))
    assert [word for word in words if word not in plugin] == []  # The words are the ones the plugin uses.


def test_export_ignores_the_training_only_router_losses(family, tmp_path):
    name, model, _, run = family
    experiment = axcore.load_experiment(run / "experiment.yaml", ["moe.load_balance_loss_weight=0.05",
                                                                  "moe.router_z_loss_weight=0.0"])
    save_model(experiment, load_model(run).params, tmp_path / "run")
    (tmp_path / "run" / "hf").symlink_to(run / "hf")
    axcore_to_hf(tmp_path / "run", tmp_path / "out")  # Fine-tuned with other aux-loss weights: still that model.
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert np.abs(hf_logits(exported) - hf_logits(model)).max() < TOLERANCE
