"""Pipeline state and mixtures: bit-identical resume, proportions, weights changed on resume, prepared shards."""

import json

import numpy as np
import pytest
from test_pipeline import ListSource, list_source, tagged_documents, take

from axcore.data import (
    BATCH_SCHEMA,
    ByteTokenizer,
    DataError,
    InputConfig,
    JsonlFiles,
    MixtureComponent,
    Packing,
    Prepared,
    Split,
)
from axcore.data.shards import write_index, write_shard


def write_prepared(directory, documents, fingerprint, shard_docs=4):
    """Prepared shards of `documents` (lists of ids) with A's writer, `shard_docs` documents per shard."""
    directory.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(0, len(documents), shard_docs):
        part = documents[i : i + shard_docs]
        tokens = np.concatenate([np.asarray(d, np.uint16) for d in part])
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in part])]).astype(np.int64)
        records.append(write_shard(str(directory), f"shard-{i // shard_docs:05d}", tokens, offsets, None, {}))
    write_index(str(directory), fingerprint, np.uint16, False, records, [], "test")
    return str(directory)


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def mixture_config(tmp_path, packing, weights=(2.0, 1.0)):
    rng = np.random.default_rng(0)
    prepared = write_prepared(
        tmp_path / "prepared", [list(rng.integers(0, 100, size=n)) for n in rng.integers(2, 60, size=40)],
        ByteTokenizer().fingerprint(),
    )
    jsonl = write_jsonl(tmp_path / "b.jsonl", ["".join(chr(200 + k % 50) for k in range(n)) for n in rng.integers(2, 40, size=50)])
    components = [
        MixtureComponent(name="web", weight=weights[0], source=Prepared.default_config().set(paths=[prepared])),
        MixtureComponent(name="books", weight=weights[1], source=JsonlFiles.default_config().set(paths=[jsonl])),
    ]
    return InputConfig(mixture=components, batch_size=4, seq_len=16, packing=packing, seed=5, shuffle_window=8)


def assert_same(got, want):
    for name in BATCH_SCHEMA.names:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("packing", [Packing.FIRST_FIT, Packing.CONCAT])
def test_a_restored_pipeline_yields_exactly_the_uninterrupted_batches(tmp_path, packing):
    cfg = mixture_config(tmp_path, packing)
    pipeline = cfg.make_pipeline(Split.TRAIN, ByteTokenizer(), vocab_size=256)
    states, batches = [], []
    for _ in range(40):  # Several epochs of the prepared component.
        states.append(json.loads(json.dumps(pipeline.state())))
        batches.append(next(pipeline))
    for k in (0, 7, 23, 31):
        resumed = cfg.make_pipeline(Split.TRAIN, ByteTokenizer(), vocab_size=256)
        resumed.set_state(states[k])
        for want in batches[k : k + 9]:
            assert_same(next(resumed), want)
        resumed.close()
    pipeline.close()


def component_rows(batches, component_of):
    """Per component, the rows (as bytes) in the order the mixed stream gave them."""
    rows = {}
    for batch in batches:
        for r in range(len(batch["input_ids"])):
            rows.setdefault(component_of(batch, r), []).append(batch["input_ids"][r].tobytes() + batch["segment_ids"][r].tobytes())
    return rows


def by_first_token(batch, r):
    return "a" if batch["input_ids"][r, 0] < 500 else "b"


def two_lists(weights, batch_size=100):
    rng = np.random.default_rng(2)
    a = [list(rng.integers(0, 500, size=n)) for n in rng.integers(2, 30, size=60)]
    b = [list(rng.integers(500, 1000, size=n)) for n in rng.integers(2, 30, size=60)]
    components = [MixtureComponent(name=n, weight=w, source=list_source(d)) for n, w, d in zip("ab", weights, (a, b))]
    return InputConfig(mixture=components, batch_size=batch_size, seq_len=16, seed=1, prefetch=0)


def test_mixture_proportions_over_10000_sequences_are_within_2_percent_of_the_weights():
    cfg = two_lists((0.7, 0.3))
    pipeline = cfg.make_pipeline(Split.TRAIN)
    batches = take(pipeline, 100)
    stats = pipeline.stats()
    rows = component_rows(batches, by_first_token)
    assert len(rows["a"]) + len(rows["b"]) == 10_000
    assert abs(len(rows["a"]) / 10_000 - 0.7) < 0.02
    # Tokens per component, counted independently from the rows.
    tokens_a = sum(int((b["segment_ids"][b["input_ids"][:, 0] < 500] > 0).sum()) for b in batches)
    assert stats["data/tokens/a"] == tokens_a
    assert stats["data/tokens/a"] + stats["data/tokens/b"] == stats["data/tokens"]


def test_a_weight_changed_on_resume_changes_only_what_comes_after():
    before = two_lists((1.0, 1.0), batch_size=10)
    pipeline = before.make_pipeline(Split.TRAIN)
    first = take(pipeline, 30)
    state = json.loads(json.dumps(pipeline.state()))
    uninterrupted = component_rows(first + take(pipeline, 300), by_first_token)

    after = two_lists((3.0, 1.0), batch_size=10)
    resumed = after.make_pipeline(Split.TRAIN)
    resumed.set_state(state)
    later = take(resumed, 100)
    done = component_rows(first, by_first_token)
    rows = component_rows(later, by_first_token)
    # Each component continues exactly where it stopped: no row replayed, none skipped.
    for name in "ab":
        start = len(done[name])
        assert rows[name] == uninterrupted[name][start : start + len(rows[name])]
    # And from the resume on, rows follow the new weights.
    assert abs(len(rows["a"]) / 1000 - 0.75) < 0.02


def test_a_state_of_other_shards_or_format_is_refused():
    cfg = InputConfig(source=list_source(tagged_documents([9] * 8)), batch_size=4, seq_len=8)
    state = cfg.make_pipeline(Split.TRAIN, num_shards=2).state()
    with pytest.raises(DataError, match=r"has 2 data shards \(train\), this run 1 \(train\); resume with input.data_shards=2"):
        cfg.make_pipeline(Split.TRAIN).set_state(state)
    with pytest.raises(DataError, match="is not an axcore.input/1 state"):
        cfg.make_pipeline(Split.TRAIN).set_state({"epoch": 0, "position": 3})
    with pytest.raises(DataError, match=r"lacks data shards \[1\]; merge the states of all processes"):
        cfg.make_pipeline(Split.TRAIN, shards=[1], num_shards=2).set_state({**state, "shards": {"0": state["shards"]["0"]}})


def test_prepared_shards_are_read_in_order(tmp_path):
    docs = tagged_documents([5, 9, 3, 14, 2, 7, 8, 6, 11], base=100)
    first = write_prepared(tmp_path / "one", docs[:5], ByteTokenizer().fingerprint(), shard_docs=2)
    second = write_prepared(tmp_path / "two", docs[5:], ByteTokenizer().fingerprint())
    source = Prepared.default_config().set(paths=[str(tmp_path / "o*"), second + "/index.json"]).instantiate()
    source.use_tokenizer(ByteTokenizer())
    assert source.num_documents() == 9 and first
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(source.document(i)["tokens"], doc)


def test_prepared_shards_of_another_tokenizer_are_refused(tmp_path):
    other = dict(ByteTokenizer().fingerprint(), sha256="0" * 64)
    path = write_prepared(tmp_path / "shards", [[1, 2, 3]] * 4, other)
    cfg = InputConfig(source=Prepared.default_config().set(paths=[path]))
    with pytest.raises(DataError, match=r"^input.source.paths\[0\]: the shards in '.*shards' were prepared with tokenizer"):
        cfg.make_pipeline(Split.TRAIN, ByteTokenizer())


def test_a_missing_prepared_directory_names_the_config_path(tmp_path):
    cfg = InputConfig(source=Prepared.default_config().set(paths=[str(tmp_path / "nowhere")]))
    with pytest.raises(DataError, match=r"^input.source.paths\[0\]: '.*nowhere' is not a prepared-shard directory"):
        cfg.check()


def test_mixture_errors_name_the_component():
    cfg = InputConfig(mixture=[MixtureComponent(name="x", source=ListSource.default_config()),
                               MixtureComponent(name="x", source=list_source([[1, 2]]))])
    with pytest.raises(DataError, match=r"input.mixture\[1\].name 'x' repeats input.mixture\[0\]"):
        cfg.make_pipeline(Split.TRAIN)
