"""A tiny random transformers Llama imported as an axcore run (offline), for tests that serve it.

    run_dir = tiny_llama_run(tmp_path)      # 2 layers, hidden 32, GQA 4/2 heads, the run's byte tokenizer
"""

from __future__ import annotations

from pathlib import Path

# The imported run's byte tokenizer has 256 ids; the model's vocabulary matches it.
VOCAB = 256


def tiny_llama_run(root: Path):
    """`(transformers model, run directory)` of a 2-layer random Llama saved under `root / "hf"` and imported
    with `axcore_hf.testing.hf_to_axcore` into `root / "run"` (nothing downloaded)."""
    import transformers

    from axcore_hf import testing as hf_testing

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    model = hf_testing.build(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(root / "hf")
    hf_testing.hf_to_axcore(root / "hf", root / "run", seq_len=32)
    return model, root / "run"
