"""axcore-gpu: NVIDIA GPU support for axcore (cuDNN fused attention, GPU mesh rules).

Installed, it is the `gpu` plugin, autoloaded where JAX's platform is `gpu`.
"""

from axcore_gpu.cudnn_attention import CudnnAttention, dot_product_attention_arguments, mapped_attention, mesh_layout
from axcore_gpu.devices import cuda_compute_capability
from axcore_gpu.mesh_rules import GPU_KINDS, bfloat16_compute, gpu_mesh_rules

__all__ = [
    "GPU_KINDS",
    "CudnnAttention",
    "bfloat16_compute",
    "cuda_compute_capability",
    "dot_product_attention_arguments",
    "gpu_mesh_rules",
    "mapped_attention",
    "mesh_layout",
]
