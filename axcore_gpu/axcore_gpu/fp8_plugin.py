"""The `fp8` plugin (entry point `fp8`): fp8 matmuls with per-tensor delayed scaling.

Enable it in an experiment with `plugins: [fp8]` (or `--set plugins=[fp8]`); unlike the
`gpu` hardware plugin it is never autoloaded. It registers `Fp8Dot` (kernel `fp8`,
priority 50) for the `dot` op, so every weight matmul it supports runs in fp8 on
CUDA devices of compute capability 8.9+ (Ada, Hopper and newer), and as a numerics-only
(slow) emulation on CPU.

What is quantized: both operands of each supported matmul in the forward pass
(float8_e4m3fn) and its output gradient in the backward pass (float8_e5m2), each with a
per-tensor scale from an amax history kept as kernel state (`kernel_state/<site>` among
the parameters: `x_amax_history`, `w_amax_history`, `g_amax_history`, float32).

What stays in higher precision: the float32 master weights and optimizer state, float32
accumulation of every matmul, activations between matmuls (the compute dtype), norms,
softmax, attention, the output head's float32 logits and the loss, and any site the
kernel declines (sizes not multiples of 16, e.g. a small MoE router; see
`axcore_gpu.fp8_dot`). Force a site back with a layer's `kernels: {dot: xla}`.

Importing this module touches no device and compiles nothing.
"""

from __future__ import annotations

from axcore import hookimpl

from axcore_gpu.fp8_dot import Fp8Dot


@hookimpl
def axcore_register_kernels(register):
    register("dot", Fp8Dot())
