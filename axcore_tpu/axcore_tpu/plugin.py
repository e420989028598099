"""The `tpu` plugin (entry point `tpu`): TPU attention kernels, mesh rules, compiler flags, remat and int8.

Autoloaded where JAX's platform is `tpu`, or for a `tpu-*` instance type (e.g.
`axcore config default --mesh-selector tpu-v5p-64` on a CPU machine, which resolves the
experiment as a TPU run would), or when named in `plugins:`. It registers:

- attention kernels `splash` (100) and `pallas_tpu` (90), both declining everything but
  TPUs (unless built with interpret=True);
- the `dot` kernel `int8` at priority -20 (by name only: the `int8_dot` modifier forces
  it on chosen layers; `plugins: [int8]` enables it everywhere instead);
- mesh rules `tpu-v4`, `tpu-v5e`, `tpu-v5p`, `tpu-v6e` (`axcore_tpu.mesh_rules`);
- config modifiers `remat_offload` (activations saved to host memory) and `int8_dot`;
- TPU compiler flags per generation, which go in LIBTPU_INIT_ARGS (`axcore_tpu.xla_flags`);
- the instance-type probe, from TPU_ACCELERATOR_TYPE and /dev without starting JAX.

It has no config transform, so listing it in `plugins:` changes nothing beyond the
registrations. Importing it probes no device and compiles nothing: kernels read the
problem only when a layer asks, and the probe reads the environment and /dev only when
called.
"""

from __future__ import annotations

from axcore import hookimpl

from axcore_tpu.flash_attention import PallasTpuAttention
from axcore_tpu.instance_types import probe_instance_type
from axcore_tpu.int8_dot import Int8Dot
from axcore_tpu.kernel_modifiers import int8_dot
from axcore_tpu.mesh_rules import tpu_mesh_rules
from axcore_tpu.remat import remat_offload
from axcore_tpu.splash_attention import SplashAttention
from axcore_tpu.xla_flags import flags_environment, tpu_xla_flags

# Below the reference kernels (0, 10): `int8` runs only where a layer names it.
INT8_BY_NAME_PRIORITY = -20


@hookimpl
def axcore_register_attention_kernels(register):
    register(SplashAttention())
    register(PallasTpuAttention())


@hookimpl
def axcore_register_kernels(register):
    register("dot", Int8Dot(priority=INT8_BY_NAME_PRIORITY))


@hookimpl
def axcore_register_mesh_rules(register):
    for rule in tpu_mesh_rules():
        register(rule)


@hookimpl
def axcore_register_config_modifiers(register):
    register("remat_offload", remat_offload)
    register("int8_dot", int8_dot)


@hookimpl
def axcore_probe_instance_type():
    return probe_instance_type()


@hookimpl
def axcore_xla_flags(instance_type):
    return tpu_xla_flags(instance_type)


@hookimpl
def axcore_flags_environment(instance_type):
    return flags_environment(instance_type)
