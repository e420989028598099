"""Gemma 2 (attention and final soft-caps, local/global layers, sandwich norms) and Gemma 3 (QK-norm, a RoPE base
per layer type) models from this plugin's converters run on the inference engine's paged KV cache: chunked
prefills and decode steps of mixed rows give the full forward's logits, unrolled and with the local/global pattern
in a scanned unit."""

import pytest

from axcore.testing import check_experiment_paged

from axcore_gemma.gemma import GEMMA2, GEMMA3
from axcore_hf.patterns import scanned_decoder


@pytest.mark.parametrize(
    "converter, scan", [(GEMMA2, False), (GEMMA3, False), (GEMMA2, True)], ids=["gemma2", "gemma3", "gemma2-scanned"]
)
def test_paged_decoding_matches_the_full_forward(tmp_path, converter, scan):
    config = converter.example_config()  # Local layers' window 4 < the 12 tokens checked.
    if converter is GEMMA2:  # Caps small enough to bend the random model's logits.
        config.update(attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
    if scan:  # Two repeats of the (local, global) unit.
        config.update(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
    data = converter.experiment(config, "config.json")
    if scan:
        data["model"]["decoder"] = scanned_decoder(data["model"]["decoder"], data["model"]["num_layers"], "x")
    model = check_experiment_paged(data, tmp_path)
    unit = model.decoder.layer if scan else model.decoder
    local, full = unit.layer0.self_attention.config, unit.layer1.self_attention.config
    assert (local.sliding_window, full.sliding_window) == (4, None)
    if converter is GEMMA2:
        assert local.softcap == 1.0 and model.config.logits_softcap == 2.0
    else:
        assert local.q_norm is not None
        assert local.position_embedding.theta != full.position_embedding.theta
