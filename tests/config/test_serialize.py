"""YAML round trip, flat dumps and `path=value` overrides."""

import subprocess
import sys

import pytest
import yaml

from axcore.config import apply_overrides, dump_flat, flatten, from_yaml, to_yaml
from axcore.errors import ConfigError, ConfigTypeError, UnknownComponentError, UnknownFieldError
from axcore.layers import CausalLM, LayerNorm, RepeatedTransformer


def _lm():
    cfg = CausalLM.default_config().set(vocab_size=16, dim=8, num_layers=4)
    cfg.decoder.layer.self_attention.set(num_heads=2, num_kv_heads=1)
    cfg.decoder.layer.feed_forward.set(hidden_dim=16, activation="silu")
    cfg.final_norm = LayerNorm.default_config().set(eps=1e-3)
    cfg.param_dtype = "bfloat16"
    return cfg


def test_round_trip_gives_equal_tree(registries):
    cfg = _lm()
    text = to_yaml(cfg, registries)
    assert from_yaml(text, registries) == cfg


def test_round_trip_with_per_layer_list(registries):
    cfg = _lm()
    cfg.decoder.layer = [cfg.decoder.layer.clone() for _ in range(4)]
    cfg.decoder.layer[2].feed_forward.hidden_dim = 64
    back = from_yaml(to_yaml(cfg, registries), registries)
    assert back == cfg and back.decoder.layer[2].feed_forward.hidden_dim == 64


def test_yaml_names_components_never_import_paths(registries):
    text = to_yaml(_lm(), registries)
    data = yaml.safe_load(text)
    assert data["type"] == "causal_lm"
    assert data["final_norm"]["type"] == "layer_norm"
    assert data["decoder"]["layer"]["feed_forward"]["activation"] == "silu"
    assert data["param_dtype"] == "bfloat16"
    assert "axcore." not in text and "klass" not in text


def test_yaml_merges_onto_a_base(registries):
    base = _lm()
    cfg = from_yaml("dim: 32\ndecoder:\n  layer:\n    dropout_rate: 0.1\n", registries, base)
    assert cfg.dim == 32 and cfg.decoder.layer.dropout_rate == 0.1
    assert cfg.decoder.layer.feed_forward.hidden_dim == 16  # Untouched fields kept.
    assert base.dim == 8  # The base is not modified.


def test_yaml_type_switch_starts_from_new_default(registries):
    cfg = from_yaml("decoder:\n  type: repeated_transformer\n", registries, _lm())
    assert cfg.decoder.klass is RepeatedTransformer
    assert cfg.decoder.layer.self_attention.num_heads is not None


def test_unknown_component_lists_registered(registries):
    with pytest.raises(UnknownComponentError, match=r"'rms_nrom'.*did you mean 'rms_norm'"):
        from_yaml("final_norm:\n  type: rms_nrom\n", registries, _lm())


def test_yaml_field_typo_names_path_and_suggests(registries):
    with pytest.raises(UnknownFieldError, match=r"'decoder\.layer\.dropout_rat'.*'dropout_rate'"):
        from_yaml("decoder:\n  layer:\n    dropout_rat: 0.1\n", registries, _lm())


def test_yaml_is_read_with_a_safe_loader(registries, tmp_path):
    marker = tmp_path / "pwned"
    evil = f"dim: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(ConfigError, match="Invalid YAML"):
        from_yaml(evil, registries, _lm())
    assert not marker.exists()


def test_flat_dump_lines_and_semantics(registries):
    text = dump_flat(_lm(), registries)
    lines = dict(line.split(": ", 1) for line in text.splitlines())
    assert lines["type"] == "causal_lm"
    assert lines["decoder.layer.self_attention.num_kv_heads"] == "1"
    assert lines["final_norm.type"] == "layer_norm"
    assert lines["final_norm.eps"] == "0.001"
    assert lines["decoder.layer.feed_forward.linear.weight_axes"] == "[null, null]"
    assert len(lines) == len(text.splitlines())  # Paths are unique.
    assert flatten(_lm(), registries)[0] == ("type", "causal_lm")


def test_flat_dump_is_stable_across_processes():
    code = (
        "from axcore.experiment.builtins import builtin_registries\n"
        "from axcore.config import dump_flat\n"
        "from axcore.layers import CausalLM\n"
        "print(dump_flat(CausalLM.default_config().set(vocab_size=5, dim=4, num_layers=2), builtin_registries()), end='')\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu", "PATH": ""}).stdout
        for seed in ("1", "2")
    ]
    assert runs[0] == runs[1] and "vocab_size: 5" in runs[0]


def test_overrides_are_yaml_typed_and_validated(registries):
    cfg = apply_overrides(
        _lm(),
        ["num_layers=2", "decoder.layer.dropout_rate=0.25", "lm_head=null", "z_loss_scale=1"],
        registries,
    )
    assert cfg.num_layers == 2 and cfg.decoder.layer.dropout_rate == 0.25
    assert cfg.lm_head is None and cfg.z_loss_scale == 1.0


def test_override_into_list_element_and_type(registries):
    cfg = _lm()
    cfg.decoder.layer = [cfg.decoder.layer.clone() for _ in range(4)]
    new = apply_overrides(cfg, ["decoder.layer[1].feed_forward.hidden_dim=99", "final_norm.type=rms_norm"], registries)
    assert [layer.feed_forward.hidden_dim for layer in new.decoder.layer] == [16, 99, 16, 16]
    assert new.final_norm.klass.__name__ == "RMSNorm"


@pytest.mark.parametrize(
    "override,error,pattern",
    [
        ("num_layres=2", UnknownFieldError, r"'num_layres'.*did you mean 'num_layers'"),
        ("decoder.layer.self_atention.num_heads=4", UnknownFieldError, "did you mean 'self_attention'"),
        ("num_layers=two", ConfigTypeError, r"'num_layers' expects int"),
        ("decoder.layer.feed_forward.activation=swish", ConfigTypeError, r"activation.*one of"),
        ("num_layers", ConfigError, "PATH=VALUE"),
        ("decoder.layer[x].dim=1", ConfigError, "malformed"),
        ("decoder.layer[7].input_dim=1", ConfigError, "out of range|has no field|expects"),
    ],
)
def test_override_errors(registries, override, error, pattern):
    with pytest.raises(error, match=pattern):
        apply_overrides(_lm(), [override], registries)


def test_exponent_floats_without_a_dot_are_floats(registries):
    cfg = apply_overrides(_lm(), ["z_loss_scale=1e-4"], registries)
    assert cfg.z_loss_scale == 1e-4
    assert from_yaml("z_loss_scale: 2E3\n", registries, _lm()).z_loss_scale == 2000.0
