"""cuDNN fused (flash) attention through `jax.nn.dot_product_attention(implementation="cudnn")`.

Kernels of the `attention` op with this plugin, tried in this order (highest priority first):

    100  cudnn       this module: cuDNN flash attention, bfloat16/float16 on CUDA sm80+
     90  pallas      pallas_attention.py: Pallas (Triton) flash attention, also segment ids,
                     soft-cap, float32 and causal with q_len != kv_len
      0  xla         axcore's reference kernel, every capability (the fallback)

Mapping from an `AttentionProblem` to `jax.nn.dot_product_attention` (layouts agree:
q `[b, t, n, h]`, k and v `[b, s, kv, h]`, GQA native when n is a multiple of kv):

    scale                        -> scale
    causal (needs q_len == kv_len) -> is_causal=True
    sliding_window w (causal)    -> local_window_size=(w - 1, 0): key j is visible iff
                                    i - j <= w - 1, i.e. axcore's i - j < w (cuDNN's
                                    sliding_window_length w, keys (i - w, i]); a window of
                                    kv_len or more excludes nothing and is dropped
    kv_mask [b, s]               -> mask [b, 1, t, s] (bool); cuDNN adds it as a bias, the
                                    slower path that also needs even sequence lengths

Declined, with the reason: another platform, float32 (cuDNN flash attention takes
bfloat16/float16), head_dim not a multiple of 8 or over 128 (256 on sm90+), devices
older than sm80, causal attention with q_len != kv_len (cuDNN's causal mask is
top-left aligned, axcore's end-aligned), a non-causal window shorter than kv_len
(cuDNN windows only causal attention), segment ids (`jax.nn.dot_product_attention`
takes none; a dense `[b, 1, t, s]` mask would express them, but cuDNN adds a mask as a
bias, the slow path that gives up the fused kernel's memory savings, so packed batches
go to the next kernel that takes them: the reference, or `pallas` where it is chosen), logit
soft-cap, attention dropout, ALiBi slopes, a bias function and a dense bias (none has
an exact mapping through `jax.nn.dot_product_attention`), unknown extras, and input
specs that shard anything but batch and heads.

Under a multi-device mesh whose input specs shard batch and/or heads, the call runs
inside `jax.shard_map` over those axes (each device attends its own rows and heads),
so the kernel works under data/fsdp-sharded batches and head-sharded tensor
parallelism alike. Rows whose keys are all masked are not guaranteed to match the
reference (which averages every key for them).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from axcore.kernels import SUPPORTED, AttentionProblem, Support
from axcore.kernels.attention_sharding import attention_mesh_layout
from axcore.kernels.fused_attention import DECLINED_INPUTS, FusedAttentionKernel

from axcore_gpu.devices import cuda_compute_capability

# Dtypes of q, k, v that cuDNN flash attention takes.
CUDNN_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# Lowest CUDA compute capability with cuDNN flash attention (Ampere).
MIN_COMPUTE_CAPABILITY = (8, 0)
# head_dim bounds checked by JAX before the cuDNN call: a multiple of 8, at most 128,
# or 256 on Hopper (sm90) and newer.
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 128
MAX_HEAD_DIM_SM90 = 256


def effective_window(problem: AttentionProblem) -> int | None:
    """The problem's sliding window, or None when it excludes no key (window >= kv_len)."""
    window = problem.sliding_window
    if window is None or window >= problem.kv_len:
        return None
    return window


def dot_product_attention_arguments(problem: AttentionProblem, q, k, kv_mask=None) -> dict[str, Any]:
    """Keyword arguments of `jax.nn.dot_product_attention` that compute `problem` (table above).

    Shapes are read from the arrays, so the same mapping serves a shard of the batch.
    """
    arguments: dict[str, Any] = {"scale": problem.scale, "is_causal": problem.causal}
    window = effective_window(problem)
    if window is not None:
        arguments["local_window_size"] = (window - 1, 0)
    if kv_mask is not None:
        batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
        mask = kv_mask.astype(bool)[:, None, None, :]
        # Full [b, 1, t, s]: cuDNN's bias (which the mask becomes) must span q_len.
        arguments["mask"] = jnp.broadcast_to(mask, (batch, 1, q_len, kv_len))
    return arguments


def mapped_attention(
    problem: AttentionProblem, q, k, v, kv_mask=None, *, implementation: Literal["cudnn", "xla"] = "cudnn"
):
    """`jax.nn.dot_product_attention` on the problem's mapped arguments; `[b, t, n, h]` like q."""
    arguments = dot_product_attention_arguments(problem, q, k, kv_mask)
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation, **arguments)


# Shared with every per-device attention kernel (the name this package has exported).
mesh_layout = attention_mesh_layout


class CudnnAttention(FusedAttentionKernel):
    """cuDNN flash attention (module docstring: mapping, declines, sharding).

    Args:
        implementation: "cudnn"; "xla" runs the same argument mapping through JAX's XLA
            implementation, so the mapping is testable on CPU.
        compute_capability: `(major, minor)` of the target GPU; None = read from the
            devices of the problem's mesh (or the process's) at `is_supported` time.
    """

    name = "cudnn"
    priority = 100
    # Segment ids too: jax.nn.dot_product_attention takes none (is_supported says why).
    declined_inputs = ("q_segment_ids", "kv_segment_ids", *DECLINED_INPUTS)
    # The sharded call has no Pallas loop to type: shard_map checks it.
    check_vma = True

    def __init__(
        self,
        *,
        implementation: Literal["cudnn", "xla"] = "cudnn",
        compute_capability: tuple[int, int] | None = None,
    ):
        self.implementation = implementation
        self.compute_capability = compute_capability

    def check(self, problem: AttentionProblem) -> Support:
        if problem.platform != "gpu":
            return Support(False, f"platform is '{problem.platform}'; cuDNN attention runs on CUDA GPUs")
        if np.dtype(problem.dtype) not in CUDNN_DTYPES:
            dtype = np.dtype(problem.dtype).name
            return Support(False, f"dtype {dtype}: cuDNN flash attention takes bfloat16 or float16")
        capability = self.compute_capability or cuda_compute_capability(problem.mesh)
        if capability is None:
            return Support(False, "no CUDA device visible to read the compute capability from")
        if capability < MIN_COMPUTE_CAPABILITY:
            major, minor = capability
            return Support(False, f"compute capability {major}.{minor}: cuDNN flash attention needs 8.0+")
        support = self._check_shape(problem, capability)
        return support if not support else self._check_capabilities(problem)

    @staticmethod
    def _check_shape(problem: AttentionProblem, capability: tuple[int, int]) -> Support:
        max_head_dim = MAX_HEAD_DIM_SM90 if capability >= (9, 0) else MAX_HEAD_DIM
        if problem.head_dim % HEAD_DIM_MULTIPLE or problem.head_dim > max_head_dim:
            return Support(
                False,
                f"head_dim {problem.head_dim}: cuDNN needs a multiple of {HEAD_DIM_MULTIPLE} up to "
                f"{max_head_dim} on compute capability {capability[0]}.{capability[1]}",
            )
        if problem.num_heads % problem.num_kv_heads:
            return Support(
                False, f"num_heads {problem.num_heads} is not a multiple of num_kv_heads {problem.num_kv_heads}"
            )
        return SUPPORTED

    @staticmethod
    def _check_capabilities(problem: AttentionProblem) -> Support:
        declined = [
            (
                problem.has_segment_ids,
                "segment ids (jax.nn.dot_product_attention takes none; as a dense mask they would give up "
                "the fused kernel's memory savings)",
            ),
            (problem.softcap is not None, "logit soft-cap (jax.nn.dot_product_attention has none)"),
            (problem.dropout_rate > 0.0, "attention dropout (jax.nn.dot_product_attention has none)"),
            (problem.bias_slopes is not None, "ALiBi slopes (only as a dense bias, which defeats the fused kernel)"),
            (problem.bias_fn is not None, "a position-bias function (only as a dense bias)"),
            (problem.has_bias, "a dense bias (not mapped by this kernel)"),
        ]
        for present, what in declined:
            if present:
                return Support(False, f"does not implement {what}")
        if problem.causal and problem.q_len != problem.kv_len:
            return Support(
                False,
                f"causal with q_len {problem.q_len} != kv_len {problem.kv_len}: cuDNN's causal mask is "
                f"top-left aligned, axcore's end-aligned",
            )
        if problem.sliding_window is not None and problem.sliding_window < 1:
            return Support(False, f"sliding_window {problem.sliding_window} < 1")
        if effective_window(problem) is not None and not problem.causal:
            return Support(False, "a sliding window without causal masking (cuDNN windows causal attention only)")
        if problem.has_kv_mask and (problem.q_len % 2 or problem.kv_len % 2):
            return Support(
                False,
                f"kv_mask with odd q_len {problem.q_len} or kv_len {problem.kv_len} (cuDNN's masked "
                f"backward needs even sequence lengths)",
            )
        return SUPPORTED

    def attend(self, problem: AttentionProblem, q, k, v, kv_mask=None):
        return mapped_attention(problem, q, k, v, kv_mask, implementation=self.implementation)
