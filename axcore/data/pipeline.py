"""The input pipeline: documents -> packed batches, per data shard, in background threads, resumable.

The global batch of `batch_size` rows is the concatenation of `num_shards` data shards
(shard s owns rows `[s*R, (s+1)*R)`, `R = batch_size // num_shards`). Each shard is a
Grain pipeline built ONLY from its own documents, so one process holding shards [0, 1]
gives exactly the batch two processes holding [0] and [1] give:

1. documents of the split (`axcore/data/sources.py`, held-out rule there) of this
   shard: a random-access source takes its split's documents in a global order
   (shuffled with `seed` when `shuffle`) and keeps `order[s::S]`, then reshuffles them
   every epoch (`axcore.data.iterator.EpochOrder`) and repeats endlessly; a
   streamed source reads its files front to back, keeps every S-th document of the
   split and shuffles in a window of `shuffle_window` documents
   (`axcore/data/iterator.py`). EVAL is one pass in source order, never shuffled;
2. documents -> examples -> packed rows (`axcore/data/packing.py`: `long_documents`,
   `packing`); with `input.mixture`, each component on its own, then mixed by rows
   (`axcore/data/mixture.py`);
3. rows -> batches of R rows with the BATCH_SCHEMA fields; reading, tokenizing,
   packing and batching run in Grain's background threads, `prefetch` batches ahead
   (or, opt-in, in `worker_processes` processes with `mp_prefetch`).

TRAIN is endless. EVAL is one pass: a shard whose documents are used up yields
padding rows, and `exhausted` turns True once every shard's last batch with data has
been returned.

State (`state()` / `set_state()`, JSON-able): `{"format", "split", "num_shards",
"shards": {"<s>": <Grain iterator state>}}`, one entry per shard. Shards are the unit
of resume: any process count that divides the same `num_shards` continues exactly
(merge the shards' entries of all processes); another `num_shards` is refused with a
DataError (the documents-to-shard assignment would change).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Annotated, Any

import grain
import numpy as np
from absl import flags as absl_flags

from axcore.config import ConfigBase, InstantiableConfig, Length, NonNegative, Positive, Seed
from axcore.data.errors import DataError
from axcore.data.iterator import DocumentStream, EpochOrder
from axcore.data.mixture import MixtureComponent, check_components, mix_rows
from axcore.data.packing import LongDocuments, Packing, document_examples, pack, rows_to_batch
from axcore.data.schema import BATCH_SCHEMA
from axcore.data.sources import DataSource, EmbeddedCorpus, RandomAccessSource, Split, StreamedSource, as_split
from axcore.data.tokenizer import Tokenizer

# `format` of a saved pipeline state.
STATE_FORMAT = "axcore.input/1"


class InputConfig(ConfigBase):
    """Configures the input pipeline: data sources, and how their documents become packed batches."""

    # The data source (a registered one: embedded_corpus, prepared, jsonl_files, parquet_files, text_files, chat, token_file).
    source: InstantiableConfig = EmbeddedCorpus.default_config()
    # Named weighted sources mixed by rows; when set it replaces `source` (axcore/data/mixture.py).
    mixture: list[MixtureComponent] | None = None
    # Rows per global batch (all data shards together).
    batch_size: Annotated[int, Length] = 8
    # Tokens per row (targets per row).
    seq_len: Annotated[int, Length] = 256
    # Seed of the document order, the per-epoch shuffles and the packers' row shuffle.
    seed: Annotated[int, Seed] = 0
    # Whether TRAIN documents are shuffled (eval never is).
    shuffle: bool = True
    # How documents fill rows: first_fit, best_fit, concat (documents continue in the next row) or none.
    packing: Packing = Packing.FIRST_FIT
    # A document longer than a row: split (into row-sized segments) or error.
    long_documents: LongDocuments = LongDocuments.SPLIT
    # Rows first_fit/best_fit fill at once (more: less padding, more memory); at least the shard's rows.
    packing_bins: Annotated[int, Positive] = 64
    # Streamed sources: TRAIN documents are shuffled within windows of this many documents.
    shuffle_window: Annotated[int, Positive] = 1024
    # Batches each data shard prepares ahead in a background thread (0: none, on the caller's thread).
    prefetch: Annotated[int, NonNegative] = 2
    # Threads reading (and tokenizing) documents of random-access sources, per shard (0: on the pipeline thread).
    read_threads: Annotated[int, NonNegative] = 0
    # Worker processes per shard (Grain mp_prefetch; 0 = threads only). Random-access sources only.
    worker_processes: Annotated[int, NonNegative] = 0
    # Data shards the global batch is cut into (None: one per process); the unit of resume.
    data_shards: Annotated[int, Positive] | None = None

    def components(self) -> list[tuple[str, float, InstantiableConfig, str]]:
        """`(name, weight, source config, config path)` of each component ("source" without a mixture)."""
        if self.mixture is None:
            return [("source", 1.0, self.source, "input.source")]
        check_components(self.mixture)
        return [(c.name, c.weight, c.source, f"input.mixture[{i}].source") for i, c in enumerate(self.mixture)]

    def sources(
        self, tokenizer: Tokenizer | None = None, component: str | None = None
    ) -> list[tuple[str, float, DataSource]]:
        """`(name, weight, source)` of each component (or only the mixture's `component`), instantiated, with
        `tokenizer` and config paths set."""
        components = self.components()
        if component is not None:
            components = [c for c in components if c[0] == component and self.mixture is not None]
            if not components:
                raise DataError(f"input.mixture has no component '{component}'; its components are "
                                f"{[c.name for c in self.mixture or []]}.")
        out = []
        for name, weight, cfg, where in components:
            source = cfg.instantiate()
            if not isinstance(source, DataSource):
                raise DataError(
                    f"{where} builds {type(source).__name__}, which is not a DataSource; "
                    f"name a registered data source (e.g. type: prepared)."
                )
            source.use_tokenizer(tokenizer, where)
            out.append((name, weight, source))
        return out

    def check(self, tokenizer: Tokenizer | None = None) -> None:
        """Cheap checks of every source (paths exist, indexes readable); DataError naming the config path."""
        for _, _, source in self.sources(tokenizer):
            source.check()

    def make_pipeline(
        self,
        split: Split | str,
        tokenizer: Tokenizer | None = None,
        *,
        vocab_size: int | None = None,
        shards: Sequence[int] | None = None,
        num_shards: int = 1,
        component: str | None = None,
    ) -> InputPipeline:
        """The pipeline of `split` for data shards `shards` (None: all) of `num_shards` (module docstring).

        `component`: the rows of that mixture component alone, exactly the pipeline of an
        input whose `source` is that component's (how a mixture is evaluated,
        `axcore.placement.evaluate`); None: all components, mixed.

        `tokenizer` tokenizes text sources and is checked against prepared shards' (None:
        bytes, unchecked); `vocab_size`: token ids are checked against it per document.

        Raises:
            DataError: bad sizes, missing or malformed data (naming the file and config path).
        """
        return InputPipeline(self, as_split(split), tokenizer, vocab_size, shards, num_shards, component)

    def make_iterator(self, split: Split | str, tokenizer: Tokenizer | None = None, *, vocab_size: int | None = None):
        """Compatibility: `make_pipeline(split, ...)` over one shard; EVAL stops after its one pass."""
        pipeline = self.make_pipeline(split, tokenizer, vocab_size=vocab_size)
        pipeline.stop_when_exhausted = True
        return pipeline


class InputPipeline:
    """Batches of BATCH_SCHEMA fields `[len(shards) * rows_per_shard, seq_len]` (module docstring)."""

    def __init__(self, cfg: InputConfig, split: Split, tokenizer, vocab_size, shards, num_shards: int,
                 component: str | None = None):
        if not isinstance(num_shards, int) or num_shards < 1 or cfg.batch_size % num_shards:
            raise DataError(
                f"input.batch_size={cfg.batch_size} must be a multiple of the data shards ({num_shards}); "
                f"set input.data_shards or input.batch_size so that it divides."
            )
        self.shards = list(range(num_shards)) if shards is None else [int(s) for s in shards]
        if not self.shards or any(not 0 <= s < num_shards for s in self.shards) or len(set(self.shards)) != len(self.shards):
            raise DataError(f"Data shards {self.shards} must be distinct and in [0, {num_shards}).")
        self.split, self.num_shards = split, num_shards
        # Rows each data shard contributes to a batch.
        self.rows_per_shard = cfg.batch_size // num_shards
        self.seq_len = cfg.seq_len
        # EVAL only: raise StopIteration once exhausted (the make_iterator compatibility alias).
        self.stop_when_exhausted = False
        self._cfg, self._vocab_size = cfg, vocab_size
        self._sources = cfg.sources(tokenizer, component)
        for _, _, source in self._sources:  # Files of streamed sources are listed now, not at the first batch.
            if isinstance(source, StreamedSource):
                source.check()
        self._names = [name for name, _, _ in self._sources]
        if cfg.worker_processes and any(isinstance(s, StreamedSource) for _, _, s in self._sources):
            raise DataError("input.worker_processes needs random-access sources (prepared, ...); set it to 0.")
        self._datasets = {s: self._shard_dataset(s) for s in self.shards}
        self._iterators = {s: iter(ds) for s, ds in self._datasets.items()}
        # Stops the background threads when the pipeline is dropped or the interpreter exits (before teardown).
        self._finalizer = weakref.finalize(self, _close_all, self._iterators)
        self._ahead: dict[int, Any] = {}
        self._states: dict[int, Any] = {}
        self._started = False
        self._totals = np.zeros(len(self._names) + 1, np.int64)  # Tokens per component, then slots.

    # Building --------------------------------------------------------------------------------------

    def _documents(self, source: DataSource, shard: int) -> grain.IterDataset:
        cfg, train = self._cfg, self.split is Split.TRAIN
        if isinstance(source, StreamedSource):
            raw = DocumentStream(source, self.split, shard, self.num_shards)
            if train and cfg.shuffle:
                raw = grain.experimental.WindowShuffleIterDataset(raw, window_size=cfg.shuffle_window, seed=cfg.seed)
            return raw.map(lambda item: source.to_document(*item))
        if not isinstance(source, RandomAccessSource):
            raise DataError(f"{source.where}: {type(source).__name__} is neither a random-access nor a streamed source.")
        indices = source.split_indices(self.split)
        if train and cfg.shuffle:
            np.random.default_rng([cfg.seed, 0x5EED]).shuffle(indices)  # In place: no second array per document.
        mine = indices[shard :: self.num_shards]
        if len(mine) == 0:
            if train:
                raise DataError(
                    f"{source.where} ({source.describe()}): data shard {shard} of {self.num_shards} gets none of the "
                    f"{len(indices)} train documents; lower input.data_shards or add documents."
                )
            return grain.MapDataset.source([]).to_iter_dataset()
        order = EpochOrder(mine, cfg.seed, cfg.shuffle) if train else _Indices(mine)
        ds = grain.MapDataset.source(order).map(source.document)
        if cfg.worker_processes:
            if not absl_flags.FLAGS.is_parsed():  # Grain's workers read absl flags (defaults unless a program parsed them).
                absl_flags.FLAGS.mark_as_parsed()
            ds = ds.to_iter_dataset()
            return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_processes))
        read = grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=4 * cfg.read_threads)
        return ds.to_iter_dataset(read)

    def _shard_dataset(self, shard: int) -> grain.IterDataset:
        cfg, train = self._cfg, self.split is Split.TRAIN
        rows = {}
        for index, (name, _, source) in enumerate(self._sources):
            examples = grain.experimental.FlatMapIterDataset(
                self._documents(source, shard), _Examples(cfg, self._vocab_size)
            )
            packed = pack(
                examples, cfg.packing, cfg.seq_len,
                bins=max(cfg.packing_bins, self.rows_per_shard), seed=cfg.seed, shuffle=train,
            )
            rows[name] = packed.map(_Tag(index))
        if len(rows) == 1:
            mixed = next(iter(rows.values()))
        else:
            mixed = mix_rows(rows, {name: weight for name, weight, _ in self._sources}, train)
        batches = mixed.batch(self.rows_per_shard, drop_remainder=False)
        batches = batches.map(_Finish(self.rows_per_shard, len(self._names)))
        if cfg.prefetch:
            batches = grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=cfg.prefetch)
        return batches

    # Iterating -------------------------------------------------------------------------------------

    def _pull(self, shard: int) -> Any:
        """The next finished batch of `shard` (None once it is exhausted), its state recorded before it."""
        try:
            return next(self._iterators[shard])
        except StopIteration:
            if self.split is Split.TRAIN:
                raise DataError(f"Data shard {shard}'s train pipeline ended; it must be endless (a bug).") from None
            return None

    def _start(self) -> None:
        if not self._started:
            for s in self.shards:
                self._states[s] = self._iterators[s].get_state()
                self._ahead[s] = self._pull(s)
            self._started = True

    @property
    def exhausted(self) -> bool:
        """EVAL: every shard's last batch with data has been returned (TRAIN: never)."""
        self._start()
        return all(self._ahead[s] is None for s in self.shards)

    def __iter__(self) -> InputPipeline:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        self._start()
        if self.stop_when_exhausted and self.exhausted:
            raise StopIteration
        parts = []
        for s in self.shards:
            element = self._ahead[s]
            if element is None:
                element = _Finish(self.rows_per_shard, len(self._names))(None, self.seq_len)
            else:
                self._states[s] = self._iterators[s].get_state()
                self._ahead[s] = self._pull(s)
            parts.append(element)
        for part in parts:
            self._totals += part["counts"]
        return {name: np.concatenate([p[name] for p in parts]) for name in BATCH_SCHEMA.names}

    def counts(self) -> dict[str, int]:
        """Since the last call, additive: `data/tokens` (non-padding), `data/slots` (all token slots)
        and, with a mixture, `data/tokens/<component>`. `stats_from_counts` turns sums of these into metrics."""
        totals, self._totals = self._totals, np.zeros_like(self._totals)
        out = {"data/tokens": int(totals[:-1].sum()), "data/slots": int(totals[-1])}
        if self._cfg.mixture is not None:
            out.update({f"data/tokens/{name}": int(t) for name, t in zip(self._names, totals[:-1])})
        return out

    def stats(self) -> dict[str, float]:
        """Since the last call: packing efficiency (non-padding tokens / all), tokens, tokens per mixture component."""
        return stats_from_counts(self.counts())

    # State -----------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-able: where each of this pipeline's shards continues (module docstring)."""
        self._start()
        return {
            "format": STATE_FORMAT,
            "split": self.split.value,
            "num_shards": self.num_shards,
            "shards": {str(s): _jsonable(self._states[s]) for s in self.shards},
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from `state` (`state()` of this or of other processes' pipelines, merged).

        Raises:
            DataError: a malformed state, one of another split or number of data shards,
                or one that lacks a shard of this pipeline.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or not isinstance(state.get("shards"), dict):
            raise DataError(
                f"The saved input state is not an {STATE_FORMAT} state (got keys {sorted(state) if isinstance(state, dict) else state!r}); "
                f"it was saved by another version of the input pipeline; start the data from the beginning."
            )
        if state.get("num_shards") != self.num_shards or state.get("split") != self.split.value:
            raise DataError(
                f"The saved input state has {state.get('num_shards')} data shards ({state.get('split')}), this run "
                f"{self.num_shards} ({self.split.value}); resume with input.data_shards={state.get('num_shards')}."
            )
        missing = [s for s in self.shards if str(s) not in state["shards"]]
        if missing:
            raise DataError(f"The saved input state lacks data shards {missing}; merge the states of all processes.")
        for s in self.shards:
            iterator = self._iterators[s]
            try:
                iterator.set_state(_like(iterator.get_state(), state["shards"][str(s)]))
            except DataError:
                raise
            except (KeyError, TypeError, ValueError, IndexError) as e:
                raise DataError(
                    f"The saved input state of data shard {s} does not fit this pipeline ({type(e).__name__}: {e}); "
                    f"was it saved with other packing or sources?"
                ) from None
            self._states[s] = iterator.get_state()
            self._ahead[s] = self._pull(s)
        self._started = True

    def close(self) -> None:
        """Stops the background threads and processes."""
        self._finalizer()


def _close_all(iterators: dict) -> None:
    """Closes and drops the shards' iterators (so Grain's `__del__` never runs during interpreter teardown)."""
    for iterator in iterators.values():
        iterator.close()
    iterators.clear()


class _Examples(grain.experimental.FlatMapTransform):
    """A document -> its examples `{"x": int32 [m, 3]}` (axcore/data/packing.py)."""

    max_fan_out = 1 << 40

    def __init__(self, cfg: InputConfig, vocab_size: int | None):
        self._seq_len, self._long, self._vocab = cfg.seq_len, cfg.long_documents, vocab_size
        self._whole = cfg.packing is Packing.CONCAT

    def flat_map(self, document: dict[str, Any]) -> list[dict[str, np.ndarray]]:
        examples = document_examples(document, self._seq_len, self._long, self._vocab, self._whole)
        return [{"x": x} for x in examples]


class _Tag:
    """Marks a packed row with its mixture component's index."""

    def __init__(self, index: int):
        self._index = np.int32(index)

    def __call__(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**row, "component": self._index}


class _Finish:
    """Stacked rows -> the shard's batch (BATCH_SCHEMA fields) plus `counts`: tokens per component, then slots."""

    def __init__(self, rows: int, num_components: int):
        self._rows, self._num = rows, num_components

    def __call__(self, rows: dict[str, np.ndarray] | None, seq_len: int | None = None) -> dict[str, np.ndarray]:
        counts = np.zeros(self._num + 1, np.int64)
        if rows is None:  # An exhausted EVAL shard: padding only.
            batch = BATCH_SCHEMA.padding(self._rows, seq_len)
        else:
            batch = rows_to_batch(rows, self._rows)
            np.add.at(counts, rows["component"], (rows["x_segment_ids"] > 0).sum(axis=1))
            seq_len = rows["x_segment_ids"].shape[1]
        counts[-1] = self._rows * seq_len
        batch["counts"] = counts
        return batch


def _jsonable(value: Any) -> Any:
    """Grain state -> plain JSON types (tuples -> lists, NumPy scalars -> Python)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _like(template: Any, value: Any) -> Any:
    """`value` (a state read back from JSON) with lists turned back into tuples where `template` has tuples.

    Grain compares some state entries with tuples (ConcatThenSplit's remainder slices),
    which a JSON round trip turns into lists.
    """
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(template, dict) and isinstance(value, dict):
        out = dict(value)
        sample = next(iter(template.values()), None) if template else None
        for k, v in value.items():
            out[k] = _like(template.get(k, sample), v)
        return out
    if isinstance(template, list) and isinstance(value, list):
        return [_like(template[min(i, len(template) - 1)] if template else None, v) for i, v in enumerate(value)]
    return value


def stats_from_counts(counts: dict[str, int]) -> dict[str, float]:
    """Metrics from (summed) `InputPipeline.counts()`: `data/packing_efficiency` (tokens / slots) and the token counts."""
    slots = counts.get("data/slots", 0)
    out = {"data/packing_efficiency": counts.get("data/tokens", 0) / slots if slots else 0.0}
    out.update({k: float(v) for k, v in counts.items() if k != "data/slots"})
    return out


class _Indices(Sequence):
    """A 1-D integer array as a sequence of Python ints (no per-element objects kept)."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def __len__(self) -> int:
        return len(self._array)

    def __getitem__(self, i: int) -> int:
        return int(self._array[i])
