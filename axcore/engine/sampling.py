"""Batched sampling on the device: every row of one step with its own parameters, in one call.

`SamplingBatch.build` turns each row's `SamplingParams` (and where the row stands: its
request, choice and output position) into per-row arrays; `sample(logits, batch,
history, prompt_lens)` then processes a step's last-token logits `[B, V]` in this order,
each row independently:

1. repetition penalty (Hugging Face's rule, over the prompt's and the output's tokens): a
   logit `l` of a token seen becomes `l / r` if `l > 0`, else `l * r`;
2. presence and frequency penalties (OpenAI's rule, over OUTPUT tokens only): a token
   generated `c` times loses `frequency * c + presence * (c > 0)`;
3. temperature: the logits are divided by it; temperature 0 is greedy, the argmax of the
   penalised logits (the lowest id on ties), and skips the draw and the filters;
4. top-k: the k largest logits (ties at the k-th value kept; 0 = all);
5. top-p: the most likely tokens, in order, until their probability (renormalised after
   top-k) reaches `top_p`; the token crossing it is kept (ties at its value too);
6. min-p: tokens whose probability (renormalised after top-p) is below `min_p` times the
   most likely one's are dropped;

and draws one token from the rest with the row's own key (one uniform per row, inverting
the cumulative distribution of the kept tokens). The max-logit token survives every
filter, so a row always has a token to draw.

Log-probabilities (choice of this module): those of the PROCESSED distribution after
steps 1-3, before the filters: `log_softmax(penalised logits / temperature)`, with
temperature 1 for greedy rows (a temperature of 0 has no distribution). Without penalties
at temperature 1 (or greedy) they equal the model's own log-softmax, which is what the
learner computes on the same parameters; vLLM's default (the raw model's log-softmax
whatever the processing) differs from this only where penalties or a temperature other
than 1 apply. Prompt log-probabilities (`prompt_logprobs`, `prompt_scores` with their top-N) are
always the raw model's.

Keys: a row's key is a hash (on the host) of its request's seed (or, without one, of
the engine's seed and the request's index) and its choice index among the request's `n`,
folded on the device with its output position (the number of tokens the choice has so
far). It depends on nothing else, so a seeded request draws the same tokens in any
batch, at any row, and the choices of one request draw differently.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from axcore.engine.requests import SamplingParams

# Static widths of the top log-probability arrays: the requested N rounded up to one of
# these, so a step compiles one program per bucket (requests ask for at most 20).
TOP_LOGPROBS_BUCKETS = (0, 1, 2, 5, 10, 20)
# Largest logits per row from which top-k and top-p are decided (`lax.top_k`, far cheaper than
# sorting a vocabulary); a row whose k or nucleus reaches past them falls back to a bisection.
FILTER_CANDIDATES = 256
# uint32 words of a row's key data (threefry's key: SamplingBatch.key_words).
_KEY_WORDS = 2


def top_logprobs_bucket(n: int) -> int:
    """The static K for `n` top log-probabilities: the smallest bucket >= n.

    >>> top_logprobs_bucket(0), top_logprobs_bucket(3), top_logprobs_bucket(20)
    (0, 5, 20)
    """
    for bucket in TOP_LOGPROBS_BUCKETS:
        if n <= bucket:
            return bucket
    raise ValueError(f"At most {TOP_LOGPROBS_BUCKETS[-1]} top log-probabilities, got {n}.")


class SamplingRow(NamedTuple):
    """Where one row of a step stands (host side): what `SamplingBatch.build` needs of it."""

    # The request's sampling parameters.
    params: SamplingParams
    # The request's index in the engine (arrival order); seeds its draws when `params.seed` is None.
    request_index: int
    # Which of the request's `n` choices this row continues.
    choice: int
    # Tokens this choice has generated so far (the position of the token drawn now).
    position: int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, as device arrays (B rows; padding rows are greedy).

    A pytree: pass it through `jax.jit`; `top_n` is static (part of the compiled program).
    """

    # [B] float32 softmax temperature; 0 = greedy.
    temperature: jax.Array
    # [B] int32 top-k; 0 = all tokens.
    top_k: jax.Array
    # [B] float32 nucleus mass in (0, 1]; 1 = all.
    top_p: jax.Array
    # [B] float32 min-p in [0, 1]; 0 = none.
    min_p: jax.Array
    # [B] float32 OpenAI presence penalty (output tokens).
    presence_penalty: jax.Array
    # [B] float32 OpenAI frequency penalty (output tokens).
    frequency_penalty: jax.Array
    # [B] float32 Hugging Face repetition penalty (prompt and output tokens); 1 = off.
    repetition_penalty: jax.Array
    # [B, 2] uint32 key data: a hash of (seed, choice), or of (engine seed, request index, choice) without a seed.
    key_words: jax.Array
    # [B] int32 output position of the token drawn now (folded into the key).
    position: jax.Array
    # [B] int32 top log-probabilities each row asked for (<= top_n; rows may ask fewer than top_n).
    num_top: jax.Array
    # Static K: width of the top log-probability outputs, a bucket of the largest request.
    top_n: int = dataclasses.field(default=0, metadata={"static": True})

    @classmethod
    def build(cls, rows: Sequence[SamplingRow | None], *, engine_seed: int, size: int | None = None) -> SamplingBatch:
        """Arrays for `rows` (None = a padding row), padded with greedy rows to `size` (default len(rows)).

        `engine_seed` seeds the draws of requests without a seed of their own (with the
        request's index). `top_n` is the bucket of the largest `params.logprobs` asked.

        Raises:
            ValueError: `size` is smaller than the number of rows.
        """
        size = len(rows) if size is None else size
        if size < len(rows):
            raise ValueError(f"A batch of {size} rows cannot hold {len(rows)} rows.")
        columns = {name: np.zeros(size, np.float32) for name in
                   ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")}
        columns["top_p"][:], columns["repetition_penalty"][:] = 1.0, 1.0
        top_k, position, num_top = (np.zeros(size, np.int32) for _ in range(3))
        key_words = np.zeros((size, _KEY_WORDS), np.uint32)
        for b, row in enumerate(rows):
            if row is None:
                continue
            params = row.params
            for name, column in columns.items():
                column[b] = getattr(params, name)
            top_k[b], position[b], num_top[b] = params.top_k, row.position, params.logprobs or 0
            key_words[b] = _key_words(params.seed, engine_seed, row.request_index, row.choice)
        arrays = {name: jnp.asarray(column) for name, column in columns.items()}
        return cls(**arrays, top_k=jnp.asarray(top_k), key_words=jnp.asarray(key_words), position=jnp.asarray(position),
                   num_top=jnp.asarray(num_top), top_n=top_logprobs_bucket(int(num_top.max(initial=0))))


def _key_words(seed: int | None, engine_seed: int, request_index: int, choice: int) -> np.ndarray:
    """[2] uint32 key data: a hash of ("seed", seed, choice) for a seeded request, else of
    ("engine", engine seed, request index, choice)."""
    identity = ("seed", seed, choice) if seed is not None else ("engine", engine_seed, request_index, choice)
    digest = hashlib.blake2b(repr(identity).encode(), digest_size=8).digest()
    return np.frombuffer(digest, np.uint32).copy()


def row_keys(key_words: jax.Array, position: jax.Array) -> jax.Array:
    """Keys `[B]` (threefry) from key data `[B, 2]` uint32 folded with the output positions `[B]`:
    a row's key depends on its own words and position only."""
    keys = jax.random.wrap_key_data(key_words, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, position)


class SampleOutput(NamedTuple):
    """What `sample` returns for a step's B rows."""

    # [B] int32 the chosen tokens.
    tokens: jax.Array
    # [B] float32 their log-probabilities under the processed distribution (module docstring).
    logprobs: jax.Array
    # [B, K] int32 the K most likely token ids of that distribution, most likely first (K = min(batch.top_n, V)).
    top_ids: jax.Array
    # [B, K] float32 their log-probabilities.
    top_logprobs: jax.Array


def apply_penalties(logits: jax.Array, batch: SamplingBatch, history: jax.Array, prompt_lens: jax.Array) -> jax.Array:
    """Repetition, then presence and frequency penalties (module docstring, steps 1-2).

    Args:
        logits: [B, V] float32.
        batch: the rows' parameters.
        history: [B, L] int32 token ids of each row's sequence, the prompt then the output,
            padded with -1 (ids < 0 are ignored).
        prompt_lens: [B] int32 how many leading ids of each history row are the prompt's.

    Returns:
        [B, V] float32 penalised logits.
    """
    rows, vocab = logits.shape
    valid = history >= 0
    output = valid & (jnp.arange(history.shape[1])[None, :] >= prompt_lens[:, None])
    ids = jnp.where(valid, history, vocab)  # Out of range: dropped by the scatters.
    row_ids = jnp.arange(rows)[:, None]
    seen = jnp.zeros((rows, vocab), bool).at[row_ids, ids].set(True, mode="drop")
    counts = jnp.zeros((rows, vocab), jnp.float32).at[row_ids, ids].add(output.astype(jnp.float32), mode="drop")
    penalty = batch.repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / penalty, logits * penalty)
    logits = jnp.where(seen, repeated, logits)
    return (logits - batch.frequency_penalty[:, None] * counts
            - batch.presence_penalty[:, None] * (counts > 0).astype(jnp.float32))


def _any_penalty(batch: SamplingBatch) -> jax.Array:
    """Whether some row has a penalty (scalar bool)."""
    return jnp.any((batch.repetition_penalty != 1) | (batch.presence_penalty != 0) | (batch.frequency_penalty != 0))


def _any_filter(batch: SamplingBatch, vocab: int) -> jax.Array:
    """Whether some drawing row has a top-k, top-p or min-p that can drop a token (scalar bool)."""
    filters = ((batch.top_k > 0) & (batch.top_k < vocab)) | (batch.top_p < 1) | (batch.min_p > 0)
    return jnp.any(filters & (batch.temperature > 0))


def _prefix_threshold(scaled: jax.Array, prefix: jax.Array, batch: SamplingBatch):
    """The top-k and top-p threshold of each row from the C largest scaled logits `prefix [B, C]`
    (descending); returns (threshold [B, 1], whether the prefix decided it exactly [B], the
    top-k threshold alone [B, 1], exact where k <= C)."""
    vocab, width = scaled.shape[-1], prefix.shape[-1]
    k = jnp.where(batch.top_k > 0, jnp.minimum(batch.top_k, vocab), vocab)
    kth = jnp.take_along_axis(prefix, (jnp.minimum(k, width) - 1)[:, None], axis=-1)  # [B, 1]
    top_k = jnp.where((k < vocab)[:, None], kth, -jnp.inf)  # Ties at the k-th value are kept.
    # The nucleus, in probabilities renormalised over the top-k tokens (all of them, beyond the prefix too).
    log_total = jax.nn.logsumexp(jnp.where(scaled >= top_k, scaled, -jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(prefix >= top_k, jnp.exp(prefix - log_total), 0.0)
    before = jnp.cumsum(probs, axis=-1) - probs  # Probability of the tokens ranked above each one.
    nucleus = (prefix >= top_k) & (before < batch.top_p[:, None])  # The first token always (before = 0).
    top_p = jnp.where(batch.top_p[:, None] < 1, jnp.min(jnp.where(nucleus, prefix, jnp.inf), -1, keepdims=True), -jnp.inf)
    # Exact unless the k-th value or the nucleus's end may lie past the prefix.
    exact = (width == vocab) | (((k <= width) | (k == vocab)) & ((batch.top_p >= 1) | ~nucleus[:, -1]))
    return jnp.maximum(top_k, top_p), exact, top_k


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (a float's bits, negatives flipped)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_keys(keys: jax.Array) -> jax.Array:
    """The inverse of `_order_keys`."""
    bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _smallest_key(keys: jax.Array, below) -> jax.Array:
    """The smallest uint32 t per row with `below(keys > t)` true ([B, V] bool -> [B] bool, monotone:
    true for the row's largest key), by bisection over the 32 bits: [B, 1] uint32."""

    def halve(_, bounds):
        low, high = bounds
        middle = low + (high - low) // 2
        ok = below(keys > middle)[:, None]
        return jnp.where(ok, low, middle + 1), jnp.where(ok, middle, high)

    low = jnp.zeros_like(keys[:, :1])
    return jax.lax.fori_loop(0, 32, halve, (low, jnp.max(keys, axis=-1, keepdims=True)))[1]


def _bisected_threshold(scaled: jax.Array, batch: SamplingBatch, prefix_top_k: jax.Array) -> jax.Array:
    """The top-k and top-p threshold of each row, exactly, without sorting: [B, 1].

    The k-th largest logit is the smallest t with fewer than k logits above it (bisected
    only where some k reaches past the prefix; else `prefix_top_k [B, 1]`, the prefix's);
    the nucleus's last logit, the smallest t with less than `top_p` of the mass above it."""
    vocab, width = scaled.shape[-1], min(scaled.shape[-1], FILTER_CANDIDATES)
    keys = _order_keys(scaled)
    k = jnp.where(batch.top_k > 0, jnp.minimum(batch.top_k, vocab), vocab)

    def bisect_top_k():
        kth = _from_order_keys(_smallest_key(keys, lambda above: jnp.sum(above, axis=-1) < k))
        return jnp.where((k < vocab)[:, None], kth, -jnp.inf)

    top_k = jax.lax.cond(jnp.any((k > width) & (k < vocab)), bisect_top_k, lambda: prefix_top_k)
    log_total = jax.nn.logsumexp(jnp.where(scaled >= top_k, scaled, -jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(scaled >= top_k, jnp.exp(scaled - log_total), 0.0)
    last = _from_order_keys(_smallest_key(keys, lambda above: jnp.sum(jnp.where(above, probs, 0.0), -1) < batch.top_p))
    return jnp.maximum(top_k, jnp.where(batch.top_p[:, None] < 1, last, -jnp.inf))


def filter_threshold(scaled: jax.Array, batch: SamplingBatch) -> jax.Array:
    """The smallest kept logit of each row after top-k, top-p and min-p (module docstring, steps 4-6).

    The top-k and top-p thresholds come from the `FILTER_CANDIDATES` largest logits
    (`lax.top_k`), or, when a row's k or nucleus reaches past them, from a bisection
    over the whole vocabulary (32 masked sums per threshold; no sort).

    Args:
        scaled: [B, V] float32 logits after penalties and temperature.
        batch: the rows' parameters.

    Returns:
        [B, 1] float32: a row keeps exactly its tokens whose `scaled` logit is >= it.
    """
    vocab = scaled.shape[-1]
    prefix = jax.lax.top_k(scaled, min(vocab, FILTER_CANDIDATES))[0]
    threshold, exact, top_k = _prefix_threshold(scaled, prefix, batch)
    if vocab > FILTER_CANDIDATES:
        threshold = jax.lax.cond(jnp.all(exact | (batch.temperature <= 0)), lambda: threshold, lambda: _bisected_threshold(scaled, batch, top_k))
    # min-p: p_i / p_max = exp(l_i - l_max) >= min_p (the renormalisation cancels); log(0) = -inf keeps all.
    min_p = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(batch.min_p[:, None])
    return jnp.maximum(threshold, min_p)


def filter_logits(scaled: jax.Array, batch: SamplingBatch) -> jax.Array:
    """`scaled [B, V]` where `filter_threshold` keeps a token, -inf elsewhere."""
    return jnp.where(scaled >= filter_threshold(scaled, batch), scaled, -jnp.inf)


def _draw(scaled: jax.Array, threshold: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row from softmax(scaled) restricted to `scaled >= threshold`, by inverting
    its cumulative distribution at one uniform in (0, 1] per row: [B] int32."""
    weights = jnp.where(scaled >= threshold, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
    cumulative = jnp.cumsum(weights, axis=-1)
    uniform = 1.0 - jax.vmap(jax.random.uniform)(keys)  # (0, 1]: the token found has a weight > 0.
    target = uniform[:, None] * cumulative[:, -1:]
    return jnp.minimum(jnp.sum(cumulative < target, axis=-1), scaled.shape[-1] - 1).astype(jnp.int32)


def sample(logits: jax.Array, batch: SamplingBatch, history: jax.Array | None = None,
           prompt_lens: jax.Array | None = None) -> SampleOutput:
    """Chooses one token per row with that row's parameters (module docstring); jittable, on the device.

    Work no row needs is skipped at run time (`lax.cond`): the penalties, the filters, the draw.

    Args:
        logits: [B, V] float32 logits of each row's last valid token.
        batch: the rows' parameters (`SamplingBatch.build`).
        history: [B, L] int32 each row's prompt and output ids, -1 padded; None = no row
            has a penalty (the penalties are skipped; the caller guarantees it).
        prompt_lens: [B] int32 prompt ids at the start of each history row (with `history`).

    Returns:
        `SampleOutput`: tokens [B], their log-probabilities [B], the top `batch.top_n`
        ids and log-probabilities [B, K]. Rows are independent of each other.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    if history is not None:
        logits = jax.lax.cond(_any_penalty(batch), lambda: apply_penalties(logits, batch, history, prompt_lens),
                              lambda: logits)
    greedy = batch.temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, batch.temperature)[:, None]
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    threshold = jax.lax.cond(_any_filter(batch, vocab), lambda: filter_threshold(scaled, batch),
                             lambda: jnp.full((scaled.shape[0], 1), -jnp.inf))
    keys = row_keys(batch.key_words, batch.position)
    drawn = jax.lax.cond(jnp.all(greedy), lambda: jnp.zeros(scaled.shape[0], jnp.int32),
                         lambda: _draw(scaled, threshold, keys))
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_ids, top_values = top_logprobs(logprobs, batch.top_n, normalized=True)
    return SampleOutput(tokens, chosen, top_ids, top_values)


def top_logprobs(logits: jax.Array, k: int, *, normalized: bool = False) -> tuple[jax.Array, jax.Array]:
    """The `k` most likely tokens of each row of `logits [..., V]` (ties: lower id first).

    Returns (ids `[..., k']` int32, log-probabilities `[..., k']` float32), k' = min(k, V). `normalized=True`
    says `logits` are log-probabilities already (no log-softmax taken).
    """
    logprobs = logits.astype(jnp.float32)
    if not normalized:
        logprobs = jax.nn.log_softmax(logprobs, axis=-1)
    values, ids = jax.lax.top_k(logprobs, min(k, logprobs.shape[-1]))
    return ids.astype(jnp.int32), values


def prompt_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Log-probability of each token under the raw model: `log_softmax(logits)[t, tokens[t]]`.

    Args:
        logits: [T, V] logits whose row t predicts `tokens[t]` (the caller shifts: the
            logits at prompt position p predict the token at p + 1).
        tokens: [T] int32.

    Returns:
        [T] float32.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logprobs, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def prompt_scores(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`prompt_logprobs` and the `k` most likely tokens at each position, from ONE log-softmax.

    Args:
        logits: [..., T, V] logits whose row t predicts `tokens[..., t]` (shifted by the caller).
        tokens: [..., T] int32.
        k: top tokens per position (static; 0 = none).

    Returns:
        (log-probabilities [..., T] float32, top ids [..., T, k'] int32, their log-probabilities
        [..., T, k'] float32), k' = min(k, V); ties: lower id first. A position whose token is the
        most likely has its log-probability bit-equal to its top-1 value (clients test greediness so).
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top_ids, top_values = top_logprobs(logprobs, k, normalized=True)
    return chosen, top_ids, top_values
