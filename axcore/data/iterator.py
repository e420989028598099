"""Packed, deterministic, resumable batches over a token stream.

The stream `tokens [N]` is cut into `num_windows = (N - 1) // seq_len` windows of
`seq_len + 1` tokens with stride `seq_len` (window `w` is
`tokens[w * seq_len : (w + 1) * seq_len + 1]`, so consecutive windows share one
token and every token but the first is a target exactly once). Row `r` of a batch
is one window: `input_ids[r] = window[:-1]`, `target_labels[r] = window[1:]`. The
last `(N - 1) % seq_len` tokens, fewer than one window, are never read.

Order: windows are visited epoch after epoch; within epoch `e` in the order
`np.random.default_rng([seed, e]).permutation(num_windows)` (or in stream order
without shuffling). A batch takes the next `batch_size` windows of that endless
sequence, so a batch may straddle two epochs and each epoch visits every window
exactly once. The position in the sequence is the whole state: `state()` gives
`{"epoch": e, "position": p}` (plain ints), and `set_state` continues exactly there.

Eval (`InputConfig.make_iterator(Split.EVAL)`): stream order, one pass, then
`StopIteration`. Its last batch is padded to `batch_size` rows with
`input_ids = 0` and `target_labels = -1`, which `CausalLM` gives zero weight, so
every eval window counts exactly once and batch shapes never change.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np

from axcore.config import ConfigBase, InstantiableConfig, Length, Seed
from axcore.data.errors import DataError
from axcore.data.schema import PAD_LABEL
from axcore.data.sources import DataSource, EmbeddedCorpus, Split, as_split
from axcore.data.tokenizer import Tokenizer



class BatchIterator:
    """Yields `{"input_ids": int32 [B, T], "target_labels": int32 [B, T]}` batches.

    Args:
        tokens: the 1-D integer token stream (an array or `np.memmap`; only the
            windows of each batch are read, the stream is never copied).
        batch_size: rows per batch, B.
        seq_len: tokens per row, T.
        seed: seeds the per-epoch shuffle (non-negative).
        shuffle: visit windows in a seeded random order per epoch, else in order.
        num_epochs: None (the default) iterates forever; a number stops after that
            many passes, padding the last batch (see the module docstring).
        vocab_size: if given, every batch's token ids are checked to lie in
            [0, vocab_size) as it is read (DataError naming the first bad id and where).
        source: how errors name the data, e.g. "Token file 'x.bin'".
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        vocab_size: int | None = None,
        source: str = "The token stream",
    ):
        if getattr(tokens, "ndim", None) != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(
                f"BatchIterator needs a 1-D integer token array, got "
                f"{getattr(tokens, 'dtype', type(tokens).__name__)} of shape {getattr(tokens, 'shape', '?')}."
            )
        for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("seed", seed, 0)):
            if not _is_int(value) or value < low:
                raise DataError(f"Input {name} must be an integer >= {low}, got {value!r}.")
        if num_epochs is not None and (not _is_int(num_epochs) or num_epochs < 1):
            raise DataError(f"num_epochs must be None (endless) or an integer >= 1, got {num_epochs!r}.")
        num_windows = (len(tokens) - 1) // seq_len
        if num_windows < 1:
            raise DataError(
                f"The token stream has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                f"lower seq_len or add data."
            )
        self._tokens = tokens
        # Rows per batch.
        self.batch_size = int(batch_size)
        # Tokens per row.
        self.seq_len = int(seq_len)
        # Seed of the per-epoch permutation.
        self.seed = int(seed)
        # Whether windows are permuted per epoch.
        self.shuffle = bool(shuffle)
        # Passes before StopIteration; None is endless.
        self.num_epochs = num_epochs
        # Windows per epoch.
        self.num_windows = int(num_windows)
        self._offsets = np.arange(self.seq_len + 1, dtype=np.int64)
        # Token ids must lie below this (None: unchecked).
        self.vocab_size = vocab_size
        self._source = source
        self._epoch = 0
        self._position = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def num_batches(self) -> int | None:
        """Batches in all for a finite iterator (from the start), None if endless."""
        if self.num_epochs is None:
            return None
        return -(-self.num_epochs * self.num_windows // self.batch_size)

    def window_order(self, epoch: int) -> np.ndarray:
        """Window indices `[num_windows]` in the order epoch `epoch` visits them."""
        if not self.shuffle:
            return np.arange(self.num_windows, dtype=np.int64)
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _exhausted(self) -> bool:
        return self.num_epochs is not None and self._epoch >= self.num_epochs

    def _take_windows(self) -> np.ndarray:
        """The next (up to) `batch_size` window indices; advances the state."""
        parts, wanted = [], self.batch_size
        while wanted and not self._exhausted():
            take = min(wanted, self.num_windows - self._position)
            parts.append(self.window_order(self._epoch)[self._position : self._position + take])
            wanted -= take
            self._position += take
            if self._position == self.num_windows:
                self._epoch, self._position = self._epoch + 1, 0
        return np.concatenate(parts).astype(np.int64)

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._exhausted():
            raise StopIteration
        windows = self._take_windows()
        # [rows, T + 1]: fancy indexing reads just these tokens (also from a memmap).
        positions = windows[:, None] * self.seq_len + self._offsets
        chunk = np.asarray(self._tokens[positions])
        if self.vocab_size is not None and chunk.size and (chunk.max() >= self.vocab_size or chunk.min() < 0):
            bad = np.flatnonzero((chunk >= self.vocab_size) | (chunk < 0))[0]
            raise DataError(
                f"{self._source} holds token id {int(chunk.flat[bad])} at position {int(positions.flat[bad])}, "
                f"outside the model's vocabulary [0, {self.vocab_size}); the data was tokenized for another "
                f"vocabulary, or its dtype is wrong (e.g. TokenFile.dtype), or model.vocab_size is too small."
            )
        chunk = chunk.astype(np.int32)
        input_ids = np.zeros((self.batch_size, self.seq_len), np.int32)
        target_labels = np.full((self.batch_size, self.seq_len), PAD_LABEL, np.int32)
        input_ids[: len(windows)] = chunk[:, :-1]
        target_labels[: len(windows)] = chunk[:, 1:]
        return {"input_ids": input_ids, "target_labels": target_labels}

    def state(self) -> dict[str, int]:
        """Where the next batch starts: `{"epoch": int, "position": int}` (JSON-safe)."""
        return {"epoch": self._epoch, "position": self._position}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from `state` (from `state()` of an iterator over the same data).

        `set_state({"epoch": 0, "position": 0})` rewinds to the start.

        Raises:
            DataError: if `state` is malformed or does not fit this iterator.
        """
        if not isinstance(state, dict) or set(state) != {"epoch", "position"}:
            raise DataError(
                f"Input iterator state must be a mapping with exactly the keys 'epoch' and "
                f"'position', got {state!r}; pass what BatchIterator.state() returned."
            )
        epoch, position = _as_int(state["epoch"]), _as_int(state["position"])
        if epoch is None or position is None or epoch < 0 or not 0 <= position < self.num_windows:
            raise DataError(
                f"Input iterator state {state!r} does not fit this data: it needs integers "
                f"epoch >= 0 and 0 <= position < {self.num_windows} (windows per epoch). Was it "
                f"saved for other data or another seq_len?"
            )
        if self.num_epochs is not None and (epoch > self.num_epochs or (epoch == self.num_epochs and position)):
            raise DataError(
                f"Input iterator state {state!r} lies past the end of this {self.num_epochs}-epoch iterator."
            )
        self._epoch, self._position = epoch, position


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _as_int(value: Any) -> int | None:
    """`value` as an int if it is an integer (also a NumPy scalar or 0-d array, as a
    checkpoint may restore it), else None."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    return int(value) if _is_int(value) else None


class InputConfig(ConfigBase):
    """Configures the input pipeline: a data source and how it is batched."""

    # The data source: a registered one (embedded_corpus, text_files, token_file, ...).
    source: InstantiableConfig = EmbeddedCorpus.default_config()
    # Sequences per batch.
    batch_size: Annotated[int, Length] = 8
    # Tokens per sequence (a window holds seq_len + 1 tokens).
    seq_len: Annotated[int, Length] = 256
    # Seed of the per-epoch shuffle of the train split.
    seed: Annotated[int, Seed] = 0
    # Whether the train split visits windows in seeded random order (eval never shuffles).
    shuffle: bool = True

    def make_iterator(
        self, split: Split, tokenizer: Tokenizer | None = None, *, vocab_size: int | None = None
    ) -> BatchIterator:
        """Batches of `split`: TRAIN is endless (shuffled per `shuffle`), EVAL one pass in order.

        `tokenizer` tokenizes text sources (None: bytes); pre-tokenized sources ignore it.
        `vocab_size`: token ids are checked against it as batches are read.

        Raises:
            DataError: if the source's data is missing or malformed, or the split is
                shorter than one window.
        """
        split = as_split(split)
        source = self.source.instantiate()
        if not isinstance(source, DataSource):
            raise DataError(
                f"input.source builds {type(source).__name__}, which is not a DataSource; "
                f"name a registered data source (e.g. type: embedded_corpus)."
            )
        source.use_tokenizer(tokenizer)
        tokens = source.tokens(split)
        train = split is Split.TRAIN
        try:
            return BatchIterator(
                tokens,
                batch_size=self.batch_size,
                seq_len=self.seq_len,
                seed=self.seed,
                shuffle=self.shuffle and train,
                num_epochs=None if train else 1,
                vocab_size=vocab_size,
                source=f"The {split.value} split of {type(source).__name__}",
            )
        except DataError as e:
            raise DataError(f"The {split.value} split of {type(source).__name__}: {e}") from None
