"""Tasks with verifiable answers, generated from a seed (no downloads): arithmetic, sorting, counting.

`generate_tasks(kind, count, seed=..., difficulty=...)` returns `count` samples
`{"prompt": str, "answer": str}`; the same arguments give the same samples on any
machine (NumPy's PCG64 from `seed`). `difficulty` (>= 1) sets the size:

- `arithmetic`: "a+b=" (with difficulty >= 3 also "a-b=" and "a*b=") over operands of
  `difficulty` digits at most; the answer is the result, e.g. "3+4=" -> "7". With
  `max_sum` (difficulty 1 only) the answer is drawn uniformly from 0..max_sum, then a
  uniformly from 0..answer: `max_sum=9` keeps every answer one digit, hence one token
  of a character vocabulary.
- `sorting`: "sort 3 1 2:" -> "1 2 3", `difficulty + 2` numbers below 10.
- `counting`: "count a in abcab:" -> "2", a string of `difficulty * 4` letters of "abc".

`write_jsonl(path, samples)` writes them as the JSONL prompt source of an `rl` run (one
object per line with `prompt` and `answer`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from axcore import AxcoreError

KINDS = ("arithmetic", "sorting", "counting")


class TaskError(AxcoreError):
    """A task cannot be generated with these settings (names the setting and what to do)."""


def _arithmetic(rng: np.random.Generator, difficulty: int, max_sum: int | None) -> dict[str, str]:
    high = 10 ** difficulty
    if max_sum is not None:
        total = int(rng.integers(0, max_sum + 1))  # The answer is uniform: no single answer is a safe guess.
        a = int(rng.integers(0, total + 1))
        b = total - a
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}
    a, b = (int(x) for x in rng.integers(0, high, size=2))
    op = "+" if difficulty < 3 else str(rng.choice(["+", "-", "*"]))
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": f"{a}{op}{b}=", "answer": str(result)}


def _sorting(rng: np.random.Generator, difficulty: int) -> dict[str, str]:
    numbers = [int(x) for x in rng.integers(0, 10, size=difficulty + 2)]
    return {"prompt": "sort " + " ".join(map(str, numbers)) + ":", "answer": " ".join(map(str, sorted(numbers)))}


def _counting(rng: np.random.Generator, difficulty: int) -> dict[str, str]:
    letters = "".join(rng.choice(list("abc"), size=difficulty * 4))
    target = str(rng.choice(list("abc")))
    return {"prompt": f"count {target} in {letters}:", "answer": str(letters.count(target))}


def generate_tasks(kind: str, count: int, *, seed: int = 0, difficulty: int = 1,
                   max_sum: int | None = None) -> list[dict[str, str]]:
    """`count` samples `{"prompt", "answer"}` of task `kind` (module docstring); deterministic in the arguments."""
    if kind not in KINDS:
        raise TaskError(f"task kind {kind!r}: use one of {', '.join(KINDS)}.")
    if not isinstance(difficulty, int) or difficulty < 1:
        raise TaskError(f"task 'difficulty' {difficulty!r}: must be an integer >= 1.")
    if max_sum is not None and (kind != "arithmetic" or difficulty != 1 or not 0 <= max_sum <= 18):
        raise TaskError(f"task 'max_sum' {max_sum!r}: only for arithmetic at difficulty 1, in 0..18.")
    rng = np.random.default_rng(seed)
    make = {"arithmetic": lambda: _arithmetic(rng, difficulty, max_sum), "sorting": lambda: _sorting(rng, difficulty),
            "counting": lambda: _counting(rng, difficulty)}[kind]
    return [make() for _ in range(count)]


def write_jsonl(path: str, samples: Sequence[dict[str, str]]) -> None:
    """Writes `samples` to `path`, one JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")


__all__ = ["KINDS", "TaskError", "generate_tasks", "write_jsonl"]
