"""The fallback TPU attention kernel: JAX's Pallas TPU flash attention (`pallas_tpu`, priority 90).

`jax.experimental.pallas.ops.tpu.flash_attention.flash_attention` predates splash
attention and does less; it is registered below `splash` (priority 100) and above the
XLA reference (0), for calls splash declines that it can run.

Mapping from an `AttentionProblem`:

    layout        q `[b, t, n, h]` -> `[b, n, t, h]`, k and v likewise
    scale         `sm_scale=scale` (applied to q.k in float32 inside the kernel)
    causal        `causal=True`, only with q_len == kv_len: its mask is `j <= i`
                  (top-left aligned), which is axcore's end-aligned mask only then
    segment ids   `SegmentIds(q, kv)` `[b, t]`, `[b, s]`
    kv_mask       folded into segment ids as for splash (`segment_ids_with_mask`)
    GQA/MQA       k and v repeated to num_heads along the head axis before the call (the
                  kernel takes equal head counts): costs `group` times k's and v's memory
                  and bandwidth in the attention call, and autodiff sums dk, dv over the
                  copies
    head_dim      zero-padded to a multiple of 128, as for splash

Declined, with the reason: the checks shared with splash (platform tpu unless
interpret=True; bfloat16/float32; lengths multiples of 128; no dropout, ALiBi, bias
function or dense bias; heads a multiple of kv heads), causal with q_len != kv_len,
a sliding window shorter than kv_len, a logit soft-cap (the kernel has neither),
unknown extras, and shardings `mesh_layout` declines.

The kernel has no interpret argument: with `interpret=True` it is traced under
`jax.experimental.pallas.tpu.force_tpu_interpret_mode(True)`, which makes its pallas
calls (forward and backward) run in Pallas's generic interpret mode, as splash's
`interpret=True` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

from axcore.kernels import SUPPORTED, AttentionProblem, Support

from axcore_tpu.splash_attention import TpuAttentionKernel, check_common, effective_window, pad_head_dim

# What `force_tpu_interpret_mode` passes as every traced pallas_call's `interpret`: True is Pallas's
# generic interpreter (the one splash's `interpret=True` uses). Its default, TPU interpret mode
# (`InterpretParams()`, simulated TPU memories), hung (over 300 s, no progress) under a 4-device
# shard_map on CPU, where the generic interpreter takes seconds.
GENERIC_INTERPRET = True


def interpreted(fn):
    """`fn(*arrays)` with its Pallas calls, forward and backward, traced in Pallas interpret mode.

    A context manager around the call alone would miss the backward kernels, which JAX
    traces later (when the gradient is transposed); this custom VJP enters the mode in
    both passes.
    """

    @jax.custom_vjp
    def call(*args):
        with pltpu.force_tpu_interpret_mode(GENERIC_INTERPRET):
            return fn(*args)

    def forward(*args):
        with pltpu.force_tpu_interpret_mode(GENERIC_INTERPRET):
            return jax.vjp(fn, *args)

    def backward(pullback, cotangent):
        with pltpu.force_tpu_interpret_mode(GENERIC_INTERPRET):
            return pullback(cotangent)

    call.defvjp(forward, backward)
    return call


class PallasTpuAttention(TpuAttentionKernel):
    """JAX's Pallas TPU flash attention (module docstring: mapping, declines).

    Args:
        interpret: trace the kernel in Pallas interpret mode (runs on CPU; for tests).
        priority: selection priority (90: after splash, before the reference).
    """

    name = "pallas_tpu"
    priority = 90

    def __init__(self, *, interpret: bool = False, priority: int = 90):
        self.interpret = interpret
        self.priority = priority

    def check(self, problem: AttentionProblem) -> Support:
        support = check_common(problem, interpret=self.interpret, what="Pallas TPU flash attention")
        if not support:
            return support
        if problem.causal and problem.q_len != problem.kv_len:
            return Support(
                False,
                f"causal with q_len {problem.q_len} != kv_len {problem.kv_len}: the kernel's causal mask is "
                f"top-left aligned, axcore's end-aligned",
            )
        if effective_window(problem) is not None:
            return Support(False, "does not implement a sliding window")
        if problem.softcap is not None:
            return Support(False, "does not implement a logit soft-cap")
        return SUPPORTED

    def attend(self, problem: AttentionProblem, q, k, v, q_segment_ids=None, kv_segment_ids=None):
        head_dim, group = q.shape[-1], q.shape[2] // k.shape[2]
        if group > 1:  # The kernel takes one kv head per query head.
            k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        qs, ks, vs = (pad_head_dim(jnp.swapaxes(x, 1, 2)) for x in (q, k, v))
        rows = () if q_segment_ids is None else (q_segment_ids, kv_segment_ids)

        def flash(qs, ks, vs, *rows):
            segments = tpu_flash.SegmentIds(q=rows[0], kv=rows[1]) if rows else None
            return tpu_flash.flash_attention(
                qs, ks, vs, segment_ids=segments, causal=bool(problem.causal), sm_scale=float(problem.scale)
            )

        out = (interpreted(flash) if self.interpret else flash)(qs, ks, vs, *rows)
        return jnp.swapaxes(out[..., :head_dim], 1, 2).astype(q.dtype)


__all__ = ["PallasTpuAttention"]
