"""Tiny random Mixtral and Qwen3-MoE models built by transformers, shared by the moe_families tests.

Each: vocab 260 (the byte tokenizer fits), hidden 64, 2 layers, 4 query heads over 2
key/value heads (GQA), 4 experts of size 96, top-2, float32, eager attention. The
Qwen3-MoE one has QK-norm (always on in the family) and `norm_topk_prob` false, so
its gates do not sum to 1. Weights ~ N(0, 0.15), norm scales ~ N(1, 0.1).
"""

import numpy as np
import torch
import transformers

import axcore
from axcore.inference.run_loading import load_model

# |axcore - transformers| allowed over the logits (float32).
TOLERANCE = 1e-4
COMMON = dict(
    vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-5, num_experts_per_tok=2,
    # No end-of-sequence token: transformers' generate would stop at it, `axcore generate` does not.
    bos_token_id=None, eos_token_id=None,
)
CONFIGS = {
    "mixtral": lambda **kw: transformers.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=4, **kw),
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=128, moe_intermediate_size=96, num_experts=4, head_dim=16, norm_topk_prob=False,
        **kw),
}
# Two sequences of 24 tokens.
IDS = np.random.default_rng(0).integers(0, COMMON["vocab_size"], size=(2, 24))


def save_hf(path, config, dtype=torch.float32):
    """A transformers model of `config` with random weights, saved to `path` (per-expert tensors)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.15)
    model = model.to(dtype).eval()
    model.save_pretrained(path)
    return model


def hf_logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def axcore_logits(run, step=None, ids=IDS):
    loaded = load_model(run, step=step)
    return np.asarray(axcore.functional(loaded.model, loaded.params, (ids,), None, False, method="logits")[0])
