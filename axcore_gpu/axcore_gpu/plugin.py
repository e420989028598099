"""The `gpu` plugin (entry point `gpu`): cuDNN attention and GPU mesh rules.

Autoloaded on a GPU machine (the platform is `gpu`), which registers its kernels and
mesh rules; it has no config transform, so listing it in `plugins:` changes nothing
beyond that (it makes the rules available when resolving for a GPU elsewhere, e.g.
`--set mesh.instance_type=gpu-h100-8` on a CPU machine). Importing it probes no
device and compiles nothing: the kernel reads the device only when a layer asks it.
"""

from __future__ import annotations

from axcore import hookimpl

from axcore_gpu.cudnn_attention import CudnnAttention
from axcore_gpu.mesh_rules import gpu_mesh_rules


@hookimpl
def axcore_register_attention_kernels(register):
    register(CudnnAttention())


@hookimpl
def axcore_register_mesh_rules(register):
    for rule in gpu_mesh_rules():
        register(rule)
