"""The qwen plugin's `qwen3` (dense) against transformers (checks in axcore_hf.testing).

Tiny model: 3 layers, 4 query heads over 2 kv heads (head_dim 16), QK-norm, tied
embeddings, `attention_bias` (q/k/v and o biases) and an explicit `layer_types`
(sliding, full, sliding; window 6 < the 24 tokens); untied in the round trip.
"""

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from axcore_hf import testing as checks  # noqa: E402

TINY = dict(
    vocab_size=260, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
)
TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def qwen3(**changes):
    fields = dict(TINY, use_sliding_window=True, sliding_window=6, attention_bias=True, tie_word_embeddings=True,
                  layer_types=TYPES)
    return transformers.Qwen3Config(**{**fields, **changes})


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    # Off: the windows (the QK-norm and biases are weights, drawn at random, so parity alone tests them).
    without = checks.Family(qwen3, lambda: qwen3(use_sliding_window=False, layer_types=["full_attention"] * 3))
    return checks.imported(without, tmp_path_factory.mktemp("q3"))


def test_logits_match_transformers(family):
    checks.check_logits(family)
    model = checks.load_model(family.run).experiment.config.model
    attention = model.decoder.layer.self_attention
    assert attention.qkv_bias and attention.output_bias and attention.q_norm.eps == 1e-6
    assert model.lm_head is None and model.decoder.layer_types == TYPES


def test_greedy_generation_matches_transformers(family, capsys):
    checks.check_generation(family, capsys)


def test_eval_gives_transformers_loss(family, tmp_path, capsys):
    checks.check_eval(family, tmp_path, capsys)


def test_export_loads_in_transformers(family, tmp_path):
    exported = checks.check_export(family, tmp_path / "out")
    assert exported.config.layer_types == TYPES and exported.config.attention_bias


def test_one_fine_tuning_step_runs_from_the_import(family, tmp_path, capsys):
    checks.check_fine_tuning(family, tmp_path, capsys)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_is_bit_identical(tmp_path, dtype):
    checks.check_round_trip(qwen3(tie_word_embeddings=False, attention_bias=False), dtype, tmp_path)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"mlp_bias": True}, "'mlp_bias' is true"),
        ({"hidden_act": "gelu"}, "'hidden_act' is 'gelu'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type 'longrope'"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "'layer_types' is"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line(tmp_path, capsys, changes, expected):
    checks.check_refused({**qwen3().to_dict(), **changes}, tmp_path, capsys, expected)


@pytest.mark.slow  # Compiles the engine's program (about 10-30 s on 2 loaded cores).
def test_engine_matches_transformers(family):
    checks.check_engine(family.model, family.run)
