"""Checks every Hugging Face model family plugin runs against transformers (imported by the family
plugins' tests, e.g. plugins/qwen/tests/test_qwen2_convert.py, and the hf plugin's own; each gives a `Family`).

For tests only: it imports torch and transformers (the `test` extra), so the plugin never imports it.

Tiny models with random weights (biases and norms drawn too), float32, eager
attention; logits over `IDS` (2 x 24 tokens), tolerance 1e-4 on logits of magnitude ~5.
`check_engine` runs axcore's inference engine (`axcore.engine`) on an import against transformers.
"""

import copy
import dataclasses
import json
import pathlib
from collections.abc import Callable

import ml_dtypes
import numpy as np
import torch
import transformers

import axcore
from axcore.checkpoint.interop import ConversionError
from axcore.cli import main
from axcore.engine import Engine, EngineConfig
from axcore.engine.requests import EngineStats, GenerationRequest, SamplingParams
from axcore.inference import load_engine
from axcore.inference.run_loading import load_model

from axcore_hf import axcore_to_hf, hf_to_axcore
from axcore_hf.files import read_tensors

__all__ = ["ConversionError", "axcore_to_hf", "hf_to_axcore", "json", "load_model", "np", "transformers"]

TOLERANCE = 1e-4
SEQ = 24
IDS = np.random.default_rng(0).integers(0, 260, size=(2, SEQ))
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@dataclasses.dataclass
class Family:
    """A family under test: its transformers config and, imported, where things are."""

    # A fresh transformers config of the tiny model (vocab 260, so byte prompts are valid ids).
    config: Callable[[], transformers.PretrainedConfig]
    # The transformers config with the family's distinctive feature switched off (same weights).
    without_feature: Callable[[], transformers.PretrainedConfig]
    model: torch.nn.Module | None = None
    hf_dir: pathlib.Path | None = None
    run: pathlib.Path | None = None


def build(config, dtype=torch.float32):
    """A transformers model of `config` with random weights (std 0.15; norm weights 1 +- 0.1)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.15)
    return model.to(dtype).eval()


def hf_logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def axcore_logits(run, step=None):
    loaded = load_model(run, step=step)
    return np.asarray(axcore.functional(loaded.model, loaded.params, (IDS,), None, False, method="logits")[0])


def imported(family: Family, root: pathlib.Path) -> Family:
    """Builds, saves and imports the family's tiny model under `root`."""
    family.model = build(family.config())
    family.model.save_pretrained(root / "hf")
    hf_to_axcore(root / "hf", root / "run", seq_len=32)
    family.hf_dir, family.run = root / "hf", root / "run"
    return family


def check_logits(family: Family) -> np.ndarray:
    """axcore's logits equal transformers'; with the feature off, transformers' differ (the test can fail)."""
    ours = axcore_logits(family.run)
    diff = np.abs(ours - hf_logits(family.model)).max()
    assert diff < TOLERANCE, diff
    other = build(family.without_feature())
    other.load_state_dict(family.model.state_dict())
    assert np.abs(ours - hf_logits(other)).max() > 1e-2
    return ours


def check_generation(family: Family, capsys) -> None:
    """`axcore generate` (KV cache; prompts of 5 and 14 tokens, 16 new ones) equals transformers' greedy generate."""
    prompts = ["hello", "Good morning, "]
    args = ["generate", str(family.run), "--max-new-tokens", "16", "--json", *[a for p in prompts for a in ("--prompt", p)]]
    assert main(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for prompt, record in zip(prompts, records):
        ids = torch.tensor([list(prompt.encode())])
        with torch.no_grad():
            expected = family.model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        assert record["tokens"] == expected.tolist()


def check_eval(family: Family, tmp_path: pathlib.Path, capsys) -> None:
    """`axcore eval` on held-out text gives transformers' mean next-token loss (24 targets, past the windows)."""
    text = "The quick brown fox jumps"  # 25 bytes: one row of 24 targets.
    (tmp_path / "held_out.txt").write_text(text)
    args = ["eval", str(family.run), "--data", str(tmp_path / "held_out.txt"), "--batch-size", "1", "--seq-len", "24"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ids = torch.tensor([list(text.encode())])
    with torch.no_grad():
        expected = family.model(ids, labels=ids).loss.item()
    assert result["tokens"] == 24 and abs(result["loss"] - expected) < TOLERANCE, (result, expected)


def check_export(family: Family, out: pathlib.Path) -> transformers.PreTrainedModel:
    """The export loads in `from_pretrained` with the same logits and the source's tensor names."""
    axcore_to_hf(family.run, out)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert exported.config.model_type == family.model.config.model_type
    assert np.abs(hf_logits(exported) - axcore_logits(family.run)).max() < TOLERANCE
    assert sorted(read_tensors(out)) == sorted(read_tensors(family.hf_dir))
    return exported


def check_fine_tuning(family: Family, tmp_path: pathlib.Path, capsys) -> None:
    """`axcore train` resumes from the import's step 0 and one step changes the model."""
    run = tmp_path / "run"
    assert main(["convert", "hf-to-axcore", str(family.hf_dir), str(run), "--seq-len", "32"]) == 0
    overrides = ["trainer.max_steps=1", "trainer.eval_every=0", "trainer.sample.num_tokens=0", "input.batch_size=2",
                 "trainer.learner.schedule.warmup_steps=0", "trainer.metrics_writers=[]"]
    assert main(["train", str(run / "config.yaml"), *[a for o in overrides for a in ("--set", o)]]) == 0
    assert "Resumed from step 0" in capsys.readouterr().err
    assert np.abs(axcore_logits(run, step=1) - hf_logits(family.model)).max() > 1e-3


def check_round_trip(config, dtype: str, tmp_path: pathlib.Path) -> None:
    """HF (in `dtype`) -> axcore -> HF gives every tensor back bit for bit."""
    build(config, getattr(torch, dtype)).save_pretrained(tmp_path / "hf")
    hf_to_axcore(tmp_path / "hf", tmp_path / "run", seq_len=32)
    axcore_to_hf(tmp_path / "run", tmp_path / "out")
    before, after = read_tensors(tmp_path / "hf"), read_tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert tensor.dtype == after[name].dtype == DTYPES[dtype] and tensor.tobytes() == after[name].tobytes(), name


def check_refused(config_data: dict, tmp_path: pathlib.Path, capsys, expected: str) -> None:
    """Importing a directory with only this config.json exits 2 with one line naming `expected`."""
    directory = tmp_path / "bad"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config_data))
    assert main(["convert", "hf-to-axcore", str(directory), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "config.json" in err, err


def core_mentions(words) -> list[tuple[str, str]]:
    """`(file, word)` for each of `words` (lower case) found in axcore's own sources."""
    core = pathlib.Path(axcore.__file__).parent
    return [(str(p.relative_to(core)), w) for p in core.rglob("*.py") for w in words if w in p.read_text().lower()]


# The inference engine's check: a cache of 12 usable blocks of 4 tokens (so the sequences below preempt each
# other), 4 rows and 16 tokens per step, one bucket each (3 compiled programs, one per block-table width).
ENGINE = EngineConfig(block_size=4, num_blocks=13, max_seqs=4, max_tokens_per_step=16, batch_buckets=(4,),
                      token_buckets=(16,))
ENGINE_NEW_TOKENS = 8


def engine_prompts() -> list[list[int]]:
    """Five prompts (ids 1..255) of 3, 14, 9, 15 and 14 tokens; the last two share their first 13 (3 full blocks)."""
    rng = np.random.default_rng(1)
    shared = rng.integers(1, 256, size=13).tolist()
    return [rng.integers(1, 256, size=n).tolist() for n in (3, 14, 9)] + [shared + [5, 6], shared + [7]]


def hf_greedy(model, ids: list[int], count: int) -> list[int]:
    """transformers' greedy continuation of `ids` by `count` tokens (never stopped by an end-of-sequence token)."""
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=None, max_new_tokens=count, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=config)
    return out[0, len(ids):].tolist()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """NumPy log_softmax over the last axis, in float64."""
    x = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def run_engine(engine: Engine, requests: list[GenerationRequest], steps_between: tuple[int, ...]) -> list:
    """Adds `requests[k]` after `steps_between[k - 1]` more steps, then steps until all finish; their final outputs."""
    finals = {}
    for k, request in enumerate(requests):
        for _ in range(steps_between[k - 1] if k else 0):
            engine.step()
        engine.add_request(request, lambda out, rid=request.request_id: finals.__setitem__(rid, out))
    while not all(r.request_id in finals and finals[r.request_id].finished for r in requests):
        engine.step()
    return [finals[r.request_id] for r in requests]


def check_engine(model, run: pathlib.Path) -> EngineStats:
    """axcore's inference engine (continuous batching over a paged KV cache) on the imported `run` gives
    transformers' greedy `generate` tokens, and log-probabilities (each token's and the top 2) within TOLERANCE
    of log_softmax of transformers' full forward over prompt and output; the text is the tokenizer's decode.

    One engine run covers: prompts of mixed lengths (3..15 tokens, ENGINE_NEW_TOKENS new ones each), requests
    joining mid-flight, a shared 13-token prefix found in the prefix cache, preemptions (7 sequences on 12
    blocks) and n = 3 at temperature 0. Returns the engine's counters at the end.
    """
    prompts = engine_prompts()
    params = dict(max_tokens=ENGINE_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    requests = [GenerationRequest(f"r{k}", p, SamplingParams(n=3 if k == 2 else 1, **params))
                for k, p in enumerate(prompts)]
    engine = load_engine(str(run), config=ENGINE)
    try:
        outputs = run_engine(engine, requests, steps_between=(2, 1, 0, 3))
        stats, tokenizer = engine.stats(), engine.tokenizer
    finally:
        engine.close()
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(model, prompt, ENGINE_NEW_TOKENS)
        reference = log_softmax(hf_logits(model, [prompt + expected])[0])[len(prompt) - 1 : -1]
        top = np.argsort(-reference, axis=-1, kind="stable")[:, :2]
        assert len(output.choices) == (3 if output.request_id == "r2" else 1)
        for choice in output.choices:
            assert (choice.token_ids, choice.finish_reason) == (expected, "length"), (output.request_id, choice)
            assert choice.text == tokenizer.decode([t for t in expected if t < tokenizer.vocab_size])  # 256..: none.
            np.testing.assert_allclose(choice.logprobs, reference[np.arange(len(expected)), expected], atol=TOLERANCE)
            assert [list(t) for t in choice.top_logprobs] == top.tolist()
            np.testing.assert_allclose([list(t.values()) for t in choice.top_logprobs],
                                       np.take_along_axis(reference, top, -1), atol=TOLERANCE)
    assert stats.prefix_cache_hits >= 3 and stats.preemptions > 0, stats
    assert (stats.kv_blocks_used, stats.running, stats.waiting) == (0, 0, 0), stats
    return stats
