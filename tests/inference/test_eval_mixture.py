"""Evaluation of a mixture: each component alone within its weight's share of the budget, a token-weighted
total; the trainer's metrics and line, `axcore eval` and a separate evaluation of each component alone agree,
and a component's loss equals NumPy's cross-entropy over its batches."""

import contextlib
import io
import json

import numpy as np
import pytest
from test_eval_command import _numpy_document_loss

from axcore.cli import main
from axcore.data import Split
from axcore.inference.evaluation import evaluate_run
from axcore.inference.run_loading import load_model
from axcore.observe import read_jsonl_metrics
from axcore.placement.inputs import input_pipeline
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.step import TrainStep

NOTES = "{type: text_files, paths: [%s], eval_fraction: 0.5}"


def _notes(directory):
    directory.mkdir()
    for i in range(12):  # Short documents of varied length: rows pack several of them.
        (directory / f"note{i:02d}.txt").write_text("".join(f"note {i}, line {j}.\n" for j in range(1 + i % 5)))
    return NOTES % directory


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    notes = _notes(root / "notes")
    run = root / "run"
    overrides = [
        *TINY_OVERRIDES, "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_batches=4", "trainer.log_every=1",
        "trainer.sample.num_tokens=0", "trainer.metrics_writers=[{type: jsonl}]", f"trainer.run_dir={run}",
        f"input.mixture=[{{name: book, weight: 3, source: {{type: embedded_corpus}}}}, "
        f"{{name: notes, weight: 1, source: {notes}}}]",
    ]
    with contextlib.redirect_stderr(io.StringIO()) as err:  # The trainer's stream.
        assert main(["train", *[a for o in overrides for a in ("--set", o)]]) == 0
    return run, notes, err.getvalue()


def test_trainer_eval_and_each_component_alone_agree(mixed_run, capsys):
    run, notes, _ = mixed_run
    [logged] = [r for r in read_jsonl_metrics(run / "metrics.jsonl") if "eval/loss" in r]
    # axcore eval with the trainer's budget: trainer.eval_batches=4 at weights 3:1 is 3 batches of book, 1 of notes.
    capsys.readouterr()
    assert main(["eval", str(run), "--max-batches", "4", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "each mixture component alone: book 3 batches, notes 1 batch" in captured.err
    components = result["components"]
    assert list(components) == ["book", "notes"]
    assert (components["book"]["batches"], components["notes"]["batches"]) == (3, 1)
    for name, part in components.items():
        assert logged[f"eval/tokens/{name}"] == part["tokens"] > 0
        assert logged[f"eval/loss/{name}"] == pytest.approx(part["loss"], rel=1e-6, abs=1e-6)
    # The total is the token-weighted mean of the components (NumPy), logged and printed alike.
    losses = np.array([components[n]["loss"] for n in ("book", "notes")])
    tokens = np.array([components[n]["tokens"] for n in ("book", "notes")], np.float64)
    assert result["tokens"] == logged["eval/tokens"] == tokens.sum()
    assert result["loss"] == pytest.approx(np.average(losses, weights=tokens), rel=1e-6)
    assert logged["eval/loss"] == pytest.approx(np.average(losses, weights=tokens), rel=1e-6)
    assert abs(losses[0] - losses[1]) > 1e-3  # Two different components: a total of one alone would differ.
    # Each component alone: the same checkpoint with that component as its only input, at its share of the budget.
    alone = {"book": ["input.source={type: embedded_corpus}"], "notes": [f"input.source={notes}"]}
    for name, budget in (("book", 3), ("notes", 1)):
        single = evaluate_run(run, max_batches=budget, overrides=["input.mixture=null", *alone[name]])
        assert not single.components and single.tokens == components[name]["tokens"]
        assert single.loss == pytest.approx(components[name]["loss"], rel=1e-6, abs=1e-6)


def test_a_component_equals_numpy_and_the_line_names_what_was_measured(mixed_run, capsys):
    run, _, err = mixed_run
    loaded = load_model(run)
    step = TrainStep(loaded.experiment)
    config = loaded.experiment.config
    pipeline = input_pipeline(config.input, Split.EVAL, step.tokenizer, config.model.vocab_size, step.shard_layout,
                              component="notes")
    batch = next(pipeline)
    pipeline.close()
    xent, weight = _numpy_document_loss(loaded, [batch])
    [logged] = [r for r in read_jsonl_metrics(run / "metrics.jsonl") if "eval/loss" in r]
    [line] = [x for x in err.splitlines() if x.startswith("eval at step 2: ")]
    assert line.startswith(
        f"eval at step 2: held-out loss {logged['eval/loss']:.4f} over {logged['eval/tokens']:,.0f} tokens: "
        f"book {logged['eval/loss/book']:.4f} over {logged['eval/tokens/book']:,.0f} tokens (3 batches), "
        f"notes {logged['eval/loss/notes']:.4f} over {logged['eval/tokens/notes']:,.0f} tokens (1 batch"
    ) and line.endswith("; trainer.eval_batches=4 split by weight"), line
    assert weight == logged["eval/tokens/notes"]
    assert xent / weight == pytest.approx(logged["eval/loss/notes"], rel=1e-5)
    # Without a bound, every component's whole split; the result says each one is complete.
    whole = evaluate_run(run, batch_size=64)
    assert whole.complete and all(part["complete"] for part in whole.components.values())
    # Every target of the notes' held-out documents (k odd at eval_fraction 0.5) counted once: n - 1 per document.
    held_out = sorted((run.parent / "notes").iterdir())[1::2]
    assert whole.components["notes"]["tokens"] == sum(len(p.read_bytes()) - 1 for p in held_out)
    assert whole.tokens == sum(part["tokens"] for part in whole.components.values())
    # The training stream too: each component's own, within the same budget.
    train = evaluate_run(run, split="train", max_batches=4)
    assert [(p["batches"], p["complete"]) for p in train.components.values()] == [(3, False), (1, False)]
