"""Conformance check of a model's KV-cache decoding against its own training forward.

A layer plugin changes what a layer computes (its named steps); decoding (`extend`,
used by `axcore generate` and the end-of-run sample) must compute the same thing. The
check: a prefill of the first `prompt` tokens, then one token at a time, gives the
logits the full forward (`CausalLM.logits`, which never sees a cache) gives for the
whole sequence, in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.module import functional


def decoded_logits(model: Any, params: Any, ids: jax.Array, prompt: int) -> jax.Array:
    """float32 `[batch, total, vocab]`: prefill `ids[:, :prompt]`, then each later token in turn."""
    batch, total = ids.shape
    extend = jax.jit(lambda p, *args: functional(model, p, args, None, False, method="extend")[0])
    logits, cache = extend(params, ids[:, :prompt], model.init_cache(batch, total))
    out = [logits]
    for t in range(prompt, total):
        logits, cache = extend(params, ids[:, t : t + 1], cache, jnp.full((batch, 1), t))
        out.append(logits)
    return jnp.concatenate(out, axis=1)


def check_decoding_matches_forward(
    model: Any, params: Any, *, batch: int = 2, prompt: int = 5, total: int = 12, vocab: int = 256,
    atol: float = 2e-5, rtol: float = 1e-5,
) -> None:
    """Decoded logits equal the full forward's (AssertionError naming the largest difference)."""
    ids = jax.random.randint(jax.random.key(2), (batch, total), 0, vocab)
    full = jax.jit(lambda p, x: functional(model, p, (x,), None, False, method="logits")[0])(params, ids)
    decoded = decoded_logits(model, params, ids, prompt)
    worst = float(jnp.max(jnp.abs(decoded - full)))
    assert np.allclose(np.asarray(decoded), np.asarray(full), atol=atol, rtol=rtol), (
        f"KV-cache decoding differs from the full forward by up to {worst:.3g} (prompt {prompt}, {total} tokens): "
        f"the layer's extend does not compute what its forward computes; decode through the same steps "
        f"(TransformerLayer.extend runs forward with the attention on the cache)."
    )
