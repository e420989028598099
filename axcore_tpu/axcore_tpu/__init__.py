"""axcore-tpu: Google TPU support for axcore (splash and Pallas flash attention, TPU mesh rules,
compiler flags, host-offloading remat, int8 matmuls).

Installed, it is the `tpu` plugin, autoloaded where JAX's platform is `tpu`, and the
`int8` plugin, enabled with `plugins: [int8]`.
"""

from axcore_tpu.flash_attention import PallasTpuAttention
from axcore_tpu.instance_types import TpuInstance, parse_instance_type, probe_instance_type
from axcore_tpu.int8_dot import Int8Dot
from axcore_tpu.kernel_modifiers import int8_dot
from axcore_tpu.mesh_rules import tpu_mesh_rules, tpu_slices
from axcore_tpu.remat import offload_policy, remat_offload, tpu_remat
from axcore_tpu.sharding import mesh_layout
from axcore_tpu.splash_attention import SplashAttention
from axcore_tpu.xla_flags import FLAGS_ENVIRONMENT, tpu_xla_flags

__all__ = [
    "FLAGS_ENVIRONMENT",
    "Int8Dot",
    "PallasTpuAttention",
    "SplashAttention",
    "TpuInstance",
    "int8_dot",
    "mesh_layout",
    "offload_policy",
    "parse_instance_type",
    "probe_instance_type",
    "remat_offload",
    "tpu_mesh_rules",
    "tpu_remat",
    "tpu_slices",
    "tpu_xla_flags",
]
