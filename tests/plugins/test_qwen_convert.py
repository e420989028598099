"""The qwen plugin: Qwen2 and Qwen3 (dense) checkpoints <-> axcore, against transformers.

Tiny models with random weights (biases and norms drawn too), float32, eager
attention, 3 layers, 4 query heads over 2 kv heads. Qwen2: q/k/v biases, untied head,
`use_sliding_window` with `max_window_layers=1` (layers 1 and 2 slide, window 6).
Qwen3: QK-norm, tied embeddings, `attention_bias` (q/k/v/o biases) and an explicit
`layer_types` of sliding and full layers. Sequences of 24 tokens (> the window), two
per batch. Parity tolerance 1e-4 on logits of magnitude ~5.
"""

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import axcore  # noqa: E402
from axcore.cli import main  # noqa: E402
from axcore.run_loading import load_model  # noqa: E402

from axcore_hf import axcore_to_hf, hf_to_axcore  # noqa: E402
from axcore_hf.files import read_tensors  # noqa: E402

TOLERANCE = 1e-4
SEQ = 24
WINDOW = 6
TINY = dict(
    vocab_size=260, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
)
FAMILIES = {
    "qwen2": lambda: transformers.Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=False
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        **TINY, use_sliding_window=True, sliding_window=WINDOW, attention_bias=True, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}
IDS = np.random.default_rng(0).integers(0, TINY["vocab_size"], size=(2, SEQ))


def _build(config, dtype=torch.float32):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.15)
    return model.to(dtype).eval()


def _hf_logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _axcore_logits(run, step=None):
    loaded = load_model(run, step=step)
    return np.asarray(axcore.functional(loaded.model, loaded.params, (IDS,), None, False, method="logits")[0])


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request, tmp_path_factory):
    """(family, HF model, HF dir, imported run dir)."""
    root = tmp_path_factory.mktemp(request.param)
    model = _build(FAMILIES[request.param]())
    model.save_pretrained(root / "hf")
    hf_to_axcore(root / "hf", root / "run", seq_len=32)
    return request.param, model, root / "hf", root / "run"


def test_logits_match_transformers_and_the_window_matters(imported):
    family, model, _, run = imported
    ours = _axcore_logits(run)
    diff = np.abs(ours - _hf_logits(model)).max()
    assert diff < TOLERANCE, diff
    decoder = load_model(run).experiment.config.model.decoder
    attention = decoder.layer.self_attention
    assert attention.qkv_bias and attention.output_bias == (family == "qwen3")
    assert (attention.q_norm is not None) == (family == "qwen3")
    assert {name: dict(fields) for name, fields in decoder.attention_types.items()}["sliding_attention"] == {
        "sliding_window": WINDOW
    }
    # The same weights without the windows: transformers computes other logits, so parity above
    # means each layer's window is transformers' `i - j < window`.
    unwindowed = _build(FAMILIES[family]().__class__(**{**model.config.to_dict(), "use_sliding_window": False,
                                                       "layer_types": None}))
    unwindowed.load_state_dict(model.state_dict())
    assert np.abs(ours - _hf_logits(unwindowed)).max() > 1e-2


def test_greedy_generation_matches_transformers(imported, capsys):
    """`axcore generate` (KV cache; prompts of 5 and 14 tokens plus 16 new ones pass the window)."""
    _, model, _, run = imported
    prompts = ["hello", "Good morning, "]
    args = ["generate", str(run), "--max-new-tokens", "16", "--json", *[a for p in prompts for a in ("--prompt", p)]]
    assert main(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for prompt, record in zip(prompts, records):
        ids = torch.tensor([list(prompt.encode())])
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        assert record["tokens"] == expected.tolist()


def test_export_loads_in_transformers_with_the_same_logits(imported, tmp_path):
    family, model, hf_dir, run = imported
    axcore_to_hf(run, tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert exported.config.model_type == family and exported.config.layer_types == model.config.layer_types
    assert np.abs(_hf_logits(exported) - _axcore_logits(run)).max() < TOLERANCE
    assert sorted(read_tensors(tmp_path / "out")) == sorted(read_tensors(hf_dir))


def test_one_fine_tuning_step_runs_from_the_import(imported, tmp_path, capsys):
    _, model, hf_dir, _ = imported
    run = tmp_path / "run"
    assert main(["convert", "hf-to-axcore", str(hf_dir), str(run), "--seq-len", "32"]) == 0
    overrides = ["trainer.max_steps=1", "trainer.eval_every=0", "trainer.sample.num_tokens=0", "input.batch_size=2",
                 "trainer.learner.schedule.warmup_steps=0", "trainer.metrics_writers=[]"]
    assert main(["train", str(run / "config.yaml"), *[a for o in overrides for a in ("--set", o)]]) == 0
    assert "Resumed from step 0" in capsys.readouterr().err
    assert np.abs(_axcore_logits(run, step=1) - _hf_logits(model)).max() > 1e-3  # The step changed the model.


@pytest.mark.parametrize("family, dtype", [("qwen2", "bfloat16"), ("qwen3", "float16"), ("qwen3", "float32")])
def test_round_trip_is_bit_identical(tmp_path, family, dtype):
    _build(FAMILIES[family](), getattr(torch, dtype)).save_pretrained(tmp_path / "hf")
    hf_to_axcore(tmp_path / "hf", tmp_path / "run", seq_len=32)
    axcore_to_hf(tmp_path / "run", tmp_path / "out")
    before, after = read_tensors(tmp_path / "hf"), read_tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    want = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    for name, tensor in before.items():
        assert tensor.dtype == after[name].dtype == want and tensor.tobytes() == after[name].tobytes(), name


def _bad_dir(tmp_path, family, edit):
    directory = tmp_path / "bad"
    directory.mkdir()
    data = FAMILIES[family]().to_dict()
    edit(data)
    (directory / "config.json").write_text(json.dumps(data))
    return directory


@pytest.mark.parametrize(
    "family, edit, expected",
    [
        ("qwen2", lambda c: c.update(mlp_bias=True), "'mlp_bias' is true"),
        ("qwen3", lambda c: c.update(mlp_bias=True, attention_bias=True), "'mlp_bias' is true"),
        ("qwen3", lambda c: c.update(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
         "'layer_types' entry 1 is 'chunked_attention'"),
        ("qwen2", lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
         "rope type 'dynamic'"),
        ("qwen2", lambda c: c.update(use_sliding_window=False), "'layer_types' lists sliding_attention"),
        ("qwen3", lambda c: c.update(hidden_act="gelu"), "'hidden_act' is 'gelu'"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line(tmp_path, capsys, family, edit, expected):
    source = _bad_dir(tmp_path, family, edit)
    assert main(["convert", "hf-to-axcore", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "config.json" in err, err


def test_no_qwen_code_in_the_core():
    core = pathlib.Path(axcore.__file__).parent
    words = ("qwen", "max_window_layers", "use_sliding_window", "sliding_attention", "full_attention")
    found = [(p.name, w) for p in core.rglob("*.py") for w in words if w in p.read_text().lower()]
    assert not found, found
