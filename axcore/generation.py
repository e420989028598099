"""Text generation from a causal LM with a KV cache: prefill once, then one token per step.

`Generator(model, ...)` compiles one program per (batch, prompt bucket) shape: the
prompts, right-padded to a multiple of `bucket` tokens, are prefilled in one call of
`CausalLM.extend` (which fills the KV cache), then a `lax.while_loop` feeds each
sequence's newest token at its own position until every sequence has produced
`max_new_tokens` tokens or a stop token. Prompts of different lengths share a batch:
each row continues from its own length (see `MultiheadAttention.extend`).

The KV cache is created inside the compiled program and carries the sharding
constraints of the training keys and values (logical axes `batch, seq, kv_heads`), so
under a mesh (the caller's `op_environment`) it is laid out like training activations.

Sampling (`Sampling`): temperature 0 is greedy (argmax). Otherwise the logits are
divided by the temperature, restricted to the `top_k` largest (ties at the k-th value
kept), then to the nucleus: the most likely tokens, in order, until their probability
reaches `top_p` (the token that crosses it included), and a token is drawn from the
renormalised rest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.module import Module, functional


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits (module docstring)."""

    # Softmax temperature; 0 = greedy (the most likely token).
    temperature: float = 0.0
    # Keep only the k most likely tokens; None = all.
    top_k: int | None = None
    # Keep the smallest most-likely set whose probability reaches top_p; 1.0 = all.
    top_p: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}.")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None for all tokens), got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")


def sample_logits(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens: logits `[batch, vocab]` -> int32 `[batch]` (rules in the module docstring)."""
    logits = logits.astype(jnp.float32)
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    masked = jnp.finfo(jnp.float32).min
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, masked, logits)
    if sampling.top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # Probability of the tokens ranked above each one.
        kept = before < sampling.top_p  # The first token always (before = 0).
        threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, masked, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Generator:
    """Continues batches of prompts with a causal LM (`CausalLM.init_cache` / `extend`).

    Args:
        model: the causal LM module (`init_cache`, `extend`).
        max_new_tokens: tokens generated per prompt (fewer where a stop token came).
        sampling: how each token is chosen.
        stop_tokens: ids that end a sequence; the stop token is part of its output.
        bucket: prompts are padded to a multiple of this many tokens, and the cache to
            a multiple of it, so nearby lengths share one compiled program.
        pad_id: token id of the prompt padding (never attended to).
    """

    def __init__(
        self,
        model: Module,
        *,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        stop_tokens: Sequence[int] = (),
        bucket: int = 16,
        pad_id: int = 0,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.stop_tokens = tuple(int(t) for t in stop_tokens)
        self.bucket = bucket
        self.pad_id = pad_id
        self._compiled = jax.jit(self._generate, static_argnames=("cache_len",))

    def positions_needed(self, longest_prompt: int) -> int:
        """Positions a batch whose longest prompt has `longest_prompt` tokens uses (the loop
        feeds its last token too, so prompt plus every new token)."""
        return longest_prompt + self.max_new_tokens

    def cache_len(self, longest_prompt: int) -> int:
        """Cache slots for prompts of up to `longest_prompt` tokens: `positions_needed`, rounded
        up to the bucket (not past the model's position limit, which the need itself must respect)."""
        need = self.positions_needed(longest_prompt)
        rounded = -(-need // self.bucket) * self.bucket
        limit = self.model.max_cache_len()
        return rounded if limit is None else max(need, min(rounded, limit))

    def __call__(self, params: Any, prompts: Sequence[np.ndarray], prng_key: jax.Array | None = None) -> list[np.ndarray]:
        """Generates a continuation of each prompt.

        Args:
            params: the model's parameter tree.
            prompts: 1-D int token arrays, each at least one token long.
            prng_key: key of the sampling draws (unused by greedy decoding); default key 0.

        Returns:
            One int32 array per prompt: its new tokens, `max_new_tokens` long unless a
            stop token ended it earlier (the stop token included).
        """
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        if not prompts or min(len(p) for p in prompts) == 0:
            raise ValueError("Every prompt must contain at least one token.")
        lengths = np.array([len(p) for p in prompts], np.int32)
        cache_len = self.cache_len(int(lengths.max()))
        width = min(-(-int(lengths.max()) // self.bucket) * self.bucket, cache_len)
        padded = np.full((len(prompts), width), self.pad_id, np.int32)
        for row, prompt in zip(padded, prompts):
            row[: len(prompt)] = prompt
        key = jax.random.key(0) if prng_key is None else prng_key
        tokens, counts = self._compiled(params, padded, lengths, key, cache_len=cache_len)
        tokens, counts = np.asarray(tokens), np.asarray(counts)
        return [tokens[b, : counts[b]] for b in range(len(prompts))]

    def _extend(self, params, *args):
        return functional(self.model, params, args, None, False, method="extend")[0]

    def _generate(self, params, padded, lengths, key, *, cache_len: int):
        """padded `[b, w]`, lengths `[b]` -> (tokens `[b, max_new_tokens]`, counts `[b]`)."""
        batch = padded.shape[0]
        cache = self.model.init_cache(batch, cache_len)
        logits, cache = self._extend(params, padded, cache)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        first = sample_logits(last, jax.random.fold_in(key, 0), self.sampling)
        stops = jnp.asarray(self.stop_tokens, jnp.int32)
        out = jnp.full((batch, self.max_new_tokens), self.pad_id, jnp.int32)
        done = jnp.zeros((batch,), bool)
        counts = jnp.zeros((batch,), jnp.int32)

        def cond(state):
            i, _, _, _, done, _, _ = state
            return (i < self.max_new_tokens) & ~jnp.all(done)

        def body(state):
            i, token, positions, cache, done, out, counts = state
            out = out.at[:, i].set(jnp.where(done, self.pad_id, token))
            counts = counts + (~done).astype(jnp.int32)
            done = done | jnp.isin(token, stops)
            # The next token (after the last one this forward is wasted: cheaper than a lax.cond,
            # whose branches would copy the cache).
            logits, cache = self._extend(params, token[:, None], cache, positions[:, None])
            token = sample_logits(logits[:, 0], jax.random.fold_in(key, i + 1), self.sampling)
            return i + 1, token, positions + 1, cache, done, out, counts

        state = (jnp.int32(0), first, lengths, cache, done, out, counts)
        _, _, _, _, _, out, counts = jax.lax.while_loop(cond, body, state)
        return out, counts
