"""Packing: documents -> rows of `seq_len` tokens with segment ids and per-document positions.

A document `{"tokens": t [n], "loss_mask": w [n]}` becomes one *example* of n - 1
targets, `x = [t[:-1], t[1:], w[1:]]` as int32 `[n - 1, 3]` (input id, target label,
target weight), so no target crosses a document boundary; a document of fewer than 2
tokens has no target and is dropped. An example longer than a row (`seq_len` targets)
follows `long_documents`: `split` cuts it into pieces of `seq_len` targets (piece k
covers `tokens[k*L : k*L + L + 1]`, so each target is kept once), each its own segment
with positions from 0; `error` raises DataError naming the document.

`packing` then fills rows (`grain.experimental` packers over the one feature "x"):

- `first_fit` / `best_fit`: `FirstFitPackIterDataset` / `BestFitPackIterDataset` over
  groups of `packing_bins` rows: each example goes, whole, into the first (tightest)
  row of the group it fits; a group is emitted (rows shuffled, seeded, for TRAIN) when
  an example fits none. Padding only at row ends.
- `concat`: `ConcatThenSplitIterDataset`: examples are concatenated and cut every
  `seq_len` targets, so a document may continue in the next row (its continuation is a
  new segment whose positions restart at 0). No padding but the very last row.
- `none`: one example per row, padded.

`rows_to_batch` turns a batch of packed rows into the BATCH_SCHEMA fields: `segment_ids`
are the packers' (1-based per row, 0 = padding), `positions` restart at 0 per segment,
and padding gets `input_ids = 0`, `target_labels = -1`, `target_weights = 0`.
"""

from __future__ import annotations

import enum
from typing import Any

import grain
import numpy as np

from axcore.data.errors import DataError
from axcore.data.schema import BATCH_SCHEMA, PAD_LABEL


class Packing(enum.Enum):
    """How examples fill rows (module docstring)."""

    CONCAT = "concat"
    FIRST_FIT = "first_fit"
    BEST_FIT = "best_fit"
    NONE = "none"


class LongDocuments(enum.Enum):
    """What happens to a document with more targets than a row holds (module docstring)."""

    # Cut into pieces of seq_len targets, each its own segment.
    SPLIT = "split"
    # DataError naming the document (e.g. for chat data, where a cut conversation is wrong).
    ERROR = "error"


def document_examples(
    document: dict[str, Any], seq_len: int, long_documents: LongDocuments, vocab_size: int | None, whole: bool
) -> list[np.ndarray]:
    """A document -> its examples, int32 `[m, 3]` each with m <= seq_len (or one, uncut, if `whole`).

    `whole` keeps a long document in one example (for `concat`, which cuts rows itself)
    unless `long_documents` is `error`.

    Raises:
        DataError: a token id outside [0, vocab_size), a loss mask of another length, or
            a document longer than a row with `long_documents: error`; naming the document.
    """
    tokens = np.asarray(document["tokens"]).reshape(-1)
    n = len(tokens)
    if n < 2:
        return []
    where = document.get("location", "a document")
    if vocab_size is not None:
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            raise DataError(
                f"{where} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}); the data was "
                f"tokenized for another vocabulary (or its dtype is wrong), or model.vocab_size is too small."
            )
    x = np.empty((n - 1, 3), np.int32)
    x[:, 0] = tokens[:-1]
    x[:, 1] = tokens[1:]
    mask = document.get("loss_mask")
    if mask is None:
        x[:, 2] = 1
    else:
        mask = np.asarray(mask).reshape(-1)
        if len(mask) != n:
            raise DataError(f"{where}: its loss_mask has {len(mask)} entries for {n} tokens; they must match.")
        x[:, 2] = mask[1:]
    if n - 1 > seq_len:
        if long_documents is LongDocuments.ERROR:
            raise DataError(
                f"{where} has {n} tokens, more than a row holds ({seq_len} targets, input.seq_len); raise "
                f"input.seq_len, shorten the document, or set input.long_documents: split to cut it."
            )
        if not whole:
            return [x[i : i + seq_len] for i in range(0, n - 1, seq_len)]
    return [x]


def _pad_one(example: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """One example -> one padded row in the packers' output layout (`packing: none`)."""
    m = len(example)
    x = np.zeros((seq_len, 3), np.int32)
    x[:m] = example
    segment_ids = np.zeros(seq_len, np.int32)
    segment_ids[:m] = 1
    positions = np.zeros(seq_len, np.int32)
    positions[:m] = np.arange(m, dtype=np.int32)
    return {"x": x, "x_segment_ids": segment_ids, "x_positions": positions}


def pack(
    examples: grain.IterDataset, packing: Packing, seq_len: int, *, bins: int, seed: int, shuffle: bool
) -> grain.IterDataset:
    """Examples `{"x": int32 [m, 3]}` -> rows `{"x": [seq_len, 3], "x_segment_ids", "x_positions": [seq_len]}`."""
    length = {"x": seq_len}
    if packing is Packing.CONCAT:
        return grain.experimental.ConcatThenSplitIterDataset(examples, length_struct=length)
    if packing is Packing.NONE:
        return examples.map(lambda e: _pad_one(e["x"], seq_len))
    packer = {
        Packing.FIRST_FIT: grain.experimental.FirstFitPackIterDataset,
        Packing.BEST_FIT: grain.experimental.BestFitPackIterDataset,
    }[packing]
    return packer(examples, length_struct=length, num_packing_bins=bins, seed=seed, shuffle_bins=shuffle)


def rows_to_batch(rows: dict[str, np.ndarray], num_rows: int) -> dict[str, np.ndarray]:
    """Stacked packed rows (`[r, seq_len, ...]`, r <= num_rows) -> BATCH_SCHEMA fields `[num_rows, seq_len]`.

    Rows r..num_rows-1 are padding (module docstring).
    """
    x, segment_ids, positions = rows["x"], rows["x_segment_ids"], rows["x_positions"]
    r, seq_len = segment_ids.shape
    batch = BATCH_SCHEMA.padding(num_rows, seq_len)
    real = segment_ids > 0
    batch["input_ids"][:r] = np.where(real, x[..., 0], 0)
    batch["target_labels"][:r] = np.where(real, x[..., 1], PAD_LABEL)
    batch["target_weights"][:r] = np.where(real, x[..., 2], 0).astype(np.float32)
    batch["positions"][:r] = np.where(real, positions, 0)
    batch["segment_ids"][:r] = segment_ids
    return batch
