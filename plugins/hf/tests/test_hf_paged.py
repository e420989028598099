"""Llama and Mistral models imported through this plugin's converters run on the inference engine's paged KV
cache: chunked prefills and decode steps of mixed rows give the full forward's logits (unrolled and scanned)."""

import pytest

from axcore.layers.transformer import RepeatedTransformer
from axcore.testing import check_experiment_paged

from axcore_hf.llama import LlamaConverter
from axcore_hf.patterns import scanned_decoder


@pytest.mark.parametrize("mistral, scan", [(False, False), (True, True)], ids=["llama", "mistral-scanned"])
def test_paged_decoding_matches_the_full_forward(tmp_path, mistral, scan):
    converter = LlamaConverter(model_type="mistral", sliding_window=True) if mistral else LlamaConverter()
    data = converter.experiment(converter.example_config(), "config.json")
    if scan:
        data["model"]["decoder"] = scanned_decoder(data["model"]["decoder"], data["model"]["num_layers"], "x")
    model = check_experiment_paged(data, tmp_path)
    assert isinstance(model.decoder, RepeatedTransformer) == scan
    # Mistral's window (4 tokens) is shorter than the 12 checked, so it masks.
    window = (model.decoder.layer if scan else model.decoder.layer0).self_attention.config.sliding_window
    assert window == (4 if mistral else None)
