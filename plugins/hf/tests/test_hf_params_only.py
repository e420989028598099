"""An import (`axcore convert hf-to-axcore`) writes the parameters only: no optimizer state.

The tiny random Llama of test_hf_convert (vocab 260, hidden 64, 2 layers) is imported;
its step 0 is listed (the orbax index) and weighed against the safetensors it came from.
"""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from axcore.inference.run_loading import load_model  # noqa: E402

from axcore_hf import hf_to_axcore  # noqa: E402

TINY = dict(vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=64)


def test_import_checkpoint_holds_parameters_only(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model.save_pretrained(tmp_path / "hf")
    hf_to_axcore(tmp_path / "hf", tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "0"
    meta = json.loads((step / "meta" / "metadata").read_text())
    paths = [e["path"] for e in meta["index"]]
    assert paths and all(p.startswith("['params']") for p in paths), [p for p in paths if "params" not in p]
    assert meta["metadata"]["params_only"] is True and meta["metadata"]["step"] == 0
    # One float32 copy of the weights (no Adam moments, which would triple it).
    weights = sum(int(np.prod(t.shape)) * 4 for t in model.state_dict().values())
    on_disk = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    assert weights <= on_disk < 1.2 * weights, (weights, on_disk)
    loaded = load_model(tmp_path / "run")
    assert loaded.step == 0 and sum(x.size * 4 for x in jax.tree.leaves(loaded.params)) == weights
