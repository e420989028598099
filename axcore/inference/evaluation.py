"""Held-out loss and perplexity of a checkpoint on a dataset (`axcore eval`).

    result = evaluate_run("runs/x", data=["held_out.txt"], seq_len=256)
    print(result.loss, result.perplexity)   # nats per token, exp(loss)

The model is loaded with `axcore.inference.run_loading` (its run's experiment, the step's
parameters on the experiment's mesh, through its `Placement`: no learner or optimizer state
is built), and the evaluation is the trainer's own (`axcore.placement.evaluate.Evaluator`,
which the train step holds too): each batch goes through the objective's jitted eval step
(`Evaluator.compiled_eval_step`), the weighted cross-entropy and the weights are summed on the device
and fetched once, and the loss is their ratio (nats per weighted target token). A line
on stderr says what is evaluated, and a long evaluation prints a progress line every
few seconds (`axcore.placement.evaluate.EvalProgress`).

Data: by default the experiment's own input pipeline, its eval split (`--split
validation`, also called `eval`): one pass in order with padded rows, exactly the
batches the trainer evaluates, so `axcore eval --max-batches N` equals the run's logged
`eval/loss` with `trainer.eval_batches=N` (and no bound evaluates the whole split).
`--split train` evaluates the first `--max-batches` batches of the training stream (it
is endless, so the bound is required). With `input.mixture`, each component is evaluated
alone and the total is token-weighted, within the same budget as the trainer's
(`--max-batches` split by the mixture weights, `axcore.placement.evaluate`); `components`
holds each one's result. `data` files replace it: text (`.txt`, any
other suffix) or JSONL (`.jsonl`, field `text`) files tokenized with the experiment's
tokenizer, or pre-tokenized token files (`.bin`, `.tokens`; uint16, or uint32 when
the model's vocabulary exceeds 65,536). Each file is its own token stream (its text as
one document, or its JSONL lines' documents one after the other).

Token policy for files: a stream of N tokens has N - 1 targets (every token but the
first, which has no context), and each is counted exactly once. The stream is cut into
rows of `seq_len` targets, row r predicting tokens `r*T+1 .. r*T+T` from tokens
`r*T .. r*T+T-1` (non-overlapping windows: a row's first targets see little context);
the last row is shorter and its missing labels are padding (weight 0), and so are whole
rows that pad the last batch. Loss = sum of the targets' cross-entropies / number of
targets (over all files), perplexity = exp(loss). `max_batches` stops early: then only
the targets of the batches read count, and `complete` is False.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pathlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from axcore.data import PAD_LABEL, DataError, Split, TextFiles, TextFormat, TokenDtype, TokenFile
from axcore.data.schema import BATCH_SCHEMA
from axcore.errors import AxcoreError
from axcore.inference.run_loading import LoadedModel, load_model_and_placement
from axcore.placement.evaluate import EvalProgress, EvalTotals, Evaluator, component_budgets, evaluate_input
from axcore.platform.distributed import is_primary

# `--split` names -> the source's split ("validation" is the eval split).
SPLITS = {"validation": Split.EVAL, "eval": Split.EVAL, "train": Split.TRAIN}
# File suffixes read as pre-tokenized token files; `.jsonl` is JSONL; anything else is text.
TOKEN_FILE_SUFFIXES = (".bin", ".tokens")


class EvalError(AxcoreError):
    """An evaluation cannot run as asked (bad arguments or data; the message says what to change)."""


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Held-out cross-entropy of one checkpoint."""

    # Mean token cross-entropy, nats per target token.
    loss: float
    # exp(loss).
    perplexity: float
    # Target tokens counted.
    tokens: int
    # Batches evaluated (of batch_size rows of seq_len tokens).
    batches: int
    # Rows per batch and targets per row.
    batch_size: int
    seq_len: int
    # Whether every target of the data was counted (False when max_batches stopped it).
    complete: bool
    # The checkpoint's step and run directory.
    step: int
    run_dir: str
    # What was evaluated, e.g. "eval split of TextFiles" or the files.
    data: str
    # With input.mixture: each component's own result {loss, perplexity, tokens, batches, complete}, by name.
    components: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def windows(tokens: np.ndarray, seq_len: int, batch_size: int, vocab_size: int | None, where: str) -> Iterator[dict]:
    """BATCH_SCHEMA batches `[batch_size, seq_len]` covering every target once.

    Row r holds inputs `tokens[r*T : r*T+T]` and labels `tokens[r*T+1 : r*T+T+1]` (one
    segment, positions 0..T-1, weight 1 per label); the last row's missing labels and
    the last batch's missing rows are padding (module docstring). `tokens` may be a
    memmap: only each batch's rows are read.

    Raises:
        DataError: the stream has fewer than 2 tokens, or an id is outside [0, vocab_size).
    """
    n = len(tokens)
    if n < 2:
        raise DataError(f"{where} holds {n} token(s); evaluation needs at least 2 (a context and a target).")
    rows = -(-(n - 1) // seq_len)
    for first in range(0, rows, batch_size):
        batch = BATCH_SCHEMA.padding(batch_size, seq_len)
        input_ids, labels = batch["input_ids"], batch["target_labels"]
        for i, row in enumerate(range(first, min(first + batch_size, rows))):
            chunk = np.asarray(tokens[row * seq_len : row * seq_len + seq_len + 1]).astype(np.int64)
            if vocab_size is not None and chunk.size and (chunk.max() >= vocab_size or chunk.min() < 0):
                bad = int(np.flatnonzero((chunk >= vocab_size) | (chunk < 0))[0])
                raise DataError(
                    f"{where} holds token id {int(chunk[bad])} at position {row * seq_len + bad}, outside the model's "
                    f"vocabulary [0, {vocab_size}); it was tokenized for another model (or its dtype is wrong)."
                )
            input_ids[i, : len(chunk) - 1] = chunk[:-1]
            labels[i, : len(chunk) - 1] = chunk[1:]
        real = labels != PAD_LABEL
        batch["target_weights"] = real.astype(np.float32)
        batch["segment_ids"] = real.astype(np.int32)
        batch["positions"] = np.broadcast_to(np.arange(seq_len, dtype=np.int32), labels.shape).copy()
        yield batch


class _FileBatches:
    """Windows of every file stream in turn, this process's rows only (every process reads the same files)."""

    def __init__(self, streams: list[tuple[str, np.ndarray]], seq_len: int, batch_size: int, vocab: int | None,
                 rows: np.ndarray):
        self._batches = (b for what, stream in streams for b in windows(stream, seq_len, batch_size, vocab, what))
        self._rows = rows
        self._next = next(self._batches, None)
        self.exhausted = self._next is None

    def __next__(self) -> dict[str, np.ndarray]:
        if self._next is None:
            raise StopIteration
        batch, self._next = self._next, next(self._batches, None)
        self.exhausted = self._next is None
        return {k: np.ascontiguousarray(v[self._rows]) for k, v in batch.items()}


def _data_streams(loaded: LoadedModel, tokenizer: Any, data: Sequence[str]) -> list[tuple[str, np.ndarray]]:
    """`(description, tokens [n])` per `data` file."""
    config = loaded.experiment.config
    vocab = getattr(config.model, "vocab_size", None)
    streams = []
    for path in data:
        suffix = pathlib.Path(path).suffix.lower()
        if suffix in TOKEN_FILE_SUFFIXES:
            dtype = TokenDtype.UINT32 if isinstance(vocab, int) and vocab > 1 << 16 else TokenDtype.UINT16
            source = TokenFile(TokenFile.default_config().set(path=path, dtype=dtype, eval_fraction=0.0))
            source.use_tokenizer(tokenizer, "--data")
            source.check()  # DataError for a missing file or a size that is not a whole number of ids.
            tokens = np.memmap(os.path.expanduser(path), dtype=np.dtype(dtype.value).newbyteorder("<"), mode="r")
            streams.append((f"token file {path} ({dtype.value})", tokens))
            continue
        if not os.path.isfile(os.path.expanduser(path)):
            raise EvalError(f"--data '{path}' is not a file; pass text, JSONL (.jsonl) or token (.bin) files.")
        fmt = TextFormat.JSONL if suffix == ".jsonl" else TextFormat.TEXT
        source = TextFiles(TextFiles.default_config().set(paths=[path], format=fmt, eval_fraction=0.0))
        source.use_tokenizer(tokenizer, "--data")
        documents = [source.to_document(*raw)["tokens"] for raw in source.raw_documents()]
        tokens = np.concatenate(documents) if documents else np.zeros(0, np.int32)
        streams.append((f"{fmt.value} file {path}", tokens))  # Its documents one after the other.
    return streams


def evaluate_run(
    path: str | os.PathLike,
    *,
    data: Sequence[str] = (),
    split: str = "validation",
    batch_size: int | None = None,
    seq_len: int | None = None,
    max_batches: int | None = None,
    step: int | None = None,
    overrides: Sequence[str] = (),
    report: Callable[[str], None] | None = None,
    objects: dict[str, Any] | None = None,
    progress: EvalProgress | None = None,
) -> EvalResult:
    """Loss and perplexity of the run (or checkpoint) at `path` on `data` (module docstring).

    Args:
        path: a run directory, its checkpoints/ or a step directory (`load_model`).
        data: files to evaluate on; empty = the experiment's input source.
        split: the source's split when `data` is empty: validation (= eval) or train.
        batch_size, seq_len: rows per batch and targets per row; None = the experiment's
            `input.batch_size` / `input.seq_len` (seq_len is checked against the model's
            position table like a config value).
        max_batches: stop after this many batches (over all streams); None = all.
        step: the checkpoint step; None = the latest committed (or the step directory's).
        overrides: more `PATH=VALUE` overrides of the run's config (e.g. the mesh).
        report: one line per checkpoint step skipped (load_model), and the line saying what is
            evaluated; default stderr (process 0).
        progress: the progress lines of a long evaluation; None: `EvalProgress` on stderr (process 0).

    Raises:
        EvalError, RunLoadError, DataError, ConfigError: bad arguments, run or data.
    """
    for name, value in (("--batch-size", batch_size), ("--seq-len", seq_len), ("--max-batches", max_batches)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise EvalError(f"{name} must be a positive integer, got {value!r}.")
    if not data and split not in SPLITS:
        raise EvalError(f"--split '{split}' is not a split; use one of {', '.join(SPLITS)}.")
    if not data and SPLITS[split] is Split.TRAIN and max_batches is None:
        raise EvalError("--split train reads the endless training stream; pass --max-batches N (its first N batches).")
    sizes = [f"input.batch_size={batch_size}"] * (batch_size is not None) + [f"input.seq_len={seq_len}"] * (seq_len is not None)
    say = report or _to_stderr
    loaded, placement = load_model_and_placement(path, step=step, overrides=[*overrides, *sizes], report=say,
                                                 objects=objects)
    config = loaded.experiment.config
    # The objective's eval step on the placed model (the one the trainer evaluates with); no optimizer.
    evaluator = Evaluator(placement, config.trainer.objective.instantiate())
    batch_size, seq_len = config.input.batch_size, config.input.seq_len
    vocab = getattr(config.model, "vocab_size", None)
    progress = progress or EvalProgress(sys.stderr if is_primary() else io.StringIO(), "eval")
    if data:
        streams = _data_streams(loaded, placement.tokenizer, data)
        layout = placement.shard_layout
        rows = np.concatenate([np.arange(s * layout.rows_per_shard, (s + 1) * layout.rows_per_shard)
                               for s in layout.shards])
        pipeline = _FileBatches(streams, seq_len, batch_size, vocab if isinstance(vocab, int) else None, rows)
        described = "; ".join(what for what, _ in streams)
        say(f"Evaluating step {loaded.step} of {loaded.source} on {described}{_bound(max_batches)}")
        totals = evaluator.evaluate(loaded.params, placement.loader(pipeline), max_batches or 0,
                                    progress=progress.for_stream(None, max_batches))
    else:
        described = f"the {split} split of the run's input pipeline"
        say(f"Evaluating step {loaded.step} of {loaded.source} on {described}{_plan(config.input, max_batches)}")
        totals = evaluate_input(evaluator, loaded.params, SPLITS[split], max_batches, progress=progress.for_stream)
    if totals.tokens <= 0:
        raise EvalError("No target token was evaluated; check the data and --max-batches.")
    return EvalResult(
        totals.loss, math.exp(totals.loss), int(round(totals.tokens)), totals.batches, batch_size, seq_len,
        totals.complete, loaded.step, str(loaded.source), described,
        {name: _component(part) for name, part in totals.components.items()},
    )


def _to_stderr(line: str) -> None:
    if is_primary():
        print(line, file=sys.stderr, flush=True)


def _bound(max_batches: int | None) -> str:
    return f" (the first {max_batches} batches)" if max_batches else " (all of it)"


def _plan(input_config: Any, max_batches: int | None) -> str:
    """The budget of each mixture component, as words (`component_budgets`), or `_bound` without a mixture."""
    if input_config.mixture is None:
        return _bound(max_batches)
    budgets = component_budgets([c.weight for c in input_config.mixture], max_batches)
    parts = [f"{c.name} {(f'{b} batch' + 'es' * (b > 1)) if b else 'whole split'}"
             for c, b in zip(input_config.mixture, budgets)]
    return f", each mixture component alone: {', '.join(parts)}"


def _component(totals: EvalTotals) -> dict[str, Any]:
    """One mixture component's entry of `EvalResult.components`."""
    loss = totals.loss
    return {"loss": loss, "perplexity": math.exp(loss) if math.isfinite(loss) else float("nan"),
            "tokens": int(round(totals.tokens)), "batches": totals.batches, "complete": totals.complete}


def format_result(result: EvalResult) -> str:
    """One human-readable line (plus a note when max_batches stopped early)."""
    line = (
        f"step {result.step} of {result.run_dir}: loss {result.loss:.6f} nats/token, perplexity {result.perplexity:.4f} "
        f"over {result.tokens} tokens ({result.batches} batches of {result.batch_size}x{result.seq_len}) on {result.data}"
    )
    if result.components:
        line += " (token-weighted over the mixture's components)"
    for name, part in result.components.items():
        line += (f"\n  {name}: loss {part['loss']:.6f} nats/token, perplexity {part['perplexity']:.4f} over "
                 f"{part['tokens']} tokens ({part['batches']} batches{', whole split' if part['complete'] else ''})")
    if not result.complete:
        line += f"\n(stopped after --max-batches {result.batches}: the rest of the data was not evaluated)"
    return line


def print_result(result: EvalResult, as_json: bool, out=None) -> None:
    """Prints the result to `out` (stdout): one line, or one JSON object (process 0 only)."""
    if not is_primary():
        return
    out = out or sys.stdout
    print(json.dumps(result.to_json()) if as_json else format_result(result), file=out)
