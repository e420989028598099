"""The `gpu` plugin (entry point `gpu`): cuDNN and Pallas attention, a Pallas paged decode kernel, RMSNorm kernels, GPU mesh rules, XLA flags
and the CUDA driver's environment.

Autoloaded on a GPU machine (the platform is `gpu`), which registers its kernels and
mesh rules; it has no config transform, so listing it in `plugins:` changes nothing
beyond that (it makes the rules available when resolving for a GPU elsewhere, e.g.
`--set mesh.instance_type=gpu-h100-8` on a CPU machine). Importing it probes no
device and compiles nothing: the kernel reads the device only when a layer asks it,
and the instance-type probe reads the NVIDIA driver's /proc files only when called.
"""

from __future__ import annotations

from axcore import hookimpl

from axcore_gpu.cudnn_attention import CudnnAttention
from axcore_gpu.fused_norm import FusedVjpRMSNorm, PallasRMSNorm
from axcore_gpu.mesh_rules import gpu_mesh_rules
from axcore_gpu.pallas_attention import PallasAttention
from axcore_gpu.pallas_paged_attention import PallasPagedDecode
from axcore_gpu.xla_flags import gpu_runtime_environment, gpu_xla_flags, probe_instance_type

# The `rms_norm` kernels (fused_norm.py) have not been timed on a GPU either: below the XLA
# reference until they have, so they run only where forced (`kernels: {rms_norm: pallas}`).
FUSED_VJP_NORM_PRIORITY_UNTIL_TIMED = -5
PALLAS_NORM_PRIORITY_UNTIL_TIMED = -10
# The engine's decode kernel (pallas_paged_attention.py) checked in interpret mode and lowered to
# Triton on CPU only: below the XLA reference until timed on a GPU.
PALLAS_PAGED_DECODE_PRIORITY_UNTIL_TIMED = -5


@hookimpl
def axcore_register_attention_kernels(register):
    register(CudnnAttention())
    # Priority 90, between cuDNN and the reference: it ran on an H200 (2026-11-25) within
    # bfloat16 rounding of the reference and 7.2x faster than it on packed documents.
    register(PallasAttention())


@hookimpl
def axcore_register_kernels(register):
    register("rms_norm", FusedVjpRMSNorm(priority=FUSED_VJP_NORM_PRIORITY_UNTIL_TIMED))
    register("rms_norm", PallasRMSNorm(priority=PALLAS_NORM_PRIORITY_UNTIL_TIMED))
    register("paged_attention", PallasPagedDecode(priority=PALLAS_PAGED_DECODE_PRIORITY_UNTIL_TIMED))


@hookimpl
def axcore_register_mesh_rules(register):
    for rule in gpu_mesh_rules():
        register(rule)


@hookimpl
def axcore_probe_instance_type():
    return probe_instance_type()


@hookimpl
def axcore_xla_flags(instance_type):
    return gpu_xla_flags(instance_type)


@hookimpl
def axcore_runtime_environment(instance_type):
    return gpu_runtime_environment(instance_type)
