"""The `int8` plugin (entry point `int8`): int8 matmuls with per-channel and per-token scales.

Enable it with `plugins: [int8]` (or `--set plugins=[int8]`); it is never autoloaded. It
registers `Int8Dot` (kernel `int8`, priority 50) for the `dot` op, so every weight
matmul it supports runs in int8 on TPUs, and as a numerics emulation on CPU:
activations quantized per token and weights per output channel (dynamic, symmetric,
from the float32 master weights every step), int32 accumulation, gradients in bfloat16
with float32 accumulation (see `axcore_tpu.int8_dot`). The output head (float32
logits), sites whose sizes are not multiples of 128 on TPU, and other platforms keep the
regular kernel. Force a site back with a layer's `kernels: {dot: xla}`.

The `tpu` plugin registers the same kernel below the reference (available by name only,
for its `int8_dot` config modifier); this plugin's registration says override=True, so
listing both keeps one `int8` kernel, this one.

Importing this module touches no device and compiles nothing.
"""

from __future__ import annotations

from axcore import hookimpl

from axcore_tpu.int8_dot import Int8Dot


@hookimpl
def axcore_register_kernels(register):
    register("dot", Int8Dot(), override=True)
