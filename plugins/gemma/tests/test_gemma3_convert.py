"""The gemma plugin's `gemma3_text` (Gemma 3 text models) against transformers (checks in axcore_hf.testing).

Tiny model: 3 layers of types local, local, global (window 6 < the 24 tokens), RoPE
base 10000 on local and 1e6 on global layers (`rope_parameters` per layer type), QK-norm
and sandwich norms `x * (1 + w)`, 4 query heads over 2 kv heads (head_dim 16),
`query_pre_attn_scalar` 24, no soft-caps, GeGLU, embeddings scaled by sqrt(64), tied.
"""

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from axcore_hf import testing as checks  # noqa: E402

TINY = dict(
    vocab_size=260, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-6,
)
TYPES = ["sliding_attention", "sliding_attention", "full_attention"]


def gemma3(**changes):
    fields = dict(TINY, query_pre_attn_scalar=24, sliding_window=6, layer_types=TYPES, tie_word_embeddings=True)
    return transformers.Gemma3TextConfig(**{**fields, **changes})


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    without = lambda: gemma3(layer_types=["full_attention"] * 3)  # noqa: E731 (no window)
    return checks.imported(checks.Family(gemma3, without), tmp_path_factory.mktemp("g3"))


def test_logits_match_transformers(family):
    ours = checks.check_logits(family)
    config = checks.load_model(family.run).experiment
    decoder = config.config.model.decoder
    assert decoder.layer.self_attention.q_norm.scale_offset == 1.0 and decoder.layer_types == TYPES
    assert dict(decoder.attention_types["sliding_attention"]) == {"sliding_window": 6, "position_embedding.theta": 1e4}
    assert config.settings["rope"].theta == 1e6
    # One RoPE base for every layer gives other logits: the per-type base matters.
    one_base = {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    other = checks.build(gemma3(rope_parameters=one_base))
    other.load_state_dict(family.model.state_dict())
    assert checks.np.abs(ours - checks.hf_logits(other)).max() > 1e-2


def test_greedy_generation_matches_transformers(family, capsys):
    checks.check_generation(family, capsys)


def test_eval_gives_transformers_loss(family, tmp_path, capsys):
    checks.check_eval(family, tmp_path, capsys)


def test_export_loads_in_transformers(family, tmp_path):
    exported = checks.check_export(family, tmp_path / "out")
    assert exported.config.layer_types == TYPES
    assert exported.config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4


def test_one_fine_tuning_step_runs_from_the_import(family, tmp_path, capsys):
    checks.check_fine_tuning(family, tmp_path, capsys)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_is_bit_identical(tmp_path, dtype):
    checks.check_round_trip(gemma3(), dtype, tmp_path)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"mlp_bias": True}, "'mlp_bias' is true"),
        ({"use_bidirectional_attention": True}, "'use_bidirectional_attention' is true"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
         "'layer_types' entry 1 is 'chunked_attention'"),
        ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope type 'linear'"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line(tmp_path, capsys, changes, expected):
    checks.check_refused({**gemma3().to_dict(), **changes}, tmp_path, capsys, expected)


@pytest.mark.slow  # Compiles the engine's program (about 10-30 s on 2 loaded cores).
def test_engine_matches_transformers(family):
    checks.check_engine(family.model, family.run)
