"""The batch schema: every field a training batch carries, declared once.

A batch is a dict of `[batch, seq]` arrays, one per field below. Rows may pack several
documents: `segment_ids` number the documents of a row from 1 (0 = padding), and
`positions` restart at 0 with each document. `target_labels[b, t]` is the token that
follows `input_ids[b, t]` in the same document, and `target_weights[b, t]` its weight in
the loss (0 for padding, for a token whose next token lies in another document, and for
tokens a loss mask excludes, such as a chat's user turns). No token attends to, or is
predicted from, another segment.

Every consumer (the trainer's compiled step, `axcore compile`, the sharding report,
evaluation, memory estimates) reads `BATCH_SCHEMA` instead of naming fields itself, so
a new field is one line here.

>>> sorted(BATCH_SCHEMA.names)
['input_ids', 'positions', 'segment_ids', 'target_labels', 'target_weights']
>>> BATCH_SCHEMA.padding(1, 3)["target_labels"].tolist()
[[-1, -1, -1]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from axcore.data.errors import DataError

# `target_labels` of padding; the loss ignores labels < 0.
PAD_LABEL = -1


@dataclasses.dataclass(frozen=True)
class BatchField:
    """One field of a batch: a `[batch, seq]` array."""

    # The key in the batch dict.
    name: str
    # NumPy dtype of the host array (and of the device array).
    dtype: str
    # Value at padding positions (rows or tail tokens that hold no data).
    pad: int | float
    # Logical axes of the array's dims, mapped to mesh axes by the axis rules.
    logical_axes: tuple[str, ...] = ("batch", "seq")
    # One line: what the field holds.
    doc: str = ""


class BatchSchema:
    """An ordered set of `BatchField`s: shapes, dtypes, padding and checks of a batch.

    All fields are `[batch_size, seq_len]`.
    """

    def __init__(self, fields: Iterable[BatchField]):
        self.fields: tuple[BatchField, ...] = tuple(fields)
        self._by_name = {f.name: f for f in self.fields}
        if len(self._by_name) != len(self.fields):
            raise ValueError(f"Batch fields must have distinct names, got {[f.name for f in self.fields]}.")

    @property
    def names(self) -> tuple[str, ...]:
        """Field names in declaration order."""
        return tuple(f.name for f in self.fields)

    def __getitem__(self, name: str) -> BatchField:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def shapes(self, batch_size: int, seq_len: int, sharding: Any = None) -> dict[str, Any]:
        """`{name: jax.ShapeDtypeStruct([batch_size, seq_len], dtype, sharding=sharding)}` (no arrays made)."""
        import jax  # The schema itself needs only NumPy.

        shape = (int(batch_size), int(seq_len))
        return {f.name: jax.ShapeDtypeStruct(shape, np.dtype(f.dtype), sharding=sharding) for f in self.fields}

    def padding(self, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
        """A batch of `batch_size` padding rows: every field filled with its `pad` value."""
        return {f.name: np.full((batch_size, seq_len), f.pad, np.dtype(f.dtype)) for f in self.fields}

    def check(self, batch: Mapping[str, Any], batch_size: int, seq_len: int, where: str = "The input batch") -> None:
        """Raises DataError naming the first missing, extra or misshapen field of `batch`."""
        missing = [n for n in self.names if n not in batch]
        extra = [n for n in batch if n not in self._by_name]
        if missing or extra:
            raise DataError(
                f"{where} has fields {sorted(batch)}, but the batch schema declares {list(self.names)} "
                f"(missing: {missing or 'none'}, unknown: {extra or 'none'}); a data source or transform "
                f"must produce exactly the declared fields."
            )
        for f in self.fields:
            array = batch[f.name]
            shape, dtype = tuple(getattr(array, "shape", ())), np.dtype(getattr(array, "dtype", object))
            if shape != (batch_size, seq_len) or dtype != np.dtype(f.dtype):
                raise DataError(
                    f"{where}: field '{f.name}' is {dtype} {list(shape)}, the schema declares "
                    f"{f.dtype} [{batch_size}, {seq_len}] (input.batch_size, input.seq_len)."
                )

    def check_accepted(self, accepted: Iterable[str], model: str) -> None:
        """Raises DataError if the batch carries a field `model` does not accept (naming it)."""
        accepted = set(accepted)
        refused = [n for n in self.names if n not in accepted]
        if refused:
            raise DataError(
                f"The batch carries {refused}, which {model} does not accept (it takes {sorted(accepted)}); "
                f"use a model whose forward takes these fields, or an input pipeline that does not produce them."
            )


# The batch every built-in input pipeline produces (see the module docstring).
BATCH_SCHEMA = BatchSchema(
    [
        BatchField("input_ids", "int32", 0, doc="token ids the model reads"),
        BatchField("target_labels", "int32", PAD_LABEL, doc="the next token of the same document; -1 = none"),
        BatchField("target_weights", "float32", 0.0, doc="loss weight of each target; 0 = not trained on"),
        BatchField("positions", "int32", 0, doc="position of each token within its document"),
        BatchField("segment_ids", "int32", 0, doc="document number within the row, from 1; 0 = padding"),
    ]
)

__all__ = ["BATCH_SCHEMA", "PAD_LABEL", "BatchField", "BatchSchema"]
