"""The moe plugin through its installed entry point: config transform, scan blocks, training."""

import importlib.metadata
import pathlib

import pytest
import yaml

from axcore.errors import ConfigError
from axcore.experiment import load_experiment
from axcore.observe import read_jsonl_metrics
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

GOLDEN = pathlib.Path(__file__).resolve().parents[3] / "tests" / "golden"
FIXED_MESH = "mesh.instance_type=cpu-1"
# As in tests/trainer/test_trainer.py, without sampling or evaluation.
# Metrics are fetched every step (log_every=1), so each step writes a record.
TINY = [
    *TINY_OVERRIDES, "trainer.eval_every=0", "trainer.sample.num_tokens=0", "trainer.learner.schedule.warmup_steps=2",
    "trainer.max_steps=3", "trainer.log_every=1",
]


def _lines(experiment):
    return dict(line.split(": ", 1) for line in experiment.flat().splitlines())


def test_moe_is_installed_as_a_separate_distribution():
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="axcore") if ep.name == "moe"]
    assert ep.value == "axcore_moe.plugin" and ep.dist.metadata["Name"] == "axcore-moe"


def test_every_second_layer_of_the_default_experiment_gets_experts(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("plugins: [moe]\nmoe: {every: 2, num_experts: 4, top_k: 2}\n")
    lines = _lines(load_experiment(path, [FIXED_MESH]))
    for i in (0, 2):
        assert lines[f"model.decoder.layer[{i}].feed_forward.type"] == "feed_forward"
    for i in (1, 3):
        ffn = f"model.decoder.layer[{i}].feed_forward"
        assert lines[f"{ffn}.type"] == "mixture_of_experts"
        assert lines[f"{ffn}.num_experts"] == "4" and lines[f"{ffn}.top_k"] == "2"
        # The replaced dense FFN becomes the expert template.
        assert lines[f"{ffn}.hidden_dim"] == "1024" and lines[f"{ffn}.expert.type"] == "feed_forward"
        assert lines[f"{ffn}.expert.activation"] == "gelu"
    assert "model.decoder.layer[4].type" not in lines and lines["moe.every"] == "2"


def test_experts_inherit_the_feed_forward_settings():
    lines = _lines(load_experiment(None, [
        "plugins=[moe]", "model.decoder.layer.feed_forward.activation=silu",
        "model.decoder.layer.feed_forward.hidden_dim=704",
    ]))
    assert lines["model.decoder.layer[0].feed_forward.activation"] == "silu"
    expert = "model.decoder.layer[1].feed_forward.expert"
    assert lines[f"{expert}.type"] == "feed_forward" and lines[f"{expert}.activation"] == "silu"
    assert lines["model.decoder.layer[1].feed_forward.hidden_dim"] == "704"
    assert lines[f"{expert}.hidden_dim"] == "REQUIRED"  # Set by the MoE when it is built.


def test_experts_of_a_swiglu_model_are_swiglu():
    pytest.importorskip("axcore_swiglu")
    lines = _lines(load_experiment(None, ["plugins=[swiglu, moe]", "model.num_layers=2"]))
    assert lines["model.decoder.layer[1].feed_forward.type"] == "mixture_of_experts"
    assert lines["model.decoder.layer[1].feed_forward.expert.activation"] == "silu"
    assert lines["model.decoder.layer[1].feed_forward.expert.type"] == "gated_feed_forward"


def test_scanned_decoder_repeats_a_block_with_experts_in_its_last_layer():
    exp = load_experiment("scan", ["plugins=[moe]", "moe.every=2", FIXED_MESH])
    lines = _lines(exp)
    assert lines["model.decoder.type"] == "repeated_transformer"
    assert lines["model.decoder.layer.type"] == "stacked_transformer"
    assert lines["model.decoder.layer.num_layers"] == "2"
    assert lines["model.decoder.layer.layer[0].feed_forward.type"] == "feed_forward"
    assert lines["model.decoder.layer.layer[1].feed_forward.type"] == "mixture_of_experts"
    assert lines["model.decoder.layer.layer[1].feed_forward.hidden_dim"] == "1024"
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    assert model.decoder.repeats == 2
    specs = model.parameter_specs()["decoder"]["layer"]["layer1"]["feed_forward"]
    assert specs["expert"]["up_proj"]["weight"].mesh_axes == ("layers", "expert", "embed", "mlp")
    assert specs["expert"]["up_proj"]["weight"].shape == (2, 8, 256, 1024)


@pytest.mark.parametrize("source", [None, "scan"])
def test_a_saved_resolved_config_reads_back_unchanged(tmp_path, source):
    exp = load_experiment(source, ["plugins=[moe]", FIXED_MESH])
    saved = tmp_path / "config.yaml"
    data = {k: v for k, v in exp.to_dict().items() if k != "mesh"}  # The mesh is resolved again.
    saved.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_experiment(saved, [FIXED_MESH]).flat() == exp.flat()  # No experts nested in experts.


def test_scan_over_layers_not_divisible_by_every_is_a_config_error():
    with pytest.raises(ConfigError, match="moe.every=2"):
        load_experiment("scan", ["plugins=[moe]", "moe.every=2", "model.num_layers=3"])
    with pytest.raises(ConfigError, match="between 1 and the 4 layers of 'model.decoder'"):
        load_experiment(None, ["plugins=[moe]", "moe.every=5"])


def test_installed_but_not_listed_changes_nothing():
    assert "moe" in {ep.name for ep in importlib.metadata.entry_points(group="axcore")}
    exp = load_experiment(None, [FIXED_MESH])
    golden = (GOLDEN / "default.txt").read_text()
    assert exp.flat() == "".join(line for line in golden.splitlines(True) if not line.startswith(("# kernel", "# data check")))
    assert "mixture_of_experts" not in exp.flat() and "moe" not in exp.settings


@pytest.mark.parametrize("source", [None, "scan"])
def test_training_records_a_positive_aux_loss(tmp_path, source):
    exp = load_experiment(source, [*TINY, "plugins=[moe]", "moe.num_experts=4", f"trainer.run_dir={tmp_path}"])
    result = Trainer(exp).run()
    assert result.step == 3
    records = read_jsonl_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 3 and all(r["train/aux_loss"] > 0 for r in records)
    moe = "decoder/layer1/feed_forward" if source is None else "decoder/layer/layer1/feed_forward"
    assert records[-1][f"train/summaries/{moe}/load_balance_loss"] > 0
    assert 0 <= records[-1][f"train/summaries/{moe}/dropped_assignment_fraction"] < 1
