"""Conformance checks of a position embedding (`axcore.layers.PositionEmbedding`).

A position embedding acts in up to four places (`embed_inputs`, `transform_qk`,
`bias_slopes`, `attention_bias`); the checks call each with small inputs:

- shapes and dtypes: outputs have their inputs' shapes and dtypes (float32 and
  bfloat16); slopes are `[num_heads]`, a bias broadcasts to `[batch, heads, q, kv]`;
- positions matter: some place changes when the positions change (unless the
  embedding says it is the identity);
- relative-position invariance (only if claimed): attention logits, computed here in
  NumPy float64 from the transformed q, k and the bias as `scale q.k + bias`, are the
  same when every position is shifted, and `embed_inputs` does not depend on positions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.module import functional

BATCH, SEQ, HEADS, KV_HEADS, DIM = 2, 6, 4, 2, 8
# Positions: per-example offsets, so batch rows differ.
POSITIONS = np.stack([np.arange(SEQ), np.arange(SEQ) + 3])
SHIFT = 5


def build(config: Any, registries: Any, *, dim: int = DIM, num_heads: int = HEADS):
    """`(layer, params)`: the embedding built from `config` with `dim`/`num_heads` set where unset (as a slot does)."""
    cfg = config.clone()
    if getattr(cfg, "dim", None) is None:
        cfg.dim = dim
    if getattr(cfg, "num_heads", None) is None:
        cfg.num_heads = num_heads
    layer = cfg.instantiate(name="position_embedding", registries=registries)
    return layer, layer.initialize(jax.random.key(0))


def _call(layer, params, method: str, *inputs):
    out, _ = functional(layer, params, inputs=inputs, prng_key=None, is_training=False, method=method)
    return out


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, SEQ, DIM)).astype(dtype)
    q = rng.normal(size=(BATCH, SEQ, HEADS, DIM)).astype(dtype)
    k = rng.normal(size=(BATCH, SEQ, KV_HEADS, DIM)).astype(dtype)
    return x, q, k


def _bias(layer, params, q_pos, k_pos) -> np.ndarray | None:
    """The additive logit bias `[b|1, h|1, t, s]` in float64: from slopes (`-slope |i - j|`) or attention_bias."""
    slopes = _call(layer, params, "bias_slopes")
    if slopes is not None:
        d = np.abs(np.asarray(q_pos)[:, :, None] - np.asarray(k_pos)[:, None, :]).astype(np.float64)
        return -np.asarray(slopes, np.float64)[None, :, None, None] * d[:, None]
    bias = _call(layer, params, "attention_bias", jnp.asarray(q_pos), jnp.asarray(k_pos))
    return None if bias is None else np.asarray(bias, np.float64)


def logits(layer, params, q, k, q_pos, k_pos) -> np.ndarray:
    """`scale q'.k' + bias` `[b, heads, t, s]` in float64, q', k' from `transform_qk` (GQA: head n reads n // group)."""
    q2, k2 = _call(layer, params, "transform_qk", jnp.asarray(q), jnp.asarray(k), jnp.asarray(q_pos), jnp.asarray(k_pos))
    q2, k2 = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q2, k2))
    k2 = np.repeat(k2, q2.shape[2] // k2.shape[2], axis=2)
    out = np.einsum("btnh,bsnh->bnts", q2, k2) / np.sqrt(q2.shape[-1])
    bias = _bias(layer, params, q_pos, k_pos)
    return out if bias is None else out + bias


def check_shapes_and_dtypes(layer, params, dtype) -> None:
    """Every place returns its inputs' shapes and dtypes; slopes and bias have theirs."""
    x, q, k = _inputs(dtype)
    name = type(layer).__name__
    out = _call(layer, params, "embed_inputs", jnp.asarray(x), jnp.asarray(POSITIONS))
    assert out.shape == x.shape and out.dtype == x.dtype, f"{name}.embed_inputs: {out.shape} {out.dtype}, expected {x.shape} {x.dtype}"
    q2, k2 = _call(layer, params, "transform_qk", jnp.asarray(q), jnp.asarray(k), jnp.asarray(POSITIONS), jnp.asarray(POSITIONS))
    for got, want, what in ((q2, q, "q"), (k2, k, "k")):
        assert got.shape == want.shape and got.dtype == want.dtype, (
            f"{name}.transform_qk: {what} {got.shape} {got.dtype}, expected {want.shape} {want.dtype}"
        )
    slopes = _call(layer, params, "bias_slopes")
    if slopes is not None:
        assert np.shape(slopes) == (HEADS,), f"{name}.bias_slopes: shape {np.shape(slopes)}, expected ({HEADS},)"
        assert np.isfinite(np.asarray(slopes, np.float64)).all(), f"{name}.bias_slopes: non-finite slopes"
    bias = _call(layer, params, "attention_bias", jnp.asarray(POSITIONS), jnp.asarray(POSITIONS))
    if bias is not None:
        assert bias.ndim == 4, f"{name}.attention_bias: rank {bias.ndim}, expected [batch|1, heads|1, q_len, kv_len]"
        np.broadcast_shapes(bias.shape, (BATCH, HEADS, SEQ, SEQ))  # Raises if it does not broadcast.
        assert bias.shape[2:] == (SEQ, SEQ), f"{name}.attention_bias: shape {bias.shape}"
    for value, what in ((out, "embed_inputs"), (q2, "transform_qk q"), (k2, "transform_qk k")):
        assert np.isfinite(np.asarray(jnp.asarray(value, jnp.float32))).all(), f"{name}.{what}: non-finite values"


def _everything(layer, params, x, q, k, positions) -> list[np.ndarray]:
    out = [np.asarray(_call(layer, params, "embed_inputs", jnp.asarray(x), jnp.asarray(positions)), np.float64)]
    out.append(logits(layer, params, q, k, positions, positions))
    return out


def check_positions_matter(layer, params) -> None:
    """Changing the positions (not by a common shift) changes some output."""
    x, q, k = _inputs(np.float32)
    before = _everything(layer, params, x, q, k, POSITIONS)
    after = _everything(layer, params, x, q, k, POSITIONS * 2)
    assert any(not np.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(before, after)), (
        f"{type(layer).__name__}: no output depends on the positions; set `identity = True` if that is intended."
    )


def check_relative_invariance(layer, params, tol: float = 1e-4) -> None:
    """Attention logits (and embed_inputs) are unchanged when every position moves by the same shift."""
    x, q, k = _inputs(np.float32)
    name = type(layer).__name__
    before = logits(layer, params, q, k, POSITIONS, POSITIONS)
    after = logits(layer, params, q, k, POSITIONS + SHIFT, POSITIONS + SHIFT)
    err = float(np.abs(before - after).max())
    assert err <= tol * max(1.0, float(np.abs(before).max())), (
        f"{name} claims relative positions, but shifting every position by {SHIFT} changes the attention logits by {err:.3g}"
    )
    e0 = _call(layer, params, "embed_inputs", jnp.asarray(x), jnp.asarray(POSITIONS))
    e1 = _call(layer, params, "embed_inputs", jnp.asarray(x), jnp.asarray(POSITIONS + SHIFT))
    np.testing.assert_allclose(
        np.asarray(e0), np.asarray(e1), rtol=tol, atol=tol,
        err_msg=f"{name} claims relative positions, but embed_inputs depends on absolute positions",
    )
