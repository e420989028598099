"""axcore.engine.sampling against NumPy re-implementations of each rule: the penalties (Hugging Face's
repetition, OpenAI's presence/frequency), temperature, top-k, top-p, min-p, alone and combined, with
different parameters per row in one call; 20k draws against the NumPy distribution; greedy ties;
log-probabilities against NumPy's log-softmax; seeded draws independent of the row and the batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.engine.requests import SamplingParams
from axcore.engine.sampling import (
    FILTER_CANDIDATES,
    SamplingBatch,
    SamplingRow,
    apply_penalties,
    filter_logits,
    prompt_logprobs,
    sample,
    top_logprobs,
    top_logprobs_bucket,
)

VOCAB = 32
# One compiled program per shape (eager dispatch of the per-row key chain is slow).
SAMPLE = jax.jit(sample)


def np_penalise(logits, params, history, prompt_len):
    """Hugging Face's repetition penalty over every id seen, then OpenAI's penalties over output ids."""
    out = np.asarray(logits, np.float64).copy()
    ids = [int(t) for t in history if t >= 0]
    for token in set(ids):
        r = params.repetition_penalty
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    counts = np.bincount([t for t in ids[prompt_len:]], minlength=len(out))
    return out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def np_softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def np_distribution(logits, params):
    """The probabilities a row draws from, rule by rule (greedy: all mass on the lowest argmax)."""
    logits = np.asarray(logits, np.float64)
    if params.temperature == 0:
        return np.eye(len(logits))[int(np.argmax(logits))]
    scaled = logits / params.temperature
    keep = np.ones(len(scaled), bool)
    if params.top_k:
        keep &= scaled >= np.sort(scaled)[::-1][min(params.top_k, len(scaled)) - 1]
    probs = np.where(keep, np_softmax(np.where(keep, scaled, -np.inf)), 0.0)
    mass, nucleus = 0.0, []
    for token in sorted(np.flatnonzero(keep), key=lambda t: -scaled[t]):
        if mass >= params.top_p:
            break
        nucleus.append(token)
        mass += probs[token]
    keep &= scaled >= min(scaled[nucleus])
    probs = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
    probs /= probs.sum()
    keep &= probs >= params.min_p * probs.max()
    final = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
    return final / final.sum()


def _batch(params_list, *, positions=None, request_indices=None, engine_seed=0, size=None):
    positions = positions or [0] * len(params_list)
    request_indices = request_indices or list(range(len(params_list)))
    rows = [None if p is None else SamplingRow(p, i, 0, pos) for p, i, pos in zip(params_list, request_indices, positions)]
    return SamplingBatch.build(rows, engine_seed=engine_seed, size=size)


def _history(rng, rows, width):
    """Random histories of mixed lengths, -1 padded, and their prompt lengths."""
    history = np.full((rows, width), -1, np.int32)
    prompt_lens = rng.integers(1, width // 2, rows).astype(np.int32)
    for b in range(rows):
        used = rng.integers(prompt_lens[b], width + 1)
        history[b, :used] = rng.integers(0, 8, used)  # Few distinct ids: repeats are common.
    return history, prompt_lens


def test_penalties_match_huggingface_and_openai_rules_per_row():
    rng = np.random.default_rng(0)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7),
              SamplingParams(presence_penalty=0.8), SamplingParams(frequency_penalty=-0.6),
              SamplingParams(repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=0.4), SamplingParams()]
    logits = rng.normal(0, 2, (len(params), VOCAB)).astype(np.float32)
    history, prompt_lens = _history(rng, len(params), 12)
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), _batch(params), jnp.asarray(history), jnp.asarray(prompt_lens)))
    for b, p in enumerate(params):
        np.testing.assert_allclose(got[b], np_penalise(logits[b], p, history[b], prompt_lens[b]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got[:5], logits[:5])  # Every penalised row changed.


FILTERS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=100),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.5, top_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=2.0, top_k=12, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_p=0.7, min_p=0.3),
]


def test_each_filter_alone_and_combined_keeps_numpys_tokens_in_one_call():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (len(FILTERS), VOCAB)).astype(np.float32)
    batch = _batch(FILTERS)
    scaled = logits / np.array([p.temperature for p in FILTERS], np.float32)[:, None]
    kept = np.isfinite(np.asarray(jax.jit(filter_logits)(jnp.asarray(scaled), batch)))
    for b, p in enumerate(FILTERS):
        np.testing.assert_array_equal(kept[b], np_distribution(logits[b], p) > 0, err_msg=str(p))
    sizes = kept.sum(axis=1)
    assert sizes[0] == VOCAB and sizes[1] == 5 and sizes[2] == 1 and 1 < sizes[4] < VOCAB and 1 < sizes[6] < VOCAB


def test_a_large_vocabulary_keeps_numpys_tokens_from_the_candidates_or_the_bisection():
    vocab = FILTER_CANDIDATES + 344
    rng = np.random.default_rng(5)
    peaked = [SamplingParams(temperature=0.5, top_p=0.9), SamplingParams(temperature=1.0, top_k=40, top_p=0.95),
              SamplingParams(temperature=1.0, top_k=3, min_p=0.2)]
    wide = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=FILTER_CANDIDATES + 100),
            SamplingParams(temperature=2.0, top_k=FILTER_CANDIDATES + 50, top_p=0.8, min_p=0.5)]
    logits = np.concatenate([rng.normal(0, 4, (3, vocab)), rng.normal(0, 0.3, (3, vocab))]).astype(np.float32)
    expected = [np_distribution(row, p) > 0 for row, p in zip(logits, peaked + wide)]
    assert max(e.sum() for e in expected[:3]) < FILTER_CANDIDATES < min(e.sum() for e in expected[3:5])
    filtered = jax.jit(filter_logits)
    unfiltered = [SamplingParams()] * 3  # They keep every token: with them the candidates decide.
    for params in (peaked + unfiltered, peaked + wide):  # With the wide rows: the bisection.
        scaled = logits / np.array([p.temperature for p in params], np.float32)[:, None]
        kept = np.isfinite(np.asarray(filtered(jnp.asarray(scaled), _batch(params))))
        for b, p in enumerate(params):
            np.testing.assert_array_equal(kept[b], np_distribution(logits[b], p) > 0, err_msg=str(p))


DRAWS = 20_000


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.5, min_p=0.1, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3),
])
def test_draw_frequencies_match_the_numpy_distribution(params):
    vocab = 8
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1.5, vocab).astype(np.float32)
    history, prompt_len = np.array([1, 2, 2, 5, 5, 5, -1], np.int32), 2
    expected = np_distribution(np_penalise(logits, params, history, prompt_len), params)
    # One row per draw, each at its own output position: 20k keys of one request in one call.
    batch = _batch([params] * DRAWS, positions=list(range(DRAWS)), request_indices=[0] * DRAWS)
    out = SAMPLE(jnp.tile(logits, (DRAWS, 1)), batch, jnp.tile(history, (DRAWS, 1)),
                          jnp.full((DRAWS,), prompt_len, jnp.int32))
    freq = np.bincount(np.asarray(out.tokens), minlength=vocab) / DRAWS
    tolerance = 5 * np.sqrt(expected * (1 - expected) / DRAWS)
    assert np.all(np.abs(freq - expected) <= tolerance), (freq, expected)
    assert np.all(freq[expected == 0] == 0) and (expected == 0).any()


def test_greedy_takes_the_lowest_id_on_ties_and_the_penalised_argmax():
    logits = np.array([[0.0, 3.0, 1.0, 3.0, 3.0], [2.0, 1.0, 2.5, 0.0, 0.0]], np.float32)
    params = [SamplingParams(temperature=0, top_k=2, top_p=0.1), SamplingParams(temperature=0, repetition_penalty=2.0)]
    history = np.array([[-1, -1], [2, -1]], np.int32)  # Row 1 saw token 2: 2.5 / 2 = 1.25 < 2.0.
    out = SAMPLE(jnp.asarray(logits), _batch(params), jnp.asarray(history), jnp.array([1, 1], jnp.int32))
    assert out.tokens.tolist() == [1, 0]
    expected = [int(np.argmax(np_penalise(logits[b], p, history[b], 1))) for b, p in enumerate(params)]
    assert out.tokens.tolist() == expected


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_logprobs_are_numpys_log_softmax_of_the_processed_logits():
    rng = np.random.default_rng(3)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.6, top_k=4, logprobs=1),
              SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5), None]
    logits = rng.normal(0, 2, (4, VOCAB)).astype(np.float32)
    history, prompt_lens = _history(rng, 4, 10)
    batch = _batch(params, size=4)
    assert batch.top_n == top_logprobs_bucket(3) == 5
    out = SAMPLE(jnp.asarray(logits), batch, jnp.asarray(history), jnp.asarray(prompt_lens))
    for b, p in enumerate(params):
        p = p or SamplingParams(temperature=0)  # A padding row is greedy without penalties.
        expected = np_log_softmax(np_penalise(logits[b], p, history[b], prompt_lens[b]) / (p.temperature or 1.0))
        token = int(out.tokens[b])
        np.testing.assert_allclose(float(out.logprobs[b]), expected[token], rtol=1e-5, atol=1e-5)
        order = np.argsort(-expected, kind="stable")[:5]
        assert out.top_ids[b].tolist() == order.tolist()
        np.testing.assert_allclose(np.asarray(out.top_logprobs[b]), expected[order], rtol=1e-5, atol=1e-5)
    assert out.top_ids.shape == (4, 5) and out.top_ids.dtype == jnp.int32


def _draws(params, *, row, size, steps, request_index=0, engine_seed=0, choice=0):
    """Tokens drawn for one request at `row` of a `size`-row batch whose other rows differ, over `steps` positions."""
    rng = np.random.default_rng(row + size)  # The other rows' logits and params vary with the layout.
    tokens = []
    for step in range(steps):
        logits = rng.normal(0, 1, (size, 64)).astype(np.float32)
        logits[row] = np.linspace(0, 1, 64)  # The request's logits: the same whatever its row.
        rows = [SamplingRow(SamplingParams(temperature=0.5 + b, seed=b), 9 + b, 0, step) for b in range(size)]
        rows[row] = SamplingRow(params, request_index, choice, step)
        tokens.append(int(SAMPLE(jnp.asarray(logits), SamplingBatch.build(rows, engine_seed=engine_seed)).tokens[row]))
    return tokens


def test_a_seeded_request_draws_the_same_tokens_at_any_row_of_any_batch():
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = _draws(seeded, row=0, size=2, steps=5)
    assert _draws(seeded, row=5, size=8, steps=5, request_index=3, engine_seed=99) == alone
    assert _draws(SamplingParams(temperature=1.0, seed=1235), row=0, size=2, steps=5) != alone
    # Choices of one request draw differently; without a seed, the engine's seed and the request's index decide.
    assert _draws(seeded, row=1, size=2, steps=5, choice=1) != alone
    unseeded = SamplingParams(temperature=1.0)
    first = _draws(unseeded, row=1, size=2, steps=5, request_index=4, engine_seed=7)
    assert _draws(unseeded, row=3, size=8, steps=5, request_index=4, engine_seed=7) == first
    assert _draws(unseeded, row=1, size=2, steps=5, request_index=5, engine_seed=7) != first
    assert _draws(unseeded, row=1, size=2, steps=5, request_index=4, engine_seed=8) != first


def test_prompt_logprobs_and_their_top_n_match_numpy():
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 3, (7, VOCAB)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, 7).astype(np.int32)
    expected = np.stack([np_log_softmax(row) for row in logits])
    got = np.asarray(prompt_logprobs(jnp.asarray(logits), jnp.asarray(tokens)))
    np.testing.assert_allclose(got, expected[np.arange(7), tokens], rtol=1e-5, atol=1e-5)
    ids, values = top_logprobs(jnp.asarray(logits), 2)
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-expected, axis=1, kind="stable")[:, :2])
    np.testing.assert_allclose(np.asarray(values), np.sort(expected, axis=1)[:, ::-1][:, :2], rtol=1e-5, atol=1e-5)


def test_build_pads_with_greedy_rows_and_buckets_the_top_n():
    batch = _batch([SamplingParams(temperature=0.9, top_k=3, logprobs=7)], size=3)
    assert batch.temperature.tolist() == pytest.approx([0.9, 0.0, 0.0]) and batch.top_k.tolist() == [3, 0, 0]
    assert batch.top_p.tolist() == [1.0, 1.0, 1.0] and batch.repetition_penalty.tolist() == [1.0, 1.0, 1.0]
    assert batch.num_top.tolist() == [7, 0, 0] and batch.top_n == 10
    assert _batch([SamplingParams()]).top_n == 0
    with pytest.raises(ValueError, match="cannot hold 2 rows"):
        _batch([SamplingParams(), SamplingParams()], size=1)
    with pytest.raises(ValueError, match="At most 20"):
        top_logprobs_bucket(21)
