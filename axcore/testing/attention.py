"""Conformance checks of an `attention` kernel against the attention formula in NumPy float64.

The oracle is the formula the reference kernel `xla` documents (`axcore.kernels.attention`),
written again here in NumPy float64, forward and backward, so every kernel, the
reference kernel included, is checked against an independent implementation:

    logits = scale * q.k (query head n uses kv head n // group), masked (causal,
    sliding window, key padding) to -inf; p = softmax(logits); out = p v.

Cases avoid rows whose keys are all masked (kernels may differ there by design).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels import AttentionProblem, Support, current_platform

# An extras entry no kernel knows: an honest `is_supported` declines it.
UNKNOWN_EXTRA = "axcore_conformance_unknown_capability"
# dtype name -> (output tolerance, gradient tolerance), relative to the oracle's largest magnitude.
DEFAULT_TOLERANCES = {"float32": (2e-5, 1e-4), "bfloat16": (4e-2, 8e-2), "float16": (8e-3, 2e-2)}


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One attention problem the suite runs: shapes, dtype and masks (small on purpose)."""

    name: str
    batch: int = 2
    q_len: int = 8
    kv_len: int = 8
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 8
    dtype: str = "float32"
    causal: bool = False
    sliding_window: int | None = None
    # Batch row 1 pads its last `kv_padding` keys (`kv_mask`); 0 = no mask input.
    kv_padding: int = 0

    def problem(self, platform: str | None = None, **fields: Any) -> AttentionProblem:
        """The `AttentionProblem` of this case (`fields` override or add problem fields)."""
        return AttentionProblem(
            platform=platform or current_platform(),
            batch=self.batch,
            q_len=self.q_len,
            kv_len=self.kv_len,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=np.dtype(jnp.dtype(self.dtype)),
            scale=1.0 / float(np.sqrt(self.head_dim)),
            causal=self.causal,
            sliding_window=self.sliding_window,
            has_kv_mask=self.kv_padding > 0,
            **fields,
        )

    def inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """q, k, v (in the case's dtype), the output cotangent `d_out` and `kv_mask` if any."""
        rng = np.random.default_rng(seed)
        dtype = jnp.dtype(self.dtype)
        shapes = {
            "q": (self.batch, self.q_len, self.num_heads, self.head_dim),
            "k": (self.batch, self.kv_len, self.num_kv_heads, self.head_dim),
            "v": (self.batch, self.kv_len, self.num_kv_heads, self.head_dim),
            "d_out": (self.batch, self.q_len, self.num_heads, self.head_dim),
        }
        out = {name: rng.normal(size=shape).astype(dtype) for name, shape in shapes.items()}
        if self.kv_padding:
            mask = np.ones((self.batch, self.kv_len), bool)
            mask[1, self.kv_len - self.kv_padding :] = False
            out["kv_mask"] = mask
        return out


# Few and small: each case compiles a forward and a backward pass.
DEFAULT_CASES: tuple[AttentionCase, ...] = (
    AttentionCase("f32"),
    AttentionCase("f32-causal-gqa", num_heads=4, num_kv_heads=2, causal=True),
    AttentionCase("f32-causal-sliding-padding-cross", q_len=6, kv_len=8, causal=True, sliding_window=3, kv_padding=2),
    AttentionCase("bf16-causal-gqa", num_heads=4, num_kv_heads=1, causal=True, dtype="bfloat16"),
    # Past the common tile sizes (64, 128) and a multiple of none: a tiled kernel's block edges and padding.
    AttentionCase("f32-causal-long-padding", q_len=200, kv_len=200, num_heads=2, num_kv_heads=1, causal=True, kv_padding=37),
)


def allowed_mask(case: AttentionCase) -> np.ndarray:
    """`[batch, 1, q_len, kv_len]` bool: key j visible to query i (end-aligned causal and window, padding)."""
    t, s = case.q_len, case.kv_len
    i = np.arange(t)[:, None] + (s - t)  # Query i's position on the key axis.
    j = np.arange(s)[None, :]
    allowed = np.ones((case.batch, 1, t, s), bool)
    if case.causal:
        allowed &= (j <= i)[None, None]
    if case.sliding_window is not None:
        allowed &= (i - j < case.sliding_window)[None, None]
    if case.kv_padding:
        allowed[1, :, :, s - case.kv_padding :] = False
    return allowed


def numpy_attention(case: AttentionCase, q, k, v, d_out) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Output `[b, t, n, h]` and the gradients (dq, dk, dv) of `sum(out * d_out)`, in float64."""
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    group = case.num_heads // case.num_kv_heads
    scale = 1.0 / np.sqrt(case.head_dim)
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # Query head n reads kv head n // group.
    logits = np.einsum("btnh,bsnh->bnts", q, kr) * scale
    allowed = allowed_mask(case)
    if not allowed.any(-1).all():
        raise ValueError(f"case {case.name}: a query row has every key masked; the oracle leaves those out.")
    logits = np.where(allowed, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", p, vr)
    # Backward of out = p v, p = softmax(scale q.k).
    dp = np.einsum("btnh,bsnh->bnts", d_out, vr)
    dvr = np.einsum("bnts,btnh->bsnh", p, d_out)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
    dkr = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    fold = lambda x: x.reshape(*x.shape[:2], case.num_kv_heads, group, x.shape[-1]).sum(3)  # noqa: E731
    return out, (dq, fold(dkr), fold(dvr))


def run_kernel(kernel: Any, problem: AttentionProblem, inputs: dict[str, np.ndarray]):
    """The kernel's output and the gradients (dq, dk, dv) of `sum(out * d_out)`, jitted."""
    extra = {"kv_mask": jnp.asarray(inputs["kv_mask"])} if "kv_mask" in inputs else {}

    def loss(q, k, v):
        out = kernel(problem, q, k, v, **extra)
        return jnp.sum(out.astype(jnp.float32) * inputs["d_out"].astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        *(jnp.asarray(inputs[n]) for n in ("q", "k", "v"))
    )
    return out, grads


def _close(name: str, got, want, tol: float, where: str) -> None:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert got.shape == want.shape, f"{where}: {name} has shape {got.shape}, expected {want.shape}"
    assert np.isfinite(got).all(), f"{where}: {name} has non-finite values"
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, f"{where}: {name} differs from the attention formula by {err:.3g} (> {tol * scale:.3g})"


def check_case(
    kernel: Any, case: AttentionCase, *, platform: str | None = None, tolerances: dict | None = None, seed: int = 0
) -> Support:
    """Runs one case if the kernel supports it; checks the output and gradients against the formula.

    Returns the kernel's `Support` (a decline must carry a reason). Raises AssertionError
    on a wrong dtype, shape or number.
    """
    problem = case.problem(platform)
    support = kernel.is_supported(problem)
    assert isinstance(support, Support), f"{kernel.name}.is_supported returned {support!r}, not a Support"
    if not support:
        assert support.reason.strip(), f"{kernel.name} declined case {case.name} without a reason"
        return support
    tol_out, tol_grad = {**DEFAULT_TOLERANCES, **(tolerances or {})}[case.dtype]
    inputs = case.inputs(seed)
    want_out, want_grads = numpy_attention(case, inputs["q"], inputs["k"], inputs["v"], inputs["d_out"])
    out, grads = run_kernel(kernel, problem, inputs)
    where = f"kernel {kernel.name!r}, case {case.name}"
    assert out.dtype == jnp.dtype(case.dtype), f"{where}: output dtype {out.dtype}, expected {case.dtype} (q's)"
    _close("output", out, want_out, tol_out, where)
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        _close(name, got, want, tol_grad, where)
    return support


def check_declines_unknown_extras(kernel: Any, case: AttentionCase, *, platform: str | None = None) -> None:
    """An honest kernel declines a problem carrying an extras entry it does not know, with a reason."""
    support = kernel.is_supported(case.problem(platform, extras={UNKNOWN_EXTRA: True}))
    assert isinstance(support, Support), f"{kernel.name}.is_supported returned {support!r}, not a Support"
    assert not support, (
        f"kernel {kernel.name!r} accepts a problem with unknown extras {{{UNKNOWN_EXTRA!r}: True}}; "
        f"decline extras you do not implement (axcore.kernels.unknown_extras)."
    )
    assert support.reason.strip(), f"{kernel.name} declined unknown extras without a reason"


def check_attention_kernel(
    kernel: Any,
    cases: Sequence[AttentionCase] = DEFAULT_CASES,
    *,
    platform: str | None = None,
    tolerances: dict | None = None,
) -> list[str]:
    """Every check of the suite in one call (for scripts); returns the names of the cases run.

    Raises AssertionError if a check fails or the kernel declines every case.
    """
    assert isinstance(kernel.name, str) and kernel.name, "a kernel has a non-empty name"
    assert isinstance(kernel.priority, int), "a kernel has an int priority"
    check_declines_unknown_extras(kernel, cases[0], platform=platform)
    ran = [c.name for c in cases if check_case(kernel, c, platform=platform, tolerances=tolerances)]
    assert ran, f"kernel {kernel.name!r} declined every case; the suite checked nothing"
    return ran
