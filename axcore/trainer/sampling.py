"""Autoregressive sampling from a causal LM (used for the end-of-run sample)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.module import Module, functional


def sample_tokens(
    model: Module,
    params: Any,
    prompt: np.ndarray,
    num_new: int,
    *,
    window: int,
    temperature: float,
    prng_key: jax.Array,
) -> np.ndarray:
    """Continues `prompt` (1-D int tokens) by `num_new` tokens.

    Each step runs `model.logits` on a fixed `[1, window]` buffer (one compilation;
    the model is causal, so positions after the cursor do not matter) and slides the
    buffer once it is full. temperature 0 picks the argmax.

    Returns:
        The `num_new` generated tokens.
    """
    if len(prompt) == 0:
        raise ValueError("The prompt must contain at least one token.")

    @jax.jit
    def next_token(params, buffer, cursor, key):
        logits, _ = functional(model, params, (buffer,), None, False, method="logits")
        last = jax.lax.dynamic_index_in_dim(logits[0], cursor - 1, keepdims=False).astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(last)
        return jax.random.categorical(key, last / temperature)

    tokens = list(int(t) for t in prompt[-window:])
    out = []
    for i in range(num_new):
        context = tokens[-window:]
        buffer = np.zeros((1, window), np.int32)
        buffer[0, : len(context)] = context
        token = int(next_token(params, buffer, len(context), jax.random.fold_in(prng_key, i)))
        tokens.append(token)
        out.append(token)
    return np.asarray(out, np.int32)
