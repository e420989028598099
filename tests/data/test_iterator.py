"""BatchIterator: packing, shifted targets, determinism, epochs, resumable state; InputConfig."""

import json

import numpy as np
import pytest

from axcore.data import PAD_LABEL, BatchIterator, DataError, InputConfig, Split, TextFiles, TokenFile

B, T = 4, 16


def stream(n=1000, seed=0):
    return np.random.default_rng(seed).integers(0, 50_000, size=n).astype(np.uint16)


def make(tokens=None, **kwargs):
    kwargs = {"batch_size": B, "seq_len": T, "seed": 0, "shuffle": True, **kwargs}
    return BatchIterator(stream() if tokens is None else tokens, **kwargs)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        np.testing.assert_array_equal(x["input_ids"], y["input_ids"])
        np.testing.assert_array_equal(x["target_labels"], y["target_labels"])


def window_index(tokens, row):
    """Which window a batch row is, found by matching it against direct numpy slices."""
    matches = [w for w in range((len(tokens) - 1) // T) if np.array_equal(tokens[w * T : w * T + T], row)]
    assert len(matches) == 1
    return matches[0]


def test_shapes_dtypes_and_shifted_targets():
    tokens = stream()
    it = make(tokens)
    assert it.num_windows == (1000 - 1) // T
    for batch in take(it, 5):
        assert set(batch) == {"input_ids", "target_labels"}
        for key in batch:
            assert batch[key].shape == (B, T) and batch[key].dtype == np.int32
        np.testing.assert_array_equal(batch["input_ids"][:, 1:], batch["target_labels"][:, :-1])
        for row_in, row_tg in zip(batch["input_ids"], batch["target_labels"]):
            w = window_index(tokens, row_in)
            np.testing.assert_array_equal(row_in, tokens[w * T : (w + 1) * T])
            np.testing.assert_array_equal(row_tg, tokens[w * T + 1 : (w + 1) * T + 1])


def test_unshuffled_order_is_the_stream():
    tokens = stream()
    it = make(tokens, shuffle=False)
    batch = next(it)
    expected = np.stack([tokens[r * T : r * T + T + 1] for r in range(B)]).astype(np.int32)
    np.testing.assert_array_equal(batch["input_ids"], expected[:, :-1])
    np.testing.assert_array_equal(batch["target_labels"], expected[:, 1:])


def test_order_follows_seed_and_epoch_permutation():
    it = make(seed=7)
    order = np.random.default_rng([7, 0]).permutation(it.num_windows)
    np.testing.assert_array_equal(it.window_order(0), order)
    batch = next(it)
    tokens = stream()
    np.testing.assert_array_equal(batch["input_ids"], np.stack([tokens[w * T : w * T + T] for w in order[:B]]))


def test_deterministic_for_a_seed_and_different_across_seeds():
    assert_same_batches(take(make(seed=3), 10), take(make(seed=3), 10))
    a, b = next(make(seed=3)), next(make(seed=4))
    assert not np.array_equal(a["input_ids"], b["input_ids"])


def test_each_epoch_covers_every_window_once():
    tokens = np.arange(10 * T + 1, dtype=np.int32)  # Window w starts with token w * T: easy to identify.
    it = BatchIterator(tokens, batch_size=3, seq_len=T, seed=1)
    assert it.num_windows == 10
    rows = np.concatenate([b["input_ids"][:, 0] // T for b in take(it, 10)])  # 30 windows = 3 epochs.
    epochs = [rows[i * 10 : (i + 1) * 10] for i in range(3)]
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(10))
    assert not np.array_equal(epochs[0], epochs[1])  # Each epoch has its own permutation.
    assert it.state() == {"epoch": 3, "position": 0}


def test_batches_straddle_epochs_and_small_streams_work():
    tokens = np.arange(2 * T + 1, dtype=np.int32)  # Two windows, batch of four: two epochs per batch.
    it = BatchIterator(tokens, batch_size=4, seq_len=T, seed=0)
    first = next(it)["input_ids"][:, 0] // T
    assert sorted(first[:2].tolist()) == [0, 1] and sorted(first[2:].tolist()) == [0, 1]
    assert it.state() == {"epoch": 2, "position": 0}


def test_resume_yields_the_same_batches():
    original = make(seed=5)
    take(original, 7)
    state = original.state()
    assert all(type(v) is int for v in state.values())
    expected = take(original, 12)  # Crosses into the next epoch (62 windows, 4 per batch).
    restored = {k: np.asarray(v) for k, v in state.items()}  # As a checkpoint may give it back.
    for saved in (state, json.loads(json.dumps(state)), restored):
        resumed = make(seed=5)
        resumed.set_state(saved)
        assert_same_batches(take(resumed, 12), expected)


def test_state_rewinds():
    it = make()
    first = take(it, 3)
    it.set_state({"epoch": 0, "position": 0})
    assert_same_batches(take(it, 3), first)


@pytest.mark.parametrize(
    "state",
    [
        None,
        {"epoch": 0},
        {"epoch": 0, "position": 0, "extra": 1},
        {"epoch": -1, "position": 0},
        {"epoch": 0, "position": 62},  # 62 windows: positions 0..61.
        {"epoch": 0, "position": "3"},
        {"epoch": True, "position": 0},
    ],
)
def test_invalid_state(state):
    with pytest.raises(DataError, match="state"):
        make().set_state(state)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"seq_len": 0}, "seq_len must be an integer >= 1"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"tokens": np.zeros((2, 2), np.int32)}, "1-D integer"),
        ({"tokens": np.zeros(T, np.int32)}, r"16 tokens, fewer than seq_len \+ 1 = 17"),
    ],
)
def test_invalid_arguments(kwargs, pattern):
    with pytest.raises(DataError, match=pattern):
        make(**kwargs)


def test_batches_index_the_memmap_without_copying_it(tmp_path):
    ids = stream(5000)
    path = tmp_path / "t.bin"
    ids.tofile(path)
    source = TokenFile.default_config().set(path=str(path), eval_fraction=0.0).instantiate()
    tokens = source.tokens(Split.TRAIN)
    assert isinstance(tokens, np.memmap)
    it = BatchIterator(tokens, batch_size=B, seq_len=T, seed=0, shuffle=False)
    batch = next(it)
    np.testing.assert_array_equal(batch["input_ids"][1], ids[T : 2 * T])


def test_finite_iterator_pads_its_last_batch():
    tokens = np.arange(6 * T + 1, dtype=np.int32)  # Six windows, batches of four: 4 + (2 + 2 padding).
    it = BatchIterator(tokens, batch_size=4, seq_len=T, seed=0, shuffle=False, num_epochs=1)
    assert it.num_batches == 2
    batches = list(it)
    assert len(batches) == 2
    last = batches[1]
    np.testing.assert_array_equal(last["input_ids"][:2], np.stack([tokens[w * T : w * T + T] for w in (4, 5)]))
    assert (last["input_ids"][2:] == 0).all() and (last["target_labels"][2:] == PAD_LABEL).all()
    assert it.state() == {"epoch": 1, "position": 0}
    with pytest.raises(StopIteration):
        next(it)


# -- InputConfig ---------------------------------------------------------------------------


def test_input_config_defaults():
    cfg = InputConfig()
    assert (cfg.batch_size, cfg.seq_len, cfg.seed, cfg.shuffle) == (8, 256, 0, True)
    it = cfg.make_iterator(Split.TRAIN)
    batch = next(it)
    assert batch["input_ids"].shape == (8, 256)
    assert batch["input_ids"].max() < 256


def test_input_config_train_and_eval_iterators(tmp_path):
    records = [f"document {i} " * 10 for i in range(20)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in records), encoding="utf-8")
    source = TextFiles.default_config().set(paths=[str(path)], format="jsonl", eval_fraction=0.2)
    cfg = InputConfig(source=source, batch_size=2, seq_len=16, seed=1)
    train = cfg.make_iterator(Split.TRAIN)
    assert train.shuffle and train.num_epochs is None
    eval_it = cfg.make_iterator(Split.EVAL)
    assert not eval_it.shuffle and eval_it.num_epochs == 1
    eval_tokens = source.instantiate().tokens(Split.EVAL)
    seen = np.concatenate([b["input_ids"][b["target_labels"][:, 0] != PAD_LABEL] for b in eval_it])
    assert len(seen) == (len(eval_tokens) - 1) // 16  # Each eval window exactly once, in order.
    np.testing.assert_array_equal(seen.reshape(-1), eval_tokens[: len(seen) * 16])
    # Train windows never contain eval text.
    rows = [bytes(row.astype(np.uint8)) for _ in range(50) for row in next(train)["input_ids"]]
    assert not any(b"document 16" in r or b"document 19" in r for r in rows)
    assert any(b"document 3" in r for r in rows)


def test_input_config_names_the_split_when_too_short(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("x" * 100, encoding="utf-8")
    source = TextFiles.default_config().set(paths=[str(path)], eval_fraction=0.05)
    with pytest.raises(DataError, match="eval split of TextFiles: .*5 tokens, fewer than seq_len"):
        InputConfig(source=source, seq_len=16).make_iterator(Split.EVAL)
