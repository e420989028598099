"""Qwen2 (attention biases, sliding windows on the layers after the first) and Qwen3 (QK-norm) models from this
plugin's converters run on the inference engine's paged KV cache: chunked prefills and decode steps of mixed rows
give the full forward's logits."""

import pytest

from axcore.testing import check_experiment_paged

from axcore_qwen.qwen import QWEN2, QWEN3


@pytest.mark.parametrize("converter", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
def test_paged_decoding_matches_the_full_forward(tmp_path, converter):
    model = check_experiment_paged(converter.experiment(converter.example_config(), "config.json"), tmp_path)
    first, second = model.decoder.layer0.self_attention.config, model.decoder.layer1.self_attention.config
    if converter is QWEN2:  # Biases (random in the check) and a window of 4 < 12 tokens on the second layer.
        assert first.qkv_bias and (first.sliding_window, second.sliding_window) == (None, 4)
    else:
        assert first.q_norm is not None and first.k_norm is not None
