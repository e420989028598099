"""XLA flags for NVIDIA GPUs, and finding the GPUs without starting JAX.

Flags recommended for `gpu-<kind>-N` (every kind of `GPU_KINDS` alike: nothing measured
here yet tells the kinds apart), after JAX's GPU performance guide and MaxText's and
JAX-Toolbox's GPU recipes:

- any N: `xla_gpu_enable_latency_hiding_scheduler=true`, which schedules asynchronous
  work (collectives, copies) to overlap compute.
- N > 1, for the collectives of data/fsdp parallelism:
  `xla_gpu_enable_highest_priority_async_stream=true` (collectives on a high-priority
  stream); combine thresholds that batch small collectives, all-reduce 1 GiB,
  all-gather 1 GiB / N and reduce-scatter 1 GiB / 2N (JAX-Toolbox's formula);
  pipelined all-gather, reduce-scatter and all-reduce and while-loop double buffering
  (overlap the collectives of a scanned layer stack with the previous layer's compute);
  `xla_gpu_enable_command_buffer=` (empty: no CUDA graphs, which the multi-GPU recipes
  turn off so collectives are not captured in them).

Measured on one H100 (JAX 0.11.2, the 0.89B Llama-shaped benchmark): the latency-hiding
scheduler and cuBLAS-only GEMMs changed the step time by less than the noise, so nothing
single-GPU beyond the scheduler is set. The user overrides any flag with the experiment's
`xla_flags:` (null removes it) or the XLA_FLAGS environment variable.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
from collections.abc import Mapping

from axcore.platform.mesh import InstanceType, device_kind_token

# Bytes of gradients one all-reduce may combine; all-gather and reduce-scatter scale from it.
COMBINE_THRESHOLD_BYTES = 1 << 30
# Where the NVIDIA driver lists each GPU (a folder per PCI address with an `information` file).
NVIDIA_PROC_ROOT = "/proc/driver/nvidia/gpus"


def gpu_xla_flags(instance_type: str) -> dict[str, str] | None:
    """The recommended flags for `gpu-<kind>-N` (module docstring), None for other instance types."""
    parsed = InstanceType.parse(instance_type)
    if parsed.platform != "gpu" or parsed.kind is None or parsed.count is None:
        return None
    count = parsed.count
    flags = {"xla_gpu_enable_latency_hiding_scheduler": "true"}
    if count > 1:
        flags.update(
            {
                "xla_gpu_enable_highest_priority_async_stream": "true",
                "xla_gpu_all_reduce_combine_threshold_bytes": str(COMBINE_THRESHOLD_BYTES),
                "xla_gpu_all_gather_combine_threshold_bytes": str(COMBINE_THRESHOLD_BYTES // count),
                "xla_gpu_reduce_scatter_combine_threshold_bytes": str(COMBINE_THRESHOLD_BYTES // (2 * count)),
                "xla_gpu_enable_pipelined_all_gather": "true",
                "xla_gpu_enable_pipelined_reduce_scatter": "true",
                "xla_gpu_enable_pipelined_all_reduce": "true",
                "xla_gpu_enable_while_loop_double_buffering": "true",
                "xla_gpu_enable_command_buffer": "",
            }
        )
    return flags


# The CUDA driver's launch-queue multiplier (its documented values: 0.25x, 0.5x, 2x, 4x).
LAUNCH_QUEUE_SCALE = "4x"


def gpu_runtime_environment(instance_type: str) -> dict[str, str] | None:
    """`CUDA_SCALE_LAUNCH_QUEUES=4x` for gpu instance types, None for others.

    XLA runs a whole train step as one CUDA graph of about a thousand kernels (the 0.89B
    benchmark: 736 fusions, 275 cuBLAS and 32 cuDNN calls). The driver's launch queue holds
    about one such step, so the host could run only one step ahead and then waited in
    `cuGraphLaunch` for the device: 193 ms of a 208 ms step per call, dispatch span over the
    interval 0.81. Four times the queue let it run about four steps ahead: 20 ms per call,
    span 0.505, the same step time (one H200, JAX 0.11.2, 2026-11-26; benchmarks/README.md).
    """
    parsed = InstanceType.parse(instance_type)
    if parsed.platform != "gpu":
        return None
    return {"CUDA_SCALE_LAUNCH_QUEUES": LAUNCH_QUEUE_SCALE}


def jax_cuda_installed() -> bool:
    """Whether JAX's CUDA plugin is installed (jax[cuda12], jax[cuda13] or a -local variant)."""
    for entry_point in importlib.metadata.entry_points(group="jax_plugins"):
        if "cuda" in entry_point.name or "cuda" in entry_point.value:
            return True
    return any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def probe_nvidia_instance_type(
    proc_root: str | os.PathLike = NVIDIA_PROC_ROOT, environ: Mapping[str, str] = os.environ
) -> str | None:
    """`gpu-<kind>-N` of this host's visible NVIDIA GPUs from the driver's /proc files, or None.

    Reads `<proc_root>/*/information` ("Model: NVIDIA H100 80GB HBM3"); N honours
    CUDA_VISIBLE_DEVICES (indices or UUIDs; empty hides every GPU). Starts nothing: no
    CUDA context, no JAX backend. Does not check that JAX can use the GPUs
    (`jax_cuda_installed` does).
    """
    root = pathlib.Path(proc_root)
    models = []
    for info in sorted(root.glob("*/information")) if root.is_dir() else []:
        for line in info.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model" and value.strip():
                models.append(value.strip())
                break
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        tokens = [token.strip() for token in visible.split(",") if token.strip()]
        if all(token.isdigit() for token in tokens):
            models = [models[int(token)] for token in tokens if int(token) < len(models)]
        else:  # UUIDs or MIG names: the count is what CUDA will show.
            models = models[:1] * len(tokens) if models else []
    if not models:
        return None
    return f"gpu-{device_kind_token(models[0])}-{len(models)}"


def probe_instance_type() -> str | None:
    """This host's GPU instance type when JAX can use its GPUs, else None (no backend started)."""
    platforms = [p for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p]
    if platforms and not {"cuda", "gpu"} & set(platforms):
        return None
    if not jax_cuda_installed():
        return None
    return probe_nvidia_instance_type()
