"""`axcore prepare`: tokenize a corpus once into prepared token shards (format: `axcore/data/shards.py`).

Work units. The inputs are cut into units by a rule that looks at the input alone
(never at the worker count): files are taken in order and filled into units of about
`shard_size_mb` megabytes of input; a JSONL (or chat JSONL) file larger than the room
left is cut at a line start (`readers.line_start_at`), a Parquet file between row
groups (sized by their uncompressed bytes), a text file (one document) never. Small
files share a unit. Unit i becomes shard i, so any worker count writes the same bytes.

Workers. Units run in worker processes (`multiprocessing`'s "spawn" context, since
JAX may live in the parent), each building the tokenizer from its config once and
encoding with one thread (`TOKENIZERS_PARALLELISM=false`: N workers use N cores). With
one worker, or one unit left, the work runs in this process. Documents whose
encoding is empty are dropped.

Resume. `prepare.json` (the inputs with their sizes and modification times, the
format, field, tokenizer fingerprint, dtype, unit size and chat settings) is written
before any shard. Started again with the same arguments, prepare skips every shard
whose done.json describes the same unit and whose files have the recorded sizes, and
redoes the rest; other arguments, or a directory holding anything else, are refused
in one line. index.json is written last, once every shard is done.

Progress goes to `stream` (stderr in the CLI): documents, tokens, MB/s of input and
the ETA, on one updated line on a terminal, else one line every few seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import queue as queue_module
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import numpy as np

from axcore.data.errors import DataError
from axcore.data.prepare_progress import Progress
from axcore.data.readers import (
    exact_location,
    expand_paths,
    iter_chat_records,
    iter_text_documents,
    line_start_at,
    parquet_row_groups,
)
from axcore.data.shards import (
    INDEX_FILE,
    claim_output_directory,
    read_done,
    shard_name,
    token_dtype,
    write_index,
    write_shard,
)

# Input formats `axcore prepare` reads ("chat": JSONL of messages, rendered with a chat template).
FORMATS = ("text", "jsonl", "parquet", "chat")
# The value of prepare.json's "format".
RUN_FORMAT = "axcore.prepare/1"
# The field (JSONL key, Parquet column) read when none is given.
DEFAULT_FIELD = {"text": "text", "jsonl": "text", "parquet": "text", "chat": "messages"}
# Files taken from a directory given as input, per format (all files for "text").
SUFFIXES = {"text": (), "jsonl": (".jsonl",), "parquet": (".parquet",), "chat": (".jsonl",)}
# Texts encoded per `Tokenizer.encode_documents` call, and their most characters.
_BATCH_DOCUMENTS = 1024
_BATCH_CHARS = 1 << 20
# Seconds between progress messages from a worker.
_REPORT_SECONDS = 0.5


@dataclasses.dataclass(frozen=True)
class PrepareSpec:
    """What every unit needs; picklable (sent to the worker processes)."""

    # Input format: one of FORMATS.
    format: str
    # JSONL key / Parquet column holding the text (the messages, for chat).
    field: str
    # The tokenizer's config (an InstantiableConfig); every worker instantiates it once.
    tokenizer: Any
    # Token dtype of the shards ("uint16" or "uint32").
    dtype: str
    # The tokenizer's vocab size (ids at or above it are an error).
    vocab_size: int
    # Chat only: a jinja2 template file overriding the tokenizer's template; None = the tokenizer's.
    chat_template: str | None = None
    # Chat only: which tokens carry loss ("assistant" or "all").
    train_on: str = "assistant"


def plan_units(files: Sequence[str], format: str, field: str, unit_bytes: int) -> list[dict]:
    """Cuts `files` into work units of about `unit_bytes` input bytes (module docstring); JSON-safe dicts.

    A unit is `{"pieces": [...], "bytes": n}`; a piece is `{"path", "start", "end"}`
    (a byte range; the whole file for text) or `{"path", "row_groups": [...]}` (Parquet).

    Raises:
        DataError: an empty or unreadable file, naming it.
    """
    units: list[dict] = []
    pieces: list[dict] = []
    size = 0

    def close() -> None:
        nonlocal pieces, size
        if pieces:
            units.append({"pieces": pieces, "bytes": size})
        pieces, size = [], 0

    for path in files:
        total = _file_size(path)
        if format == "parquet":
            for group, (rows, nbytes) in enumerate(parquet_row_groups(path, field)):
                if rows == 0:
                    continue
                if pieces and pieces[-1]["path"] == path:
                    pieces[-1]["row_groups"].append(group)
                else:
                    pieces.append({"path": path, "row_groups": [group]})
                size += max(int(nbytes), 1)
                if size >= unit_bytes:
                    close()
            continue
        if total == 0:
            raise DataError(f"Data file '{path}' is empty; fill it or remove it from the inputs.")
        start = 0
        while start < total:
            room = unit_bytes - size
            end = total if format == "text" or total - start <= room else line_start_at(path, start + room)
            pieces.append({"path": path, "start": start, "end": end})
            size += end - start
            start = end
            if size >= unit_bytes:
                close()
    close()
    return units


def _file_size(path: str) -> int:
    try:
        if not os.path.isfile(path):
            raise DataError(f"Data file '{path}' is not a regular file; name files, directories or globs.")
        with open(path, "rb"):
            pass
        return os.path.getsize(path)
    except OSError as e:
        raise DataError(f"Data file '{path}' cannot be read: {e.strerror or e}; fix its permissions or the path.") from None


# -- One unit -> one shard ------------------------------------------------------------------


class _Counter:
    """Counts a unit's documents, tokens and input bytes, and reports them every `_REPORT_SECONDS`."""

    def __init__(self, report: Callable[[int, int, int], None], unit_bytes: int):
        self._report, self._unit_bytes = report, unit_bytes
        self.documents = self.tokens = self.bytes = 0
        self._sent = [0, 0, 0]
        self._last = time.monotonic()

    def add(self, documents: int, tokens: int, nbytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.bytes = min(self.bytes + nbytes, self._unit_bytes)
        if time.monotonic() - self._last >= _REPORT_SECONDS:
            self.flush()

    def flush(self, *, final: bool = False) -> None:
        if final:
            self.bytes = self._unit_bytes
        now = [self.documents, self.tokens, self.bytes]
        delta = [a - b for a, b in zip(now, self._sent)]
        if any(delta):
            self._report(*delta)
        self._sent, self._last = now, time.monotonic()


def _text_batches(unit: dict, spec: PrepareSpec) -> Iterator[tuple[list[str], list[str]]]:
    """(locations, texts) batches of a unit's documents, in order."""
    locations: list[str] = []
    texts: list[str] = []
    chars = 0
    for piece in unit["pieces"]:
        if "row_groups" in piece:
            documents = iter_text_documents(piece["path"], "parquet", spec.field, row_groups=piece["row_groups"])
        elif spec.format == "text":
            documents = iter_text_documents(piece["path"], "text", spec.field)
        else:
            documents = iter_text_documents(piece["path"], "jsonl", spec.field, byte_range=(piece["start"], piece["end"]))
        for location, text in documents:
            locations.append(location)
            texts.append(text)
            chars += len(text)
            if len(texts) >= _BATCH_DOCUMENTS or chars >= _BATCH_CHARS:
                yield locations, texts
                locations, texts, chars = [], [], 0
    if texts:
        yield locations, texts


def _check_ids(documents: Sequence[np.ndarray], spec: PrepareSpec, locations: Sequence[str]) -> None:
    """Raises DataError naming the first document with an id outside 0..vocab_size-1."""
    for ids, location in zip(documents, locations):
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= spec.vocab_size):
            raise DataError(
                f"{exact_location(location)}: the tokenizer produced id {int(ids.max())} outside 0..{spec.vocab_size - 1} "
                f"(its vocab size); fix the tokenizer's vocab size."
            )


def process_unit(
    directory: str, index: int, unit: dict, spec: PrepareSpec, tokenizer: Any, template: Any, report: Callable
) -> dict:
    """Tokenizes unit `index` and writes it as shard `index`; returns the shard's done record.

    `report(documents, tokens, input_bytes)` receives increments as the work goes.
    """
    dtype = np.dtype(spec.dtype)
    counter = _Counter(report, int(unit["bytes"]))
    parts: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths: list[int] = []
    if spec.format == "chat":
        from axcore.data.chat import render_chat  # The chat renderer needs jinja2; only chat data imports it.

        for piece in unit["pieces"]:
            for location, messages in iter_chat_records(piece["path"], spec.field, byte_range=(piece["start"], piece["end"])):
                try:
                    document = render_chat(messages, tokenizer, template, train_on=spec.train_on, where=location)
                except DataError:  # Again, naming the exact line (counted only now, for the error).
                    render_chat(messages, tokenizer, template, train_on=spec.train_on, where=exact_location(location))
                    raise
                ids = document["tokens"]
                _check_ids([ids], spec, [location])
                if len(ids):
                    parts.append(ids.astype(dtype))
                    masks.append(np.asarray(document["loss_mask"], np.uint8))
                    lengths.append(len(ids))
                counter.add(1 if len(ids) else 0, len(ids), sum(len(m["content"]) for m in messages))
    else:
        for locations, texts in _text_batches(unit, spec):
            encoded = tokenizer.encode_documents(texts)
            if len(encoded) != len(texts):
                raise DataError(
                    f"{type(tokenizer).__name__}.encode_documents returned {len(encoded)} arrays for {len(texts)} "
                    f"documents; it must return one per document."
                )
            kept = [np.asarray(ids).reshape(-1) for ids in encoded if len(ids)]
            batch = np.concatenate(kept) if kept else np.zeros(0, np.int32)
            if len(batch) and (int(batch.min()) < 0 or int(batch.max()) >= spec.vocab_size):
                _check_ids([np.asarray(ids).reshape(-1) for ids in encoded], spec, locations)
            if len(batch):
                parts.append(batch.astype(dtype))
                lengths.extend(len(ids) for ids in kept)
            counter.add(len(kept), len(batch), sum(len(t) for t in texts))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    loss_mask = (np.concatenate(masks) if masks else np.zeros(0, np.uint8)) if spec.format == "chat" else None
    record = write_shard(directory, shard_name(index), tokens, offsets, loss_mask, unit)
    counter.flush(final=True)
    return record


def _build(spec: PrepareSpec) -> tuple[Any, Any]:
    """(tokenizer, chat template or None) built from the spec."""
    tokenizer = spec.tokenizer.instantiate()
    template = None
    if spec.format == "chat":
        from axcore.data.chat import ChatTemplate

        template = ChatTemplate.for_tokenizer(tokenizer, spec.chat_template, field="--chat-template")
    return tokenizer, template


# Per worker process: the tokenizer, template, spec and progress queue (set by `_init_worker`).
_WORKER: dict[str, Any] = {}


def _init_worker(progress: Any, spec: PrepareSpec, directory: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # One core per worker.
    _WORKER.update(progress=progress, spec=spec, directory=directory)


def _worker_unit(task: tuple[int, dict]) -> dict:
    index, unit = task
    w = _WORKER
    if "tokenizer" not in w:  # Built by the first task, not the initializer: a failure is then the task's error.
        w["tokenizer"], w["template"] = _build(w["spec"])
    return process_unit(
        w["directory"], index, unit, w["spec"], w["tokenizer"], w["template"], lambda *d: w["progress"].put(d)
    )


@contextlib.contextmanager
def _one_thread_tokenizers() -> Iterator[None]:
    """`TOKENIZERS_PARALLELISM=false` while prepare works in this process (one worker: one core)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


# -- The command's work ---------------------------------------------------------------------


def prepare(
    inputs: Sequence[str],
    output: str,
    *,
    format: str = "jsonl",
    field: str | None = None,
    tokenizer: Any = None,
    workers: int | None = None,
    shard_size_mb: float = 64.0,
    verify: bool = False,
    chat_template: str | None = None,
    train_on: str = "assistant",
    stream: TextIO | None = None,
    created_by: str = "axcore prepare",
) -> dict:
    """Tokenizes the files named by `inputs` into prepared shards in `output`; returns the index.

    Args:
        inputs: files, directories or globs (`readers.expand_paths`).
        output: the dataset directory (created; resumed when it holds this run's shards).
        format: one of FORMATS.
        field: the JSONL key / Parquet column (chat: the messages key); None = DEFAULT_FIELD.
        tokenizer: the tokenizer's config (InstantiableConfig); None = bytes.
        workers: worker processes; None = every core.
        shard_size_mb: input megabytes per work unit (= shard).
        verify: check every file's sha256 at the end (`PreparedShards.verify`).
        chat_template: a template file for chat data (None: the tokenizer's, else axcore's default).
        train_on: chat only: "assistant" or "all".
        stream: where progress goes (None: nowhere).
        created_by: index.json's "created_by".

    Raises:
        DataError: bad inputs, an empty corpus, an output directory that holds
            something else or another run (one line each).
    """
    from axcore.data.shards import PreparedShards

    _check_arguments(format, shard_size_mb, workers)
    field = field or DEFAULT_FIELD[format]
    files = [os.path.abspath(f) for f in expand_paths(inputs, "INPUT", suffixes=SUFFIXES[format])]
    built, spec, chat = _spec(format, field, tokenizer, chat_template, train_on)
    fingerprint, dtype = built.fingerprint(), np.dtype(spec.dtype)
    units = plan_units(files, format, field, max(int(shard_size_mb * (1 << 20)), 1))
    if not units:
        raise DataError(f"The inputs ({len(files)} files) hold no documents; give files with text in them.")
    inputs_record = [{"path": f, "bytes": os.path.getsize(f), "mtime_ns": os.stat(f).st_mtime_ns} for f in files]
    run = json.loads(json.dumps({
        "format": RUN_FORMAT, "inputs": inputs_record, "input_format": format, "field": field,
        "tokenizer": fingerprint, "dtype": dtype.name, "shard_size_mb": shard_size_mb, "chat": chat,
    }))
    output = os.path.abspath(os.path.expanduser(output))
    progress = Progress(stream, sum(u["bytes"] for u in units), len(units))
    if claim_output_directory(output, run):
        if verify:
            progress.say(f"{output} is already prepared from these inputs; verifying its files (sha256)...")
            PreparedShards(output, field="--output").verify()
        with open(os.path.join(output, INDEX_FILE), encoding="utf-8") as f:
            return json.load(f)
    records, pending = _resumed(output, units, progress)
    count = min(workers or os.cpu_count() or 1, len(pending))
    progress.say(f"{len(files)} files, {progress.total_bytes / 1e6:.1f} MB in {len(units)} shards ({len(units) - len(pending)}"
                 f" done before), tokenizer {type(built).__name__}, {max(count, 1)} worker{'s' * (count > 1)}")
    _process(output, pending, spec, count, progress, records)
    progress.show(final=True)
    ordered = [records[i] for i in range(len(units))]
    if not sum(r["documents"] for r in ordered):
        raise DataError(
            f"The inputs ({len(files)} files) hold no documents once tokenized (every text is empty); "
            f"give files with text in them."
        )
    extra = {"vocab_size": int(built.vocab_size), **({"chat": chat} if chat else {})}
    index = write_index(output, fingerprint, dtype, format == "chat", ordered, inputs_record, created_by, extra)
    if verify:
        progress.say(f"verifying the {len(units)} shards and the index (sha256)...")
        PreparedShards(output, field="--output").verify()
    return index


def _check_arguments(format: str, shard_size_mb: float, workers: int | None) -> None:
    """DataError (one line naming the flag) for an unknown format, a non-positive shard size or worker count."""
    if format not in FORMATS:
        raise DataError(f"--format {format!r} is not one of {', '.join(FORMATS)}.")
    if not shard_size_mb > 0:
        raise DataError(f"--shard-size-mb must be positive, got {shard_size_mb}.")
    if workers is not None and workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}.")


def _spec(format: str, field: str, tokenizer: Any, chat_template: str | None, train_on: str):
    """`(tokenizer, spec, chat)`: the built tokenizer, the workers' PrepareSpec, and for chat data the
    template's sha256 and `train_on` as index.json records them (None otherwise)."""
    from axcore.data.tokenizer import ByteTokenizer

    tokenizer_config = tokenizer if tokenizer is not None else ByteTokenizer.default_config()
    built = tokenizer_config.instantiate()
    dtype = token_dtype(built.vocab_size)
    spec = PrepareSpec(format, field, tokenizer_config, dtype.name, int(built.vocab_size), chat_template, train_on)
    chat = None
    if format == "chat":
        from axcore.data.chat import ChatTemplate, TrainOn

        template = ChatTemplate.for_tokenizer(built, chat_template, field="--chat-template")
        chat = {"template_sha256": template.sha256, "train_on": TrainOn(train_on).value}
    return built, spec, chat


def _resumed(output: str, units: list[dict], progress: Progress) -> tuple[dict[int, dict], list[tuple[int, dict]]]:
    """`(records, pending)`: the records of the units a previous run finished (by unit index) and the rest."""
    records: dict[int, dict] = {}
    pending = []
    for i, unit in enumerate(units):
        record = read_done(output, shard_name(i), unit)
        if record is None:
            pending.append((i, unit))
        else:
            records[i] = record
            progress.skipped(record, unit["bytes"])
    return records, pending


def _process(output: str, pending: list, spec: PrepareSpec, count: int, progress: Progress, records: dict) -> None:
    """Tokenizes the `pending` units into `records` (by unit index): in this process when `count` <= 1,
    else in a pool of `count` workers."""
    if count <= 1:
        with _one_thread_tokenizers():
            tok, template = _build(spec)
            for i, unit in pending:
                records[i] = process_unit(output, i, unit, spec, tok, template, _reporter(progress))
                progress.done_shards += 1
                progress.show()
    elif pending:
        _run_pool(output, pending, spec, count, progress, records)


def _reporter(progress: Progress) -> Callable[[int, int, int], None]:
    def report(documents: int, tokens: int, nbytes: int) -> None:
        progress.add(documents, tokens, nbytes)
        progress.show()

    return report


def _run_pool(output: str, pending: list, spec: PrepareSpec, count: int, progress: Progress, records: dict) -> None:
    """Runs `pending` units on `count` spawned worker processes; a failure stops them all at once."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    with context.Pool(count, initializer=_init_worker, initargs=(messages, spec, output)) as pool:
        results = {i: pool.apply_async(_worker_unit, ((i, unit),)) for i, unit in pending}
        while results:
            try:
                progress.add(*messages.get(timeout=0.2))
                while True:
                    progress.add(*messages.get_nowait())
            except queue_module.Empty:
                pass
            for i in [i for i, r in results.items() if r.ready()]:
                records[i] = results.pop(i).get()  # Re-raises a worker's error (the pool is then terminated).
                progress.done_shards += 1
            progress.show()
        pool.close()
        pool.join()  # Workers exit cleanly, so their last progress messages are flushed.
    with contextlib.suppress(queue_module.Empty):
        while True:
            progress.add(*messages.get(timeout=0.05))
