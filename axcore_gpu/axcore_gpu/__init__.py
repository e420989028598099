"""axcore-gpu: NVIDIA GPU support for axcore (cuDNN and Pallas attention, GPU mesh rules, XLA flags, fp8).

Installed, it is the `gpu` plugin, autoloaded where JAX's platform is `gpu`.
"""

from axcore_gpu.cudnn_attention import CudnnAttention, dot_product_attention_arguments, mapped_attention, mesh_layout
from axcore_gpu.devices import cuda_compute_capability
from axcore_gpu.fp8_dot import Fp8Dot
from axcore_gpu.mesh_rules import GPU_KINDS, bfloat16_compute, gpu_mesh_rules
from axcore_gpu.pallas_attention import PallasAttention
from axcore_gpu.xla_flags import gpu_xla_flags

__all__ = [
    "GPU_KINDS",
    "CudnnAttention",
    "Fp8Dot",
    "PallasAttention",
    "bfloat16_compute",
    "cuda_compute_capability",
    "dot_product_attention_arguments",
    "gpu_mesh_rules",
    "gpu_xla_flags",
    "mapped_attention",
    "mesh_layout",
]
