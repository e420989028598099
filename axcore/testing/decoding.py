"""Conformance check of a model's KV-cache decoding against its own training forward.

A layer plugin changes what a layer computes (its named steps); decoding (`extend`,
used by `axcore generate` and the end-of-run sample) must compute the same thing. The
check: a prefill of the first `prompt` tokens, then one token at a time, gives the
logits the full forward (`CausalLM.logits`, which never sees a cache) gives for the
whole sequence, in float32.

The paged check (`check_paged_matches_forward`, the inference engine's form) feeds
several sequences in chunks through `CausalLM.extend_paged`, as the engine's scheduler
would: prefills split in chunks, sequences joining later, rows of different sequences
in one batch in a shuffled order, an empty padding row, block ids shuffled over a paged
cache; every fed token's logits must equal the full forward's at its position.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from axcore.experiment.loading import load_experiment
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


# Chunk sizes fed per sequence in `paged_logits`, step by step (0 = not yet joined): three-chunk
# prefills of mixed sizes, then one token per step; the third sequence joins at step 2.
PAGED_PLAN = ((3, 2, 2, 1, 1, 1, 1, 1), (2, 4, 1, 1, 1, 1, 1, 1), (0, 0, 4, 3, 1, 1, 1, 1, 1))


def paged_logits(
    model: Any, params: Any, ids: np.ndarray, *, plan: tuple = PAGED_PLAN, block_size: int = 4, seed: int = 0
) -> np.ndarray:
    """float32 `[len(plan), total, vocab]`: sequence s of `ids` `[len(plan), total]` fed to `extend_paged`
    by the chunk sizes of `plan[s]` (each summing to `total`), all live sequences in one call per step.

    Each step is `[len(plan) + 1, longest chunk]`: the live sequences' rows in a random order,
    then empty rows (num_new 0); padding tokens have id 0 and position 0. The sequences' blocks are a random permutation
    of blocks 1..; the tables are one column wider than needed (padded with block 0).
    """
    rng = np.random.default_rng(seed)
    seqs, total = ids.shape
    per_seq = -(-total // block_size)
    blocks = rng.permutation(np.arange(1, 1 + seqs * per_seq)).reshape(seqs, per_seq)
    tables = np.concatenate([blocks, np.zeros((seqs, 1), blocks.dtype)], axis=1).astype(np.int32)
    cache = model.init_paged_cache(1 + seqs * per_seq + 2, block_size)
    names = ("input_ids", "positions", "num_new", "block_tables")

    @jax.jit
    def step_fn(p, c, *arrays):
        inputs = {**dict(zip(names, arrays)), "cache": c, "all_logits": True}
        return functional(model, p, inputs, None, False, method="extend_paged")[0]

    out = np.full((seqs, total, 0), np.nan, np.float32)
    width = max(max(p) for p in plan)  # One shape for every step (one compiled program).
    done = [0] * seqs
    for step in range(max(len(p) for p in plan)):
        rows = [s for s in rng.permutation(seqs) if step < len(plan[s]) and plan[s][step] > 0]
        tokens = np.zeros((seqs + 1, width), np.int32)
        positions = np.zeros_like(tokens)
        num_new = np.zeros(seqs + 1, np.int32)
        table = np.zeros((seqs + 1, tables.shape[1]), np.int32)
        for r, s in enumerate(rows):
            n = plan[s][step]
            tokens[r, :n], positions[r, :n] = ids[s, done[s] : done[s] + n], np.arange(done[s], done[s] + n)
            num_new[r], table[r] = n, tables[s]
        logits, cache = step_fn(params, cache, tokens, positions, num_new, table)
        logits = np.asarray(logits)
        if out.shape[2] == 0:
            out = np.full((seqs, total, logits.shape[-1]), np.nan, np.float32)
        for r, s in enumerate(rows):
            out[s, done[s] : done[s] + num_new[r]] = logits[r, : num_new[r]]
            done[s] += int(num_new[r])
    assert done == [total] * seqs, f"the plan feeds {done} tokens, not {total} per sequence"
    return out


def check_paged_matches_forward(
    model: Any, params: Any, *, total: int = 12, vocab: int = 256, block_size: int = 4, atol: float = 2e-5,
    rtol: float = 1e-5,
) -> None:
    """Chunked paged decoding (`paged_logits`) equals the full forward (AssertionError naming the difference)."""
    ids = np.asarray(jax.random.randint(jax.random.key(3), (len(PAGED_PLAN), total), 0, vocab))
    full = jax.jit(lambda p, x: functional(model, p, (x,), None, False, method="logits")[0])(params, ids)
    paged = paged_logits(model, params, ids, block_size=block_size)
    worst = float(np.max(np.abs(paged - np.asarray(full))))
    assert np.allclose(paged, np.asarray(full), atol=atol, rtol=rtol), (
        f"paged KV-cache decoding (CausalLM.extend_paged, chunked prefills, shuffled blocks) differs from the full "
        f"forward by up to {worst:.3g}: the layer's extend_paged does not compute what its forward computes."
    )


def check_experiment_paged(
    data: Mapping[str, Any], directory: str | pathlib.Path, *, overrides: Sequence[str] = (), noise: float = 0.1
) -> Any:
    """`check_paged_matches_forward` on the model of an experiment given as data (e.g. a model converter's
    `experiment(config)`), in float32, with random parameters: the initializer's plus N(0, noise) on every
    leaf (so norm scales, biases and gates are not at their trivial init).

    Writes `directory/experiment.yaml`; returns the model (for further checks of its config).
    """
    path = pathlib.Path(directory) / "experiment.yaml"
    path.write_text(yaml.safe_dump(dict(data), sort_keys=False), "utf-8")
    exp = load_experiment(str(path), ["model.compute_dtype=float32", *overrides])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(1))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(4), len(leaves))
    params = tree.unflatten([a + noise * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)])
    check_paged_matches_forward(model, params, vocab=int(exp.config.model.vocab_size))
    return model
