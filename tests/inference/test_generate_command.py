"""`axcore generate` on a run made by `axcore train`: its greedy continuation equals an
independent argmax loop over full forwards of the restored model; bad arguments exit 2
with one line."""

import json
import os

import jax
import numpy as np
import pytest

from axcore.cli import main
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


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "at least one non-empty --prompt"),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1]"),
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
