"""The pure-JAX contender of the GPU benchmark: a Llama-shaped decoder written with `jax.numpy` and optax.

What a competent JAX user writes by hand for a Llama: a dict of arrays, a Python loop
over layers (axcore's default stack is unrolled too), pre-RMSNorm, rotate-half RoPE
with its cos/sin tables computed once per forward, grouped-query attention, a SwiGLU
feed-forward, an untied head and no learned absolute positions. The step is
`jax.jit` with parameters and optimizer state donated; the optimizer is
`optax.chain(clip_by_global_norm, adamw(mask=...))` (`benchmarks.pure_jax_model`).

Dtype policy (axcore's, see `axcore/layers/base.py`): parameters and optimizer state
are float32 master weights; every weight is cast to the compute dtype (bfloat16)
where it is used, so gradients reach the float32 weights through the cast; the
embedding rows are gathered in float32 and then cast; activations (the residual
stream included) are in the compute dtype; norms, RoPE's rotation, attention logits
and softmax, the logits of the head and the loss are float32.

Attention, per `implementation`:

- `xla`: two einsums around a float32 softmax, the query heads of a group sharing
  their kv head without materialising repeated k and v (axcore's reference kernel
  computes the same);
- `cudnn`: `jax.nn.dot_product_attention(q, k, v, scale=..., is_causal=True,
  implementation="cudnn")` (cuDNN's fused flash attention; GPU only).

Parameters (D = dim, H heads, K kv heads, h = D / H, F = ffn, V = vocab, layer i):
    embed [V, D], layers[i] = {attn_norm [D], wq [D, H*h], wk/wv [D, K*h], wo [H*h, D],
    ffn_norm [D], w_gate/w_up [D, F], w_down [F, D]}, final_norm [D], head [D, V].
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.pure_jax_model import Hyper

Attention = Literal["xla", "cudnn"]


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Sizes of the benchmark decoder (defaults: the full ~1B model, 0.89B parameters)."""

    vocab: int = 32768
    dim: int = 2048
    layers: int = 16
    heads: int = 16
    kv_heads: int = 8
    ffn: int = 5632
    seq: int = 2048
    batch: int = 8

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def num_params_matmul(self) -> int:
        """Weights that a matmul multiplies: q, k, v, o, gate, up, down per layer, and the head."""
        d, h = self.dim, self.head_dim
        per_layer = d * self.heads * h + 2 * d * self.kv_heads * h + self.heads * h * d + 3 * d * self.ffn
        return self.layers * per_layer + d * self.vocab

    def num_params(self) -> int:
        """Every parameter: the matmul weights, the embedding table and the norm scales."""
        return self.num_params_matmul() + self.vocab * self.dim + (2 * self.layers + 1) * self.dim


# The smoke-mode model (CPU, seconds; the numbers mean nothing). vocab 256: axcore's byte tokenizer needs it.
SMOKE_SHAPE = LlamaShape(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=32, batch=2)


def from_axcore(tree: dict[str, Any], convert: Callable[[Any, tuple[int, ...] | None], Any]) -> dict[str, Any]:
    """axcore's CausalLM tree (parameters, or their specs) in this module's layout.

    `convert(leaf, new_shape)` makes each leaf; `new_shape` is the flattened shape of
    an attention projection (axcore keeps `[D, heads, h]` and `[heads, h, D]`), else None.
    """
    dec = tree["decoder"]
    num_layers = sum(1 for key in dec if key.startswith("layer"))
    layers = []
    for i in range(num_layers):
        p = dec[f"layer{i}"]
        attn, ffn = p["self_attention"], p["feed_forward"]
        layers.append(
            {
                "attn_norm": convert(p["attention_norm"]["scale"], None),
                "wq": convert(attn["wq"], (attn["wq"].shape[0], -1)),
                "wk": convert(attn["wk"], (attn["wk"].shape[0], -1)),
                "wv": convert(attn["wv"], (attn["wv"].shape[0], -1)),
                "wo": convert(attn["wo"], (-1, attn["wo"].shape[-1])),
                "ffn_norm": convert(p["ffn_norm"]["scale"], None),
                "w_gate": convert(ffn["gate_proj"]["weight"], None),
                "w_up": convert(ffn["up_proj"]["weight"], None),
                "w_down": convert(ffn["down_proj"]["weight"], None),
            }
        )
    return {
        "embed": convert(tree["embedding"]["weight"], None),
        "layers": layers,
        "final_norm": convert(tree["final_norm"]["scale"], None),
        "head": convert(tree["lm_head"]["weight"], None),
    }


def host_copy(leaf: Any, new_shape: tuple[int, ...] | None) -> np.ndarray:
    """A `from_axcore` converter for parameters: a host copy, reshaped (survives axcore's donation)."""
    array = np.array(leaf)
    return array if new_shape is None else array.reshape(new_shape)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """In float32; the result has x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[seq, 1, head_dim/2]` (float32): angle m * theta^(-2i/head_dim)."""
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * jnp.asarray(freqs, jnp.float32)
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x `[B, T, heads, h]` in float32 (feature i pairs with i + h/2); x's dtype out."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """Causal GQA: q `[B, T, H, h]`, k and v `[B, T, K, h]` -> `[B, T, H, h]`; query head n reads kv head n // (H/K)."""
    b, t, heads, h = q.shape
    kv_heads = k.shape[2]
    q5 = q.reshape(b, t, kv_heads, heads // kv_heads, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q5, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, heads, h)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, implementation: Attention) -> jax.Array:
    """Causal self-attention with softmax scale 1/sqrt(h) by `implementation` (module docstring)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if implementation == "xla":
        return xla_attention(q, k, v, scale)
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
    raise ValueError(f"attention implementation must be 'xla' or 'cudnn', not {implementation!r}")


def forward(
    params: dict, ids: jax.Array, shape: LlamaShape, hyper: Hyper, attention: Attention, compute_dtype: Any
) -> jax.Array:
    """ids `[B, T]` -> float32 logits `[B, T, V]`."""
    dt = compute_dtype

    def dot(x, w):  # The weight is cast where it is used; its gradient reaches it in float32.
        return x @ w.astype(dt)

    b, t = ids.shape
    h = shape.head_dim
    x = jnp.take(params["embed"], ids, axis=0).astype(dt)
    cos, sin = rope_tables(t, h, hyper.rope_theta)
    for p in params["layers"]:
        y = rms_norm(x, p["attn_norm"], hyper.norm_eps)
        q = dot(y, p["wq"]).reshape(b, t, shape.heads, h)
        k = dot(y, p["wk"]).reshape(b, t, shape.kv_heads, h)
        v = dot(y, p["wv"]).reshape(b, t, shape.kv_heads, h)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        x = x + dot(attend(q, k, v, attention).reshape(b, t, shape.heads * h), p["wo"])
        y = rms_norm(x, p["ffn_norm"], hyper.norm_eps)
        x = x + dot(jax.nn.silu(dot(y, p["w_gate"])) * dot(y, p["w_up"]), p["w_down"])
    x = rms_norm(x, params["final_norm"], hyper.norm_eps)
    return jnp.dot(x, params["head"].astype(dt), preferred_element_type=jnp.float32)


def loss_fn(
    params: dict, batch: dict, shape: LlamaShape, hyper: Hyper, attention: Attention, compute_dtype: Any
) -> jax.Array:
    """Mean next-token cross-entropy, in float32."""
    logits = forward(params, batch["input_ids"], shape, hyper, attention, compute_dtype)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    label_logits = jnp.take_along_axis(logits, batch["target_labels"][..., None], axis=-1)[..., 0]
    return jnp.mean(log_z - label_logits)


def make_train_step(
    optimizer: optax.GradientTransformation,
    shape: LlamaShape,
    hyper: Hyper,
    attention: Attention,
    compute_dtype: Any = jnp.bfloat16,
):
    """`(params, opt_state, batch) -> (params, opt_state, loss)`, jitted with params and state donated."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, shape, hyper, attention, compute_dtype)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def num_params(params: Any) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
