"""The input pipeline: packed batches checked against plain NumPy/Python constructions, shards, eval, bad input."""

import json

import numpy as np
import pytest

from axcore.config import REQUIRED
from axcore.data import (
    BATCH_SCHEMA,
    DataError,
    InputConfig,
    LongDocuments,
    Packing,
    RandomAccessSource,
    Split,
)


class ListSource(RandomAccessSource):
    """Documents given in the config (token lists, optional 0/1 loss masks)."""

    class Config(RandomAccessSource.Config):
        """Configures ListSource."""

        # The documents' token ids.
        documents: list[list[int]] = REQUIRED
        # Per document a loss mask of its length, or [] for none.
        masks: list[list[int]] = []

    def num_documents(self):
        return len(self._config.documents)

    def document(self, index):
        doc = {"tokens": np.asarray(self._config.documents[index], np.int32), "location": f"list document {index}"}
        if self._config.masks and self._config.masks[index]:
            doc["loss_mask"] = np.asarray(self._config.masks[index], np.uint8)
        return doc


def list_source(documents, masks=(), eval_fraction=0.0):
    return ListSource.default_config().set(documents=documents, masks=list(masks), eval_fraction=eval_fraction)


def eval_only(documents, masks=()):
    """A source whose eval split is exactly `documents`, in order (a dummy document 0 is the train split)."""
    masks = [[], *masks] if masks else []
    return list_source([[7, 7], *documents], masks, eval_fraction=0.9999)


def tagged_documents(lengths, base=1000):
    """Document d holds ids d*base .. d*base + n - 1 (so every token names its document and index)."""
    return [list(range(d * base, d * base + n)) for d, n in enumerate(lengths)]


def take(pipeline, n):
    return [next(pipeline) for _ in range(n)]


def segments(batch):
    """(row, segment id) -> (input ids, labels, weights, positions) of every segment."""
    out = {}
    for r in range(batch["segment_ids"].shape[0]):
        for s in np.unique(batch["segment_ids"][r]):
            if s:
                m = batch["segment_ids"][r] == s
                out[r, int(s)] = tuple(batch[k][r][m] for k in ("input_ids", "target_labels", "target_weights", "positions"))
    return out


# Packing vs independent constructions -------------------------------------------------------------


def expected_examples(documents, seq_len):
    """Each document -> (inputs, labels) pieces of at most seq_len targets (long_documents: split)."""
    pieces = []
    for doc in documents:
        t = np.asarray(doc)
        for i in range(0, len(t) - 1, seq_len):
            pieces.append((t[:-1][i : i + seq_len], t[1:][i : i + seq_len]))
    return pieces


def first_fit_rows(pieces, seq_len, bins):
    """Plain-Python first fit over groups of `bins` rows, emitted in row order: lists of pieces per row."""
    rows, group = [], [[] for _ in range(bins)]
    for piece in pieces:
        fill = [sum(len(p[0]) for p in row) for row in group]
        free = [i for i in range(bins) if fill[i] + len(piece[0]) <= seq_len]
        if not free:
            rows.extend(row for row in group if row)
            group = [[] for _ in range(bins)]
            free = [0]
        group[free[0]].append(piece)
    rows.extend(row for row in group if row)
    return rows


def dense(rows, seq_len, num_rows):
    """Rows of pieces -> BATCH_SCHEMA arrays, written with plain loops."""
    out = {name: np.full((num_rows, seq_len), BATCH_SCHEMA[name].pad, BATCH_SCHEMA[name].dtype) for name in BATCH_SCHEMA.names}
    for r, row in enumerate(rows):
        at = 0
        for segment, (inputs, labels) in enumerate(row, start=1):
            for i in range(len(inputs)):
                out["input_ids"][r, at] = inputs[i]
                out["target_labels"][r, at] = labels[i]
                out["target_weights"][r, at] = 1.0
                out["positions"][r, at] = i
                out["segment_ids"][r, at] = segment
                at += 1
    return out


LENGTHS = [5, 9, 3, 14, 2, 7, 8, 1, 6, 11, 4]


def eval_pipeline(packing, lengths=LENGTHS, seq_len=8, batch_size=4, **kw):
    source = eval_only(tagged_documents(lengths))
    cfg = InputConfig(source=source, batch_size=batch_size, seq_len=seq_len, packing=packing, packing_bins=batch_size, **kw)
    return cfg.make_pipeline(Split.EVAL)


def collect(pipeline):
    batches = []
    while not pipeline.exhausted:
        batches.append(next(pipeline))
    return {k: np.concatenate([b[k] for b in batches]) for k in BATCH_SCHEMA.names}


def assert_batches_equal(got, want):
    for name in BATCH_SCHEMA.names:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_first_fit_rows_equal_a_plain_first_fit():
    got = collect(eval_pipeline(Packing.FIRST_FIT))
    rows = first_fit_rows(expected_examples(tagged_documents(LENGTHS), 8), 8, bins=4)
    assert_batches_equal(got, dense(rows, 8, len(got["input_ids"])))


def test_none_packing_puts_one_piece_per_row():
    got = collect(eval_pipeline(Packing.NONE))
    rows = [[piece] for piece in expected_examples(tagged_documents(LENGTHS), 8)]
    assert_batches_equal(got, dense(rows, 8, len(got["input_ids"])))


def test_concat_packing_cuts_the_joined_examples_every_row():
    got = collect(eval_pipeline(Packing.CONCAT))
    # Whole documents (no pre-splitting), joined, cut every 8 targets; a cut document continues as a new segment.
    rows, row, fill = [], [], 0
    for doc in tagged_documents(LENGTHS):
        inputs, labels = np.asarray(doc[:-1]), np.asarray(doc[1:])
        while len(inputs):
            take_n = min(8 - fill, len(inputs))
            row.append((inputs[:take_n], labels[:take_n]))
            inputs, labels, fill = inputs[take_n:], labels[take_n:], fill + take_n
            if fill == 8:
                rows, row, fill = rows + [row], [], 0
    rows += [row] if row else []
    assert_batches_equal(got, dense(rows, 8, len(got["input_ids"])))


@pytest.mark.parametrize("packing", list(Packing))
def test_train_segments_never_cross_documents_and_cover_each_epoch(packing):
    lengths = [int(n) for n in np.random.default_rng(0).integers(1, 40, size=30)]
    docs = tagged_documents(lengths)
    cfg = InputConfig(source=list_source(docs), batch_size=4, seq_len=16, packing=packing, seed=7, packing_bins=4)
    pipeline = cfg.make_pipeline(Split.TRAIN)
    counts = {}
    for batch in take(pipeline, 60):
        assert batch["positions"][batch["segment_ids"] == 0].max(initial=0) == 0
        assert np.all(batch["target_labels"][batch["segment_ids"] == 0] == -1)
        for inputs, labels, weights, positions in segments(batch).values():
            d = inputs[0] // 1000
            assert np.all(inputs // 1000 == d) and np.all(labels // 1000 == d), "a segment spans two documents"
            np.testing.assert_array_equal(labels, inputs + 1)  # The next token of the same document.
            np.testing.assert_array_equal(np.diff(inputs), 1)  # Contiguous within the document.
            np.testing.assert_array_equal(positions, np.arange(len(inputs)))
            assert np.all(weights == 1)
            for t in inputs:
                counts[t] = counts.get(t, 0) + 1
    # Every target of every document is seen, and as often as any other (up to the epoch in progress).
    targets = [t for doc in docs for t in doc[:-1]]
    assert set(counts) == set(targets)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_loss_masks_become_target_weights():
    docs = tagged_documents([6, 4])
    masks = [[0, 0, 1, 1, 0, 1], [1, 0, 1, 1]]
    cfg = InputConfig(source=eval_only(docs, masks), batch_size=1, seq_len=16)
    batch = next(cfg.make_pipeline(Split.EVAL))
    np.testing.assert_array_equal(batch["target_weights"][0, :8], [0, 1, 1, 0, 1, 0, 1, 1])
    assert np.all(batch["target_weights"][0, 8:] == 0)


def test_packing_efficiency_and_tokens_are_counted():
    pipeline = eval_pipeline(Packing.FIRST_FIT)
    got = collect(pipeline)
    stats = pipeline.stats()
    real = int((got["segment_ids"] > 0).sum())
    assert real == sum(n - 1 for n in LENGTHS if n > 1)
    assert stats["data/tokens"] == real
    assert stats["data/packing_efficiency"] == pytest.approx(real / got["segment_ids"].size)
    assert pipeline.stats()["data/tokens"] == 0  # Since the last call.


# Shards ---------------------------------------------------------------------------------------------


def test_one_process_with_two_shards_equals_two_processes_with_one_each():
    docs = tagged_documents([int(n) for n in np.random.default_rng(1).integers(2, 30, size=40)])
    cfg = InputConfig(source=list_source(docs), batch_size=6, seq_len=12, seed=3)
    both = cfg.make_pipeline(Split.TRAIN, shards=[0, 1], num_shards=2)
    first, second = (cfg.make_pipeline(Split.TRAIN, shards=[s], num_shards=2) for s in (0, 1))
    assert both.rows_per_shard == 3
    for _ in range(10):
        whole, a, b = next(both), next(first), next(second)
        for name in BATCH_SCHEMA.names:
            np.testing.assert_array_equal(whole[name], np.concatenate([a[name], b[name]]))
        # Shard 0 reads only its documents: even positions of the global order, none of shard 1's.
        docs_a = {int(t) // 1000 for t in a["input_ids"][a["segment_ids"] > 0]}
        docs_b = {int(t) // 1000 for t in b["input_ids"][b["segment_ids"] > 0]}
        assert not docs_a & docs_b
    merged = {**first.state(), "shards": {**first.state()["shards"], **second.state()["shards"]}}
    resumed = cfg.make_pipeline(Split.TRAIN, shards=[0, 1], num_shards=2)
    resumed.set_state(json.loads(json.dumps(merged)))
    assert_batches_equal(next(resumed), next(both))


def test_batch_size_must_divide_into_shards():
    cfg = InputConfig(source=list_source(tagged_documents([5] * 8)), batch_size=6)
    with pytest.raises(DataError, match="multiple of the data shards"):
        cfg.make_pipeline(Split.TRAIN, num_shards=4)


# Eval -----------------------------------------------------------------------------------------------


def test_eval_is_one_pass_then_padding_and_the_compat_iterator_stops():
    lengths = [9] * 20
    docs = tagged_documents(lengths)
    cfg = InputConfig(source=list_source(docs, eval_fraction=0.25), batch_size=2, seq_len=8)
    held_out = [k for k in range(20) if (k + 1) // 4 > k // 4]  # floor((k+1)/4) > floor(k/4)
    pipeline = cfg.make_pipeline(Split.EVAL)
    seen = []
    while not pipeline.exhausted:
        batch = next(pipeline)
        seen += sorted({int(t) // 1000 for t in batch["input_ids"][batch["segment_ids"] > 0]})
    assert seen == held_out
    assert np.all(next(pipeline)["segment_ids"] == 0)  # Padding from then on.
    train = {int(t) // 1000 for b in take(cfg.make_pipeline(Split.TRAIN), 20) for t in b["input_ids"][b["segment_ids"] > 0]}
    assert train == set(range(20)) - set(held_out)
    assert len(list(cfg.make_iterator(Split.EVAL))) == 3  # 5 documents of 8 targets: one row each, 2 rows a batch.


def test_eval_shards_pad_when_their_documents_run_out():
    cfg = InputConfig(source=eval_only(tagged_documents([9] * 3)), batch_size=2, seq_len=8)
    pipeline = cfg.make_pipeline(Split.EVAL, num_shards=2)
    first = next(pipeline)  # Shard 0: documents 0 and 2; shard 1: document 1.
    assert [int(first["input_ids"][r, 0]) // 1000 for r in range(2)] == [0, 1]
    second = next(pipeline)
    assert int(second["input_ids"][0, 0]) // 1000 == 2 and np.all(second["segment_ids"][1] == 0)
    assert pipeline.exhausted


# Bad input ------------------------------------------------------------------------------------------


def test_a_document_longer_than_a_row_with_long_documents_error():
    cfg = InputConfig(source=list_source(tagged_documents([5, 30])), batch_size=2, seq_len=8,
                      long_documents=LongDocuments.ERROR)
    with pytest.raises(DataError, match=r"^list document 1 has 30 tokens, more than a row holds \(8 targets"):
        take(cfg.make_pipeline(Split.TRAIN), 3)


def test_token_ids_are_checked_against_the_vocabulary():
    cfg = InputConfig(source=list_source([[1, 2, 3], [4, 300, 5]]), batch_size=2, seq_len=8)
    with pytest.raises(DataError, match=r"^list document 1 holds token id 300, outside the model's vocabulary \[0, 256\)"):
        take(cfg.make_pipeline(Split.TRAIN, vocab_size=256), 2)


def test_an_empty_corpus_and_an_empty_split_are_errors():
    with pytest.raises(DataError, match=r"^input.source \(ListSource\): the train split holds no documents \(0 in all"):
        InputConfig(source=list_source([])).make_pipeline(Split.TRAIN)
    with pytest.raises(DataError, match=r"the eval split holds no documents \(3 in all, eval_fraction=0.0\)"):
        InputConfig(source=list_source([[1, 2]] * 3)).make_pipeline(Split.EVAL)


def test_a_shard_without_documents_is_an_error():
    cfg = InputConfig(source=list_source([[1, 2, 3]] * 3), batch_size=4)
    with pytest.raises(DataError, match="data shard 3 of 4 gets none of the 3 train documents; lower input.data_shards"):
        cfg.make_pipeline(Split.TRAIN, num_shards=4)
