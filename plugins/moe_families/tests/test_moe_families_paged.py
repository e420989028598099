"""Mixtral and Qwen3-MoE models from this plugin's converters (experts top-2 of 4, GQA; Qwen3-MoE with QK-norm and
unnormalized gates) run on the inference engine's paged KV cache: chunked prefills and decode steps of mixed rows
give the full forward's logits."""

import pytest

from axcore.testing import check_experiment_paged

from axcore_moe_families.converter import MIXTRAL, QWEN3_MOE, MoEConverter

COMMON = dict(
    vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, num_experts_per_tok=2,
)
CONFIGS = {
    "mixtral": dict(COMMON, model_type="mixtral", intermediate_size=48, num_local_experts=4),
    "qwen3_moe": dict(COMMON, model_type="qwen3_moe", intermediate_size=64, moe_intermediate_size=48, num_experts=4,
                      head_dim=8, norm_topk_prob=False),
}


@pytest.mark.parametrize("family", [MIXTRAL, QWEN3_MOE], ids=["mixtral", "qwen3_moe"])
def test_paged_decoding_matches_the_full_forward(tmp_path, family):
    data = MoEConverter(family).experiment(CONFIGS[family.model_type], "config.json")
    model = check_experiment_paged(data, tmp_path)
    layer = model.decoder.layer0
    assert layer.feed_forward.config.num_experts == 4 and layer.feed_forward.config.capacity_factor is None
    assert (layer.self_attention.config.q_norm is not None) == (family is QWEN3_MOE)
