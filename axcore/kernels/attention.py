"""The attention op: problem description and the XLA reference kernel.

Layout: q `[batch, q_len, num_heads, head_dim]`, k and v
`[batch, kv_len, num_kv_heads, head_dim]`, output `[batch, q_len, num_heads, head_dim]`.
With grouped-query attention `num_heads = num_kv_heads * group`, query head `n`
uses key/value head `n // group` (the same as repeating each kv head `group` times).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels.registry import SUPPORTED, Support

ATTENTION_OP = "attention"


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """What a kernel needs to decide whether it can run an attention call."""

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype
    # Query i sees key j only if j <= i + (kv_len - q_len).
    causal: bool
    # An additive bias `[batch|1, heads|1, q_len, kv_len]` is given.
    has_bias: bool
    # A key padding mask `[batch, kv_len]` is given.
    has_kv_mask: bool
    # jax.default_backend() of the computation: "cpu", "gpu", "tpu", ...
    platform: str

    @classmethod
    def of(cls, q, k, *, causal: bool, bias: Any, kv_mask: Any) -> AttentionProblem:
        return cls(
            batch=q.shape[0],
            q_len=q.shape[1],
            kv_len=k.shape[1],
            num_heads=q.shape[2],
            num_kv_heads=k.shape[2],
            head_dim=q.shape[3],
            dtype=np.dtype(q.dtype),
            causal=causal,
            has_bias=bias is not None,
            has_kv_mask=kv_mask is not None,
            platform=jax.default_backend(),
        )


def causal_mask(q_len: int, kv_len: int) -> jax.Array:
    """`[q_len, kv_len]` bool, True where query i may attend key j (end-aligned)."""
    offset = kv_len - q_len
    return jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + offset


class XlaAttention:
    """Reference attention in plain jax.numpy: softmax(q k^T * scale + bias) v.

    Logits and softmax are computed in float32; the output has q's dtype. Rows whose
    keys are all masked produce a uniform average (never NaN).
    """

    name = "xla"
    # Lowest: every specialized kernel that supports a problem should win over it.
    priority = 0

    def is_supported(self, problem: AttentionProblem) -> Support:
        if problem.num_heads % problem.num_kv_heads:
            return Support(False, "num_heads must be a multiple of num_kv_heads")
        return SUPPORTED

    def __call__(self, q, k, v, *, causal: bool, bias=None, kv_mask=None, scale: float):
        batch, q_len, num_heads, head_dim = q.shape
        kv_len, num_kv_heads = k.shape[1], k.shape[2]
        group = num_heads // num_kv_heads
        if group == 1:  # Plain multi-head: 4-D einsums (a size-1 group axis costs layout copies).
            logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
        else:  # Query head n reads kv head n // group, without materializing repeated k and v.
            q = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
            logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
            logits = logits.reshape(batch, num_heads, q_len, kv_len) * scale
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        allowed = jnp.ones((1, 1, q_len, kv_len), bool)
        if causal:
            allowed = allowed & causal_mask(q_len, kv_len)[None, None]
        if kv_mask is not None:
            allowed = allowed & kv_mask[:, None, None, :].astype(bool)
        logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        if group == 1:
            return jnp.einsum("bnts,bsnh->btnh", probs, v)
        probs = probs.reshape(batch, num_kv_heads, group, q_len, kv_len)
        out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
        return out.reshape(batch, q_len, num_heads, head_dim)
