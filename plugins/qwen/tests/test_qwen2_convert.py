"""The qwen plugin's `qwen2` (Qwen2, Qwen2.5) against transformers (checks in axcore_hf.testing).

Tiny model: 3 layers, 4 query heads over 2 kv heads (head_dim 16), q/k/v biases, untied
head, `use_sliding_window` with `max_window_layers=1` (layers 1 and 2 slide, window 6
< the 24 tokens), tied embeddings in the round trip.
"""

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from axcore_hf import testing as checks  # noqa: E402

TINY = dict(
    vocab_size=260, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
)


def qwen2(**changes):
    fields = dict(TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1, tie_word_embeddings=False)
    return transformers.Qwen2Config(**{**fields, **changes})


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return checks.imported(checks.Family(qwen2, lambda: qwen2(use_sliding_window=False)), tmp_path_factory.mktemp("q2"))


def test_logits_match_transformers(family):
    checks.check_logits(family)
    decoder = checks.load_model(family.run).experiment.config.model.decoder
    assert decoder.layer.self_attention.qkv_bias and not decoder.layer.self_attention.output_bias
    assert decoder.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert dict(decoder.attention_types["sliding_attention"]) == {"sliding_window": 6}


def test_greedy_generation_matches_transformers(family, capsys):
    checks.check_generation(family, capsys)


def test_eval_gives_transformers_loss(family, tmp_path, capsys):
    checks.check_eval(family, tmp_path, capsys)


def test_export_loads_in_transformers(family, tmp_path):
    exported = checks.check_export(family, tmp_path / "out")
    assert exported.config.layer_types == family.model.config.layer_types
    assert (exported.config.sliding_window, exported.config.max_window_layers) == (6, 1)


def test_one_fine_tuning_step_runs_from_the_import(family, tmp_path, capsys):
    checks.check_fine_tuning(family, tmp_path, capsys)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_is_bit_identical(tmp_path, dtype):
    checks.check_round_trip(qwen2(tie_word_embeddings=True, use_sliding_window=False), dtype, tmp_path)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"mlp_bias": True}, "'mlp_bias' is true"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'dynamic'"),
        ({"layer_types": ["full_attention", "sliding_attention", "chunked_attention"]},
         "'layer_types' entry 2 is 'chunked_attention'"),
        ({"use_sliding_window": False, "layer_types": ["sliding_attention"] * 3}, "'layer_types' lists sliding_attention"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line(tmp_path, capsys, changes, expected):
    checks.check_refused({**qwen2().to_dict(), **changes}, tmp_path, capsys, expected)


def test_no_qwen2_code_in_the_core():
    assert not checks.core_mentions(("qwen", "max_window_layers", "use_sliding_window", "sliding_attention"))


@pytest.mark.slow  # Compiles the engine's program (about 10-30 s on 2 loaded cores).
def test_engine_matches_transformers(family):
    checks.check_engine(family.model, family.run)
