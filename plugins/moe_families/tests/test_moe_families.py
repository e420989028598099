"""Plugin moe_families: Mixtral and Qwen3-MoE from and to Hugging Face, against transformers.

Tiny random models (moe_family_models.py: 2 layers, GQA, 4 experts, top-2, float32, eager
attention). Logit parity over 2 x 24 tokens within 1e-4; greedy generation through
`axcore generate` (KV cache) against transformers' `generate`; `axcore eval` against
transformers' cross-entropy. Exports, round trips and refusals: test_moe_families_convert.py;
training: test_moe_families_training.py.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("axcore_moe_families")

from moe_family_models import CONFIGS, TOLERANCE, axcore_logits, hf_logits, save_hf  # noqa: E402

from axcore.cli import main  # noqa: E402
from axcore.inference.run_loading import load_model  # noqa: E402

from axcore_hf import axcore_to_hf, hf_to_axcore  # noqa: E402
from axcore_hf.testing import check_engine  # noqa: E402


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    """(model_type, HF model, HF dir, imported run dir) of each family's tiny model."""
    root = tmp_path_factory.mktemp(request.param)
    model = save_hf(root / "hf", CONFIGS[request.param]())
    hf_to_axcore(root / "hf", root / "run")
    return request.param, model, root / "hf", root / "run"


def test_logits_match_transformers(family):
    name, model, _, run = family
    ours = axcore_logits(run)
    diff = np.abs(ours - hf_logits(model)).max()
    assert diff < TOLERANCE, diff  # Measured ~5e-6 (logits up to ~5).
    loaded = load_model(run)
    moe = loaded.experiment.config.model.decoder.layer[1].feed_forward
    assert (moe.num_experts, moe.top_k, moe.capacity_factor) == (4, 2, None)
    assert loaded.params["decoder"]["layer1"]["feed_forward"]["expert"]["down_proj"]["weight"].shape == (4, 96, 64)
    if name == "qwen3_moe":  # The family's features change transformers' logits, so the parity above can fail.
        assert moe.gates.value == "probabilities"
        for layer in model.model.layers:
            layer.mlp.gate.norm_topk_prob = True
        renormalized = hf_logits(model)
        for layer in model.model.layers:
            layer.mlp.gate.norm_topk_prob = False
        assert np.abs(ours - renormalized).max() > 1e-2
        assert loaded.params["decoder"]["layer0"]["self_attention"]["q_norm"]["scale"].shape == (16,)
    else:
        assert moe.gates.value == "renormalized"


def test_scanned_import_computes_the_same_logits(family, tmp_path):
    _, model, hf_dir, _ = family
    hf_to_axcore(hf_dir, tmp_path / "scan", scan=True)
    params = load_model(tmp_path / "scan").params["decoder"]["layer"]["layer0"]
    assert params["feed_forward"]["expert"]["gate_proj"]["weight"].shape == (2, 4, 64, 96)  # [layers, experts, d, I]
    assert np.abs(axcore_logits(tmp_path / "scan") - hf_logits(model)).max() < TOLERANCE


def test_generate_matches_transformers_greedy_generate(family, capsys):
    """`axcore generate` (KV cache; two prompts of different lengths in one batch) against transformers'
    greedy `generate` with its own cache, 16 tokens per prompt."""
    _, model, _, run = family
    prompts = ["hello", "Good morning, "]
    args = ["generate", str(run), "--max-new-tokens", "16", "--json", *[a for p in prompts for a in ("--prompt", p)]]
    assert main(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for prompt, record in zip(prompts, records):
        ids = torch.tensor([list(prompt.encode())])
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        assert record["tokens"] == expected.tolist()


@pytest.mark.parametrize(
    "name, switch", [("mixtral", {}), ("qwen3_moe", {"use_sliding_window": True})], ids=["mixtral", "qwen3_moe"]
)
def test_sliding_window_in_logits_and_the_kv_cache(name, switch, tmp_path, capsys):
    """A window of 6 over 24 tokens (and over prompt + 16 generated tokens in the cache), every layer."""
    model = save_hf(tmp_path / "hf", CONFIGS[name](sliding_window=6, **switch))
    hf_to_axcore(tmp_path / "hf", tmp_path / "run")
    layers = load_model(tmp_path / "run").experiment.config.model.decoder.layer
    assert [layer.self_attention.sliding_window for layer in layers] == [6, 6]
    ours = axcore_logits(tmp_path / "run")
    assert np.abs(ours - hf_logits(model)).max() < TOLERANCE
    prompt = "Good morning, "
    assert main(["generate", str(tmp_path / "run"), "--max-new-tokens", "16", "--json", "--prompt", prompt]) == 0
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"] == expected.tolist()
    model.config.sliding_window = None  # The window matters at this length.
    assert np.abs(ours - hf_logits(model)).max() > 1e-2
    axcore_to_hf(tmp_path / "run", tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert exported.config.sliding_window == 6 and np.abs(ours - hf_logits(exported)).max() < TOLERANCE


def test_eval_loss_is_transformers_cross_entropy(family, tmp_path, capsys):
    _, model, _, run = family
    text = "The quick brown fox jumps over the lazy dog.\n"  # One document: 45 bytes, 44 predicted.
    (tmp_path / "text.txt").write_text(text)
    assert main(["eval", str(run), "--data", str(tmp_path / "text.txt"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    ids = torch.tensor([list(text.encode())])
    with torch.no_grad():
        expected = model(ids, labels=ids).loss.item()
    assert result["tokens"] == len(text) - 1 and abs(result["loss"] - expected) < 1e-4, (result, expected)


@pytest.mark.slow  # Compiles the engine's program (about 10-30 s on 2 loaded cores).
def test_engine_matches_transformers(family):
    """The inference engine's greedy tokens and log-probabilities (axcore_hf.testing.check_engine: mixed lengths,
    requests joining mid-flight, a prefix-cache hit, preemptions, n = 3) equal transformers'."""
    _, model, _, run = family
    check_engine(model, run)
