"""QLoRA's frozen base: a projection's weight stored as int8 or NF4 bytes, dequantized in the matmul.

A weight w with contracted dims `contract` (product `in`) and other dims (product `out`)
is first laid out as `W [out, in]` (one row per output channel, torch's layout), then
stored as one uint8 array (codes and scales together, so one initializer and one
checkpoint entry per weight):

- `int8`: `[out, in + 4]`. Row o holds the int8 codes `round(W[o] / s_o)` in [-127, 127]
  (as bytes) and, in its last 4 bytes, the float32 scale `s_o = max|W[o]| / 127`
  (per output channel; 1 for an all-zero row). Bytes per base parameter: 1 + 4 / in.
  Rounding bound: `|W - s * code| <= s / 2` per channel.
- `nf4` (QLoRA's 4-bit NormalFloat, as bitsandbytes): W flattened row-major, zero-padded to
  a multiple of 64, in blocks of 64 consecutive values (along `in`), each scaled by its
  absmax `m_b` and rounded to the nearest of the 16 `NF4_CODE` values; `[blocks, 36]`:
  32 bytes of codes (two per byte, the first value in the high nibble) and the float32
  absmax in the last 4 bytes. Bytes per base parameter: (32 + 4) / 64 = 0.5625 (no double
  quantization of the absmax). Rounding bound: `|W - m_b * code| <= m_b * max_gap / 2`
  with max_gap the largest distance between neighbouring code values.

`quantize(fmt, w, contract)` gives the stored array, `dequantize(fmt, stored, in_dim,
out)` the `[out, in]` float32 values, `stored_shape(fmt, in_dim, out)` the stored shape.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The stored forms of a base weight (`lora.base_format`); "float" keeps the layer's own weight.
FORMATS = ("float", "int8", "nf4")
# NF4's 16 values: the QLoRA paper's normal quantiles (bitsandbytes' create_normal_map), ascending.
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
], np.float32)
# Values per NF4 block (one absmax each), as QLoRA.
BLOCK = 64
# Bytes of the float32 scale stored after each row / block.
SCALE_BYTES = 4


def stored_shape(fmt: str, in_dim: int, out: int) -> tuple[int, int]:
    """Shape of the uint8 array storing an `[out, in]` weight in `fmt` (module docstring)."""
    if fmt == "int8":
        return (out, in_dim + SCALE_BYTES)
    return (math.ceil(out * in_dim / BLOCK), BLOCK // 2 + SCALE_BYTES)


def bytes_per_parameter(fmt: str, in_dim: int, out: int) -> float:
    """Stored bytes per base parameter of an `[out, in]` weight (codes plus scales)."""
    return math.prod(stored_shape(fmt, in_dim, out)) / (in_dim * out)


def as_rows(w: jax.Array, contract: tuple[int, ...]) -> jax.Array:
    """w `[*w_shape]` -> `[out, in]` (other dims first, then the contracted ones, each flattened in order)."""
    free = tuple(i for i in range(w.ndim) if i not in contract)
    out = math.prod(w.shape[i] for i in free)
    return jnp.transpose(w, (*free, *contract)).reshape(out, -1)


def from_rows(rows: jax.Array, w_shape: tuple[int, ...], contract: tuple[int, ...]) -> jax.Array:
    """The inverse of `as_rows`: `[out, in]` -> `[*w_shape]`."""
    free = tuple(i for i in range(len(w_shape)) if i not in contract)
    order = (*free, *contract)
    y = rows.reshape(*(w_shape[i] for i in order))
    return jnp.transpose(y, [order.index(i) for i in range(len(w_shape))])


def _scale_bytes(scale: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint8)  # [n] -> [n, 4]


def _scale_of(stored: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(stored[:, -SCALE_BYTES:], jnp.float32)  # [n, 4] -> [n]


def quantize(fmt: str, w: jax.Array, contract: tuple[int, ...]) -> jax.Array:
    """Weight `w` (float, any layout with contracted dims `contract`) stored in `fmt` (uint8; module docstring)."""
    rows = as_rows(jnp.asarray(w, jnp.float32), contract)
    if fmt == "int8":
        amax = jnp.max(jnp.abs(rows), axis=1)
        scale = jnp.where(amax > 0, amax / 127.0, 1.0)
        codes = jnp.clip(jnp.round(rows / scale[:, None]), -127, 127).astype(jnp.int8)
        return jnp.concatenate([jax.lax.bitcast_convert_type(codes, jnp.uint8), _scale_bytes(scale)], axis=1)
    if fmt != "nf4":
        raise ValueError(f"unknown base format {fmt!r}; one of {FORMATS[1:]}")
    flat = rows.reshape(-1)
    flat = jnp.pad(flat, (0, -flat.size % BLOCK)).reshape(-1, BLOCK)
    amax = jnp.max(jnp.abs(flat), axis=1)
    absmax = jnp.where(amax > 0, amax, 1.0)
    normalized = flat / absmax[:, None]
    index = jnp.argmin(jnp.abs(normalized[..., None] - jnp.asarray(NF4_CODE)), axis=-1).astype(jnp.uint8)
    packed = (index[:, 0::2] << 4) | index[:, 1::2]
    return jnp.concatenate([packed, _scale_bytes(absmax)], axis=1)


def dequantize(fmt: str, stored: jax.Array, in_dim: int, out: int, dtype: Any = jnp.float32) -> jax.Array:
    """The `[out, in]` values (in `dtype`) of a weight stored in `fmt` (module docstring)."""
    scale = _scale_of(stored).astype(dtype)
    if fmt == "int8":
        codes = jax.lax.bitcast_convert_type(stored[:, :in_dim], jnp.int8)
        return codes.astype(dtype) * scale[:, None]
    packed = stored[:, : BLOCK // 2]
    index = jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(packed.shape[0], BLOCK)
    values = jnp.asarray(NF4_CODE, dtype)[index] * scale[:, None]
    return values.reshape(-1)[: out * in_dim].reshape(out, in_dim)


@dataclasses.dataclass(frozen=True)
class QuantizedInit:
    """Initializer of a stored weight: the declared weight's initializer (same key, declared shape,
    float32), quantized; so a quantized model's base is its float twin's up to rounding (hashable)."""

    inner: Any
    w_shape: tuple[int, ...]
    contract: tuple[int, ...]
    fmt: str

    def __call__(self, key, shape, dtype):
        return quantize(self.fmt, self.inner(key, self.w_shape, jnp.float32), self.contract).astype(dtype)


def quantized_init(spec: Any) -> tuple[QuantizedInit, int] | None:
    """`(QuantizedInit, stacked leading axes)` of a stored weight's ParameterSpec (a scanned stack wraps the
    initializer once per stacked axis, each with an `inner`), or None for any other parameter."""
    init, depth = spec.initializer, 0
    while not isinstance(init, QuantizedInit):
        init = getattr(init, "inner", None)
        if init is None:
            return None
        depth += 1
    return init, depth


def _per_layer(fn, depth: int):
    for _ in range(depth):
        fn = jax.vmap(fn)
    return fn


def quantize_as(spec: Any, value: Any) -> np.ndarray:
    """A float weight in its declared layout (with the stacked axes of `spec`) stored as `spec` says."""
    q, depth = quantized_init(spec)
    return np.asarray(_per_layer(lambda w: quantize(q.fmt, w, q.contract), depth)(jnp.asarray(value, jnp.float32)))


def dequantize_as(spec: Any, stored: Any) -> np.ndarray:
    """The float32 weight, in its declared layout (with the stacked axes), of a weight stored as `spec` says."""
    q, depth = quantized_init(spec)
    in_dim = math.prod(q.w_shape[i] for i in q.contract)
    out = math.prod(q.w_shape) // in_dim

    def one(s):
        return from_rows(dequantize(q.fmt, s, in_dim, out), q.w_shape, q.contract)

    return np.asarray(_per_layer(one, depth)(jnp.asarray(stored)))
