"""The gemma plugin's `gemma2` against transformers (checks in axcore_hf.testing).

Tiny model: 3 layers alternating local and global (transformers' default pattern:
sliding, full, sliding; window 6 < the 24 tokens), 4 query heads over 2 kv heads
(head_dim 16), `query_pre_attn_scalar` 24 (not head_dim, so the scale is tested),
attention soft-cap 5 and final soft-cap 3 (both bite: logits reach ~5), sandwich norms
`x * (1 + w)`, GeGLU with tanh GELU, embeddings scaled by sqrt(64), tied embeddings.
"""

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from axcore_hf import testing as checks  # noqa: E402

TINY = dict(
    vocab_size=260, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
)


def gemma2(**changes):
    fields = dict(TINY, query_pre_attn_scalar=24, sliding_window=6, attn_logit_softcapping=5.0,
                  final_logit_softcapping=3.0, tie_word_embeddings=True)
    return transformers.Gemma2Config(**{**fields, **changes})


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    without = lambda: gemma2(attn_logit_softcapping=None, final_logit_softcapping=None)  # noqa: E731
    return checks.imported(checks.Family(gemma2, without), tmp_path_factory.mktemp("g2"))


def test_logits_match_transformers(family):
    ours = checks.check_logits(family)
    assert checks.np.abs(ours).max() > 2.0  # The final cap (3) bends these logits.
    model = checks.load_model(family.run).experiment.config.model
    attention = model.decoder.layer.self_attention
    assert (attention.softcap, model.logits_softcap, attention.scale) == (5.0, 3.0, 24**-0.5)
    assert model.scale_embeddings and model.decoder.layer.post_norms and model.final_norm.scale_offset == 1.0
    assert model.decoder.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    # The window matters too: transformers without it computes other logits.
    other = checks.build(gemma2(layer_types=["full_attention"] * 3))
    other.load_state_dict(family.model.state_dict())
    assert checks.np.abs(ours - checks.hf_logits(other)).max() > 1e-2


def test_greedy_generation_matches_transformers(family, capsys):
    checks.check_generation(family, capsys)


def test_eval_gives_transformers_loss(family, tmp_path, capsys):
    checks.check_eval(family, tmp_path, capsys)


def test_export_loads_in_transformers(family, tmp_path):
    exported = checks.check_export(family, tmp_path / "out")
    assert exported.config.layer_types == family.model.config.layer_types
    assert (exported.config.query_pre_attn_scalar, exported.config.final_logit_softcapping) == (24, 3.0)


def test_one_fine_tuning_step_runs_from_the_import(family, tmp_path, capsys):
    checks.check_fine_tuning(family, tmp_path, capsys)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_is_bit_identical(tmp_path, dtype):
    checks.check_round_trip(gemma2(tie_word_embeddings=False), dtype, tmp_path)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"attention_bias": True}, "'attention_bias' is true"),
        ({"hidden_activation": "relu"}, "'hidden_activation' is 'relu'"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'dynamic'"),
        ({"layer_types": ["sliding_attention", "local", "full_attention"]}, "'layer_types' entry 1 is 'local'"),
        ({"final_logit_softcapping": -1.0}, "'final_logit_softcapping' is -1.0"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line(tmp_path, capsys, changes, expected):
    checks.check_refused({**gemma2().to_dict(), **changes}, tmp_path, capsys, expected)


def test_no_gemma_code_in_the_core():
    words = ("gemma", "query_pre_attn_scalar", "softcapping", "pre_feedforward", "sliding_attention")
    assert not checks.core_mentions(words)


def test_scanned_import_repeats_one_period_of_the_pattern(tmp_path):
    """--scan: a block of (local, global) scanned twice computes transformers' logits and exports back."""
    model = checks.build(gemma2(num_hidden_layers=4))
    model.save_pretrained(tmp_path / "hf")
    checks.hf_to_axcore(tmp_path / "hf", tmp_path / "run", scan=True, seq_len=32)
    loaded = checks.load_model(tmp_path / "run")
    block = loaded.experiment.config.model.decoder.layer
    assert block.layer_types == ["sliding_attention", "full_attention"]
    assert loaded.params["decoder"]["layer"]["layer0"]["self_attention"]["wq"].shape == (2, 64, 4, 16)
    ours = checks.axcore_logits(tmp_path / "run")
    assert checks.np.abs(ours - checks.hf_logits(model)).max() < checks.TOLERANCE
    checks.axcore_to_hf(tmp_path / "run", tmp_path / "out")
    exported = checks.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert exported.config.layer_types == model.config.layer_types
    assert checks.np.abs(checks.hf_logits(exported.eval()) - ours).max() < checks.TOLERANCE
    with pytest.raises(checks.ConversionError, match="no repetition of a shorter pattern"):
        checks.hf_to_axcore(family_dir(tmp_path), tmp_path / "run3", scan=True)


def family_dir(tmp_path):
    """A 3-layer (local, global, local) config: no repeating period."""
    directory = tmp_path / "three"
    directory.mkdir()
    (directory / "config.json").write_text(checks.json.dumps(gemma2().to_dict()))
    return directory


@pytest.mark.slow  # Compiles the engine's program (about 10-30 s on 2 loaded cores).
def test_engine_matches_transformers(family):
    checks.check_engine(family.model, family.run)
