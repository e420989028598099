"""`axcore generate` on a run made by `axcore train`: its greedy continuation (from the
inference engine) equals an independent argmax loop over full forwards of the restored
model, from --prompt, --prompts-file JSONL and to --output JSONL; bad arguments exit 2
with one line."""

import io
import json
import os

import jax
import numpy as np
import pytest

from axcore.cli import main
from axcore.cli.generate import Progress
from axcore.inference.run_loading import load_model
from axcore.module import functional
from axcore.testing import TINY_OVERRIDES

TRAIN = [*TINY_OVERRIDES, "trainer.max_steps=3", "trainer.eval_every=0", "trainer.sample.num_tokens=0",
         "trainer.metrics_writers=[{type: jsonl}]"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gen") / "run"
    assert main(["train"] + [a for o in [*TRAIN, f"trainer.run_dir={run_dir}"] for a in ("--set", o)]) == 0
    return run_dir


def _greedy_reference(run_dir, prompt: str, num_new: int) -> list[int]:
    loaded = load_model(run_dir)
    logits = jax.jit(lambda p, x: functional(loaded.model, p, (x,), None, False, method="logits")[0])
    tokens = list(prompt.encode())
    for _ in range(num_new):
        buffer = np.zeros((1, 32), np.int32)  # The model is causal: a fixed width gives the same logits.
        buffer[0, : len(tokens)] = tokens
        tokens.append(int(np.argmax(np.asarray(logits(loaded.params, buffer))[0, len(tokens) - 1])))
    return tokens[len(prompt.encode()):]


def test_greedy_generation_of_a_trained_run_matches_full_forward_argmax(run, capsys):
    prompts = ["The ", "Once upon"]
    args = ["generate", str(run), "--max-new-tokens", "6", "--json"]
    assert main(args + [a for p in prompts for a in ("--prompt", p)]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["prompt"] for o in out] == prompts
    for prompt, record in zip(prompts, out):
        assert record["tokens"] == _greedy_reference(run, prompt, 6)


def test_a_prompts_file_to_an_output_file_and_a_stop_string(run, tmp_path, capsys):
    prompts = ["The ", "Once upon", "A"]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)) + "\n")
    target = tmp_path / "out.jsonl"
    assert main(["generate", str(run), "--prompts-file", str(source), "--output", str(target),
                 "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and f"Wrote 3 result(s) to {target}." in captured.err
    records = [json.loads(line) for line in target.read_text().splitlines()]
    tokenizer = load_model(run).experiment.config.tokenizer.instantiate()
    for prompt, record in zip(prompts, records):
        expected = _greedy_reference(run, prompt, 5)
        assert (record["prompt"], record["tokens"]) == (prompt, expected)
        assert record["completion"] == tokenizer.decode(np.asarray(expected))
    # A stop string: a character of the first continuation past its first one; the text stops before it.
    text = records[0]["completion"]
    stop = next(c for c in text[1:] if c.isprintable())
    assert main(["generate", str(run), "--prompt", "The ", "--max-new-tokens", "5", "--stop", stop, "--json"]) == 0
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["completion"] == text.split(stop)[0] and len(record["tokens"]) <= 5


def test_a_bad_prompts_file_line_is_one_line_naming_the_file_and_line(run, tmp_path, capsys):
    source = tmp_path / "prompts.jsonl"
    source.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    assert main(["generate", str(run), "--prompts-file", str(source)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(source) in err[0] and "line 2" in err[0] and "'prompt'" in err[0], err


def test_the_progress_line_counts_finished_prompts_on_a_terminal_only():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    shown, hidden, single = Terminal(), io.StringIO(), Terminal()
    for stream, total in ((shown, 4), (hidden, 4), (single, 1)):
        progress = Progress(stream, total)
        progress(1, total)
        progress(total, total)
        progress.close()
    lines = shown.getvalue().split("\r")[1:]
    assert [line.split("] ")[1].split(" (")[0] for line in lines] == ["1/4 prompts finished", "4/4 prompts finished"]
    assert lines[0].startswith("generate: [" + "#" * 7 + ".") and shown.getvalue().endswith("\n")
    assert hidden.getvalue() == "" and single.getvalue() == ""


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "at least one non-empty --prompt"),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--prompt", "x", "--min-p", "2"], "--min-p must be a number in [0.0, 1.0]"),
        (["--prompt", "x", "--output", "/nonexistent-dir/out.jsonl"], "--output '/nonexistent-dir/out.jsonl'"),
        (["--prompt", "x", "--stop-token", "999"], "--stop-token 999 is outside"),
        (["--prompt", "x", "--max-new-tokens", "40"], "max_len"),
        (["--prompt", "x", "--max-new-tokens", "32"], "max_len"),  # 1 + 32 positions: one past the 32.
    ],
)
def test_bad_arguments_exit_2_with_one_line(run, capsys, extra, message):
    assert main(["generate", str(run), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("axcore: error:") and message in err[0], err


def test_several_runs_from_a_glob_are_one_line_naming_them_and_the_newest(tmp_path, capsys):
    """`axcore generate runs/default-*` matching two runs: one line, exit 2, not argparse's 'unrecognized arguments'."""
    older, newer = tmp_path / "default-20260101-000000", tmp_path / "default-20250101-000000"
    for path, mtime in ((older, 1_000_000), (newer, 2_000_000)):  # The newest by time, not by name.
        path.mkdir()
        os.utime(path, (mtime, mtime))
    assert main(["generate", str(older), str(newer), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"axcore: error: 2 run directories given ({older}, {newer}); axcore generate reads one: name one, "
        f"e.g. the newest: {newer}"
    ]
