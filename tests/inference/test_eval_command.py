"""`axcore eval`: loss and perplexity of a checkpoint equal an independent NumPy computation over every
target token once (partial last row and padded last batch included); on the run's own eval split it is the
trainer's evaluation (same loss, same tokens); bad arguments exit 2 in one line."""

import json
import math
import os

import numpy as np
import pytest

import axcore
from axcore.cli import main
from axcore.data import Split
from axcore.data.device_loader import shard_layout
from axcore.inference.evaluation import evaluate_run, windows
from axcore.inference.run_loading import load_model
from axcore.observe import read_jsonl_metrics
from axcore.placement.evaluate import evaluate_input
from axcore.placement.inputs import input_pipeline
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

TRAIN = [*TINY_OVERRIDES, "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_batches=2",
         "trainer.sample.num_tokens=0", "trainer.metrics_writers=[{type: jsonl}]"]
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families. Café!\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("eval") / "run"
    assert main(["train", *[a for o in [*TRAIN, f"trainer.run_dir={run}"] for a in ("--set", o)]]) == 0
    return run


def _numpy_loss(run, tokens, seq_len):
    """Mean cross-entropy over targets tokens[1:], rows of seq_len, log-softmax in float64 NumPy."""
    loaded = load_model(run)
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, seq_len):
        row = tokens[start : start + seq_len + 1]
        ids = np.asarray(row[:-1], np.int32)[None]
        logits, _ = axcore.functional(loaded.model, loaded.params, (ids,), None, False, method="logits")
        logits = np.asarray(logits, np.float64)[0]
        log_probs = logits - logits.max(-1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
        targets = np.asarray(row[1:])
        total -= log_probs[np.arange(len(targets)), targets].sum()
        count += len(targets)
    return total / count, count


def test_perplexity_equals_an_independent_numpy_computation(run, tmp_path, capsys):
    text_file = tmp_path / "held_out.txt"
    text_file.write_text(TEXT)
    tokens = np.frombuffer(TEXT.encode(), np.uint8)  # The run's tokenizer is bytes.
    assert (len(tokens) - 1) % 16 and (-(-(len(tokens) - 1) // 16)) % 3  # A partial row and a padded batch.
    expected, count = _numpy_loss(run, tokens, 16)
    assert main(["eval", str(run), "--data", str(text_file), "--batch-size", "3", "--seq-len", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == count == len(tokens) - 1
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
    rows = -(-count // 16)  # Ceiling divisions: rows of 16 targets, then batches of 3 rows.
    assert result["step"] == 3 and result["complete"] and result["batches"] == -(-rows // 3)
    # The same ids as a token file, and as a JSONL document, give the same numbers.
    tokens.astype(np.uint16).tofile(tmp_path / "held_out.bin")
    (tmp_path / "held_out.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    for path in ("held_out.bin", "held_out.jsonl"):
        same = evaluate_run(run, data=[str(tmp_path / path)], batch_size=3, seq_len=16)
        assert same.tokens == count and same.loss == pytest.approx(result["loss"], rel=1e-6), path
    # Two files: every target of each counted once, token-weighted.
    both = evaluate_run(run, data=[str(text_file), str(tmp_path / "held_out.bin")], batch_size=3, seq_len=16)
    assert both.tokens == 2 * count and both.loss == pytest.approx(result["loss"], rel=1e-6)


def _numpy_document_loss(loaded, batches):
    """Sum of weight x cross-entropy and of weights over `batches`, each document of each row run alone
    (unpacked, its own positions), log-softmax in float64 NumPy."""
    total, weight = 0.0, 0.0
    for batch in batches:
        for r in range(batch["input_ids"].shape[0]):
            segments = batch["segment_ids"][r]
            for segment in np.unique(segments[segments > 0]):
                idx = np.flatnonzero(segments == segment)
                ids, pos = batch["input_ids"][r, idx][None], batch["positions"][r, idx][None]
                logits, _ = axcore.functional(loaded.model, loaded.params, (ids, pos), None, False, method="logits")
                logits = np.asarray(logits, np.float64)[0]
                log_probs = logits - logits.max(-1, keepdims=True)
                log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
                w = batch["target_weights"][r, idx].astype(np.float64)
                labels = np.maximum(batch["target_labels"][r, idx], 0)
                total -= (w * log_probs[np.arange(len(idx)), labels]).sum()
                weight += w.sum()
    return total, weight


def test_trainer_and_axcore_eval_are_one_evaluation_equal_to_numpy(run, capsys):
    """The run's logged eval (step 3, trainer.eval_batches=2), `axcore eval --max-batches 2` and
    `evaluate_input` of the trainer's step object on the same parameters: one loss over the same tokens, equal to NumPy's."""
    assert main(["eval", str(run), "--max-batches", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"step 3 of {run.resolve()}: loss ") and "validation split of the run's input pipeline" in out
    assert "stopped after --max-batches 2" in out
    first = evaluate_run(run, max_batches=2)
    assert (first.batches, first.complete) == (2, False) and 0 < first.tokens <= 2 * 4 * 32
    [logged] = [r for r in read_jsonl_metrics(run / "metrics.jsonl") if "eval/loss" in r]
    assert logged["step"] == 3 and logged["eval/tokens"] == first.tokens
    assert logged["eval/loss"] == pytest.approx(first.loss, rel=1e-6, abs=1e-6)
    loaded = load_model(run)
    trainer = Trainer(loaded.experiment)
    totals = evaluate_input(trainer.step, loaded.params, Split.EVAL, 2)
    assert totals.tokens == first.tokens and totals.loss == pytest.approx(first.loss, rel=1e-6, abs=1e-6)
    # The same two batches, read from the pipeline on the host, and scored one document at a time in NumPy.
    config = loaded.experiment.config
    layout = shard_layout(trainer.step.batch_sharding, (config.input.batch_size, config.input.seq_len), None)
    pipeline = input_pipeline(config.input, Split.EVAL, trainer.step.tokenizer, config.model.vocab_size, layout)
    xent, weight = _numpy_document_loss(loaded, [next(pipeline) for _ in range(2)])
    assert weight == first.tokens and xent / weight == pytest.approx(first.loss, rel=1e-5)


def test_the_whole_split_and_the_train_split(run):
    whole = evaluate_run(run, max_batches=None, batch_size=64)  # Wide batches: fewer steps over the whole split.
    assert whole.complete and whole.batches > 2 and whole.tokens > evaluate_run(run, max_batches=2, batch_size=64).tokens
    train = evaluate_run(run, split="train", max_batches=1)
    assert not train.complete and 0 < train.tokens <= 4 * 32
    with pytest.raises(axcore.AxcoreError, match="--split train reads the endless training stream; pass --max-batches"):
        evaluate_run(run, split="train")


def test_windows_count_every_target_once():
    tokens = np.arange(12)
    batches = list(windows(tokens, seq_len=4, batch_size=2, vocab_size=None, where="x"))
    labels = np.concatenate([b["target_labels"].reshape(-1) for b in batches])
    assert sorted(labels[labels >= 0].tolist()) == list(range(1, 12))
    assert batches[1]["input_ids"][0].tolist() == [8, 9, 10, 0] and batches[1]["target_labels"][1].tolist() == [-1] * 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--split", "bogus"], "--split 'bogus' is not a split"),
        (["--data", "missing.txt"], "--data 'missing.txt' is not a file"),
        (["--step", "2"], "No committed checkpoint for step 2"),
        (["--seq-len", "64"], "'model.position_embedding.max_len' (32) must be >= 'input.seq_len' (64)"),
        (["--max-batches", "0"], "--max-batches must be a positive integer"),
        (["--batch-size", "x"], "argument --batch-size: invalid int value"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(run, args, message, capsys):
    try:
        status = main(["eval", str(run), *args])
    except SystemExit as e:  # argparse's own errors exit from the parser.
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("axcore: error:") and message in err[0], err


def test_not_a_run_exits_2(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    assert "holds no config.yaml" in capsys.readouterr().err


def test_several_runs_are_one_line_naming_them(tmp_path, capsys):
    """As for `axcore generate`: a glob matching three runs is one line and exit 2, the newest suggested."""
    runs = [tmp_path / name for name in ("a", "b", "c")]
    for i, path in enumerate(runs):
        path.mkdir()
        os.utime(path, (1_000_000 * (3 - i), 1_000_000 * (3 - i)))  # a is the newest.
    assert main(["eval", *map(str, runs), "--max-batches", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("axcore: error: 3 run directories given (")
    assert f"({runs[0]}, {runs[1]}, {runs[2]}); axcore eval reads one" in err[0]
    assert err[0].endswith(f"e.g. the newest: {runs[0]}")
