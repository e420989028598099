"""The `gpu` plugin (entry point `gpu`): cuDNN and Pallas attention, GPU mesh rules and XLA flags.

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
from axcore_gpu.mesh_rules import gpu_mesh_rules
from axcore_gpu.pallas_attention import PallasAttention
from axcore_gpu.xla_flags import gpu_xla_flags, probe_instance_type


# The Pallas kernel is checked in interpret mode and lowered to Triton on CPU, but it has
# not run on a GPU yet: until it has, it is registered below the XLA reference (priority
# 0), so it runs only where a layer forces it (`kernels: {attention: pallas}`).
PALLAS_PRIORITY_UNTIL_VERIFIED = -10


@hookimpl
def axcore_register_attention_kernels(register):
    register(CudnnAttention())
    register(PallasAttention(priority=PALLAS_PRIORITY_UNTIL_VERIFIED))


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
