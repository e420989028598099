"""The evaluation's parts: the budget split across a mixture, the token-weighted total, progress lines, the
refusal of runs that cannot evaluate (before compiling), and a failing evaluation that keeps the trained step."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest

from axcore.data.sources import is_eval_document
from axcore.experiment import load_experiment
from axcore.inference.run_loading import load_model
from axcore.placement.evaluate import (
    EvalProgress,
    EvalTotals,
    NothingToEvaluateError,
    check_evaluable,
    combine,
    component_budgets,
    first_eval_document,
)
from axcore.testing import TINY_OVERRIDES


@pytest.mark.parametrize("weights, budget, expected", [
    ([3, 1], 8, [6, 2]),  # Exact shares.
    ([1, 1, 1], 8, [3, 3, 2]),  # 2.67 each: the two batches left go to the earlier components.
    ([0.5, 0.25, 0.25], 7, [3, 2, 2]),  # 3.5, 1.75, 1.75: the larger remainders win.
    ([1, 1, 1], 2, [1, 1, 1]),  # Fewer batches than components: still one each.
    ([5, 1], 3, [2, 1]),  # 2.5 and 0.5: the tie goes to the first (3, 0), which gives one to the second.
    ([8, 1, 1], 4, [2, 1, 1]),  # 3.2, 0.4, 0.4: (4, 0, 0), then one each from the largest.
    ([1, 2], 0, [0, 0]),  # No bound: every whole split.
    ([1, 2], None, [0, 0]),
])
def test_the_budget_is_split_by_weight(weights, budget, expected):
    got = component_budgets(weights, budget)
    assert got == expected
    if budget and budget >= len(weights):  # A true split: the whole budget, at least one batch each.
        assert sum(got) == budget and min(got) >= 1


def test_the_total_is_token_weighted():
    parts = {"a": EvalTotals(2.0, 300.0, 3, False), "b": EvalTotals(5.0, 100.0, 1, True)}
    total = combine(parts)
    assert total.loss == pytest.approx(np.average([2.0, 5.0], weights=[300, 100]))
    assert (total.tokens, total.batches, total.complete, list(total.components)) == (400.0, 4, False, ["a", "b"])


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.3, 1 / 3, 0.5, 0.7, 1.0, 0.001, 0.07, 0.15])
def test_the_first_held_out_document_follows_the_rule(fraction):
    first = next(k for k in range(10_000) if is_eval_document(k, fraction))
    assert first_eval_document(fraction) == first


def _ticks(progress, budget, times):
    """Runs one stream's callback at `times` (one batch each, 100 tokens); -> the lines written."""
    clock = iter([0.0, *times])
    progress.clock = lambda: next(clock)
    tick = progress.for_stream("web", budget)
    for i in range(len(times)):
        tick(i + 1, 100 * (i + 1))
    return progress.stream.getvalue().splitlines()


def test_progress_lines_only_for_a_long_evaluation():
    lines = _ticks(EvalProgress(io.StringIO(), "eval at step 7", first_after=5, every=10), 6, [1, 2, 6, 7, 17, 18])
    assert lines == [
        "eval at step 7 web: batch 3/6, 300 tokens read, 0:00:06 elapsed, ETA 0:00:06",
        "eval at step 7 web: batch 5/6, 500 tokens read, 0:00:17 elapsed, ETA 0:00:03",
        "eval at step 7 web: batch 6/6, 600 tokens read, 0:00:18 elapsed, ETA 0:00:00",
    ]
    assert _ticks(EvalProgress(io.StringIO(), first_after=5), 3, [1, 2, 4.9]) == []  # Quick: silent.
    whole = _ticks(EvalProgress(io.StringIO(), first_after=0, every=10), None, [1, 2, 12])
    assert whole == ["eval web: batch 1 (whole split), 100 tokens read, 0:00:01 elapsed",
                     "eval web: batch 3 (whole split), 300 tokens read, 0:00:12 elapsed"]
    beats = []
    _ticks(EvalProgress(io.StringIO(), on_batch=lambda: beats.append(1)), 2, [1, 2])
    assert len(beats) == 2  # The trainer's watchdog hears of every batch.


def _notes(directory, lengths):
    directory.mkdir()
    for i, n in enumerate(lengths):
        (directory / f"note{i:02d}.txt").write_text(("x" * (n - 1)) + "\n")
    return directory


def test_sources_that_hold_nothing_out_are_refused(tmp_path):
    check_evaluable(load_experiment(None, []).config)  # The default: 8 of the corpus's chapters are held out.
    zero = load_experiment(None, ["input.source.eval_fraction=0"]).config
    with pytest.raises(NothingToEvaluateError, match=r"^trainer\.eval_every=100 evaluates on held-out documents, "
                       r"but input\.source\.eval_fraction is 0: the embedded corpus holds none out; set "
                       r"trainer\.eval_every: 0 .*, or raise input\.source\.eval_fraction\.$"):
        check_evaluable(zero)
    check_evaluable(load_experiment(None, ["input.source.eval_fraction=0", "trainer.eval_every=0"]).config)
    # A streamed component with too few documents for its fraction (one in ten: 10 needed), named by its path.
    few = _notes(tmp_path / "few", [20] * 9)
    mixture = ("input.mixture=[{name: book, source: {type: embedded_corpus}}, "
               "{name: notes, source: {type: text_files, paths: [%s], eval_fraction: 0.1}}]")
    with pytest.raises(NothingToEvaluateError, match=r"but input\.mixture\[1\]\.source \(text files .*\) holds 9 "
                       r"document\(s\), too few for input\.mixture\[1\]\.source\.eval_fraction=0\.1 to hold one out "
                       r"\(it takes 10\)"):
        check_evaluable(load_experiment(None, [mixture % few]).config)
    check_evaluable(load_experiment(None, [mixture % _notes(tmp_path / "enough", [20] * 10)]).config)
    # A random-access source: a token file of 3 documents at 0.25 (4 needed), then of 4.
    np.zeros(3 * 8, np.uint16).tofile(tmp_path / "three.bin")
    np.zeros(4 * 8, np.uint16).tofile(tmp_path / "four.bin")
    source = "input.source={type: token_file, path: %s, document_tokens: 8, eval_fraction: 0.25}"
    with pytest.raises(NothingToEvaluateError, match=r"holds 3 document\(s\), too few .* \(it takes 4\)"):
        check_evaluable(load_experiment(None, [source % (tmp_path / "three.bin")]).config)
    check_evaluable(load_experiment(None, [source % (tmp_path / "four.bin")]).config)


def _axcore(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "axcore.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd, env={**_without_xla_flags(), "JAX_PLATFORMS": "cpu"})


def _without_xla_flags():
    """The environment without XLA_FLAGS, which `axcore train` would echo as a first stderr line."""
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _sets(*overrides):
    return [a for o in [*TINY_OVERRIDES, "trainer.sample.num_tokens=0", "trainer.metrics_writers=[{type: jsonl}]",
                        *overrides] for a in ("--set", o)]


def test_a_run_that_cannot_evaluate_is_refused_before_compiling(tmp_path):
    run = tmp_path / "run"
    out = _axcore("train", *_sets("input.source.eval_fraction=0", "trainer.max_steps=2", f"trainer.run_dir={run}"))
    assert out.returncode == 2, out.stderr[-2000:]
    [line] = out.stderr.strip().splitlines()  # One line: nothing compiled, no traceback.
    assert line.startswith("axcore: error: trainer.eval_every=100 evaluates on held-out documents, but "
                           "input.source.eval_fraction is 0") and "set trainer.eval_every: 0" in line
    assert not run.exists()
    config = _axcore("config", "default", *_sets("input.source.eval_fraction=0"))
    assert config.returncode == 0 and "# data check: trainer.eval_every=100 evaluates" in config.stdout


def test_a_failing_end_of_run_evaluation_keeps_the_trained_step(tmp_path):
    """The held-out document is longer than a row under long_documents: error, so only the evaluation at the
    last step fails; no checkpoint was due before it. The run keeps its directory and its step 3."""
    notes = _notes(tmp_path / "notes", [20, 100, 20, 20])  # At eval_fraction 0.5, documents 1 and 3 are held out.
    run = tmp_path / "run"
    out = _axcore("train", *_sets(
        f"input.source={{type: text_files, paths: [{notes}], eval_fraction: 0.5}}", "input.long_documents=error",
        "trainer.max_steps=3", "trainer.checkpoint.every_n_steps=100", f"trainer.run_dir={run}"))
    assert out.returncode == 2, out.stderr[-2000:]
    *_, marked, error = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr and error.startswith("axcore: error: ") and "note01.txt" in error
    assert marked == f"Marked {run} as failed (FAILED); its checkpoints are kept."
    assert "note01.txt" in (run / "FAILED").read_text()
    assert load_model(run).step == 3  # Committed: the trained parameters load.
